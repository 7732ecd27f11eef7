"""A process group whose rendezvous is on 127.0.0.1 keeps its collective traffic on the loopback interface."""

from __future__ import annotations

import os
import socket

import pytest

from posttrain.engine.distributed import keep_on_loopback, loopback_interface


@pytest.mark.skipif(not hasattr(socket, "if_nameindex"), reason="no interface listing on this platform")
def test_a_loopback_rendezvous_pins_gloo_and_nccl_to_the_loopback_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    interface = loopback_interface()
    assert interface in ("lo", "lo0")
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    keep_on_loopback("10.0.0.5")  # a cluster's rendezvous: the libraries choose
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    keep_on_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == interface
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice is kept
    keep_on_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
