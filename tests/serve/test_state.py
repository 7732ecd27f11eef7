"""The server's state parts on their own: the limits file, results leaving memory (not the journal),
crash-safe checkpoint writes, and the journal's sequencing after a restart."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.serve.checkpoints import publish, recover
from posttrain.serve.config import load_limits
from posttrain.serve.futures import FutureStore, Sequencer, UnknownRequest, failed, resolved
from posttrain.serve.journal import Journal
from posttrain.serve.limits import Limits


def test_the_limits_file_yaml_or_json_names_what_is_wrong(tmp_path: Path) -> None:
    yaml_file = tmp_path / "limits.yaml"
    yaml_file.write_text("max_lora_rank: 8\ntokens_per_second: 500\nadapter_idle_seconds: 60\n")
    assert load_limits(yaml_file) == Limits(max_lora_rank=8, tokens_per_second=500, adapter_idle_seconds=60)
    json_file = tmp_path / "limits.json"
    json_file.write_text('{"adapters_total": 3, "requests_per_second": 2.5}')
    assert load_limits(json_file) == Limits(adapters_total=3, requests_per_second=2.5)
    cases = {
        "max_lora_rnk: 8\n": r"unknown key 'max_lora_rnk'; valid keys: max_lora_rank, adapters_per_tenant",
        "max_lora_rank: eight\n": r"max_lora_rank: Value 'eight'",
        "adapters_total: -1\n": r"adapters_total must be a finite number >= 0, got -1",
        # NaN passes a `< 0` check and would switch the limit off; infinity crashed the stop's int()
        "requests_per_second: .nan\n": r"requests_per_second must be a finite number >= 0, got nan",
        "shutdown_grace_seconds: .inf\n": r"shutdown_grace_seconds must be a finite number >= 0, got inf",
        "- 1\n- 2\n": r"expected a mapping",
    }
    for text, message in cases.items():
        yaml_file.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_limits(yaml_file)
    with pytest.raises(ConfigError, match="no such file"):
        load_limits(tmp_path / "missing.yaml")


def test_results_leave_memory_when_retrieved_or_old_and_stay_in_the_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    store = FutureStore("t", journal)
    retrieved = store.add("alice", "optim_step", resolved({"metrics": {"x": 1.0}}), lambda r: r)
    old = store.add("alice", "sample", resolved(b"\x01\x02"), lambda r: r)
    broken = store.add("bob", "forward", failed(ValueError("bad input")), lambda r: r)
    running = store.add("bob", "forward", concurrent.futures.Future(), lambda r: r)
    assert store.in_memory() == 4 and store.accepted["forward"] == 2
    store.retrieved(store.get(retrieved, "alice"))
    time.sleep(0.02)
    assert store.evict(ttl_seconds=0.01) == 2  # old and broken (finished); the running one stays
    assert store.in_memory() == 1 and [r.request_id for r in store.pending()] == [running]
    # from the journal now, each to its own tenant only
    assert store.get(retrieved, "alice").answer.result() == {"metrics": {"x": 1.0}}
    assert store.get(old, "alice").answer.result() == b"\x01\x02"
    assert store.get(broken, "bob").answer.result() == {"error": "ValueError: bad input", "category": "user"}
    with pytest.raises(UnknownRequest):
        store.get(old, "bob")
    assert journal.purge(keep_seconds=3600) == 0 and journal.purge(keep_seconds=0) == 3
    with pytest.raises(UnknownRequest):
        store.get(old, "alice")  # the journal's time is bounded too
    failing = store.fail_pending("the server stopped")
    assert [r.request_id for r in failing] == [running]
    assert journal.future(running).answer == {"error": "the server stopped", "category": "server"}  # type: ignore[union-attr]
    journal.close()


def test_a_crash_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    final = tmp_path / "m" / "weights" / "ckpt"
    publish(final, lambda tmp: (tmp / "w").write_text("one"))
    assert (final / "w").read_text() == "one"

    def crash(tmp: Path) -> None:
        (tmp / "w").write_text("half")
        raise KeyboardInterrupt  # dies in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        publish(final, crash)
    assert (final / "w").read_text() == "one" and os.listdir(final.parent) == ["ckpt"]
    publish(final, lambda tmp: (tmp / "w").write_text("two"))
    assert (final / "w").read_text() == "two" and os.listdir(final.parent) == ["ckpt"]
    # a process killed between moving the old one aside and moving the new one in; and one mid-write
    os.rename(final, final.parent / ".old-ckpt-1234abcd")
    (final.parent / ".tmp-ckpt-5678abcd").mkdir()
    assert len(recover(tmp_path)) == 2
    assert (final / "w").read_text() == "two" and os.listdir(final.parent) == ["ckpt"]


def test_the_sequence_goes_on_after_a_restart(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    before = Sequencer(journal)
    for seq_id in (1, 2, 4):
        before.submit("m", seq_id, lambda: resolved(None))
        before.remember("m", seq_id, f"r{seq_id}")
    after = Sequencer(journal)
    after.restore("m", journal.seqs()["m"])
    assert after.seen("m", 2) == "r2"  # a retry of an applied request is still that request
    reused = after.submit("m", 4, lambda: resolved(None))
    assert "already used" in str(reused.exception())
    assert after.submit("m", 5, lambda: resolved("ran")).result() == "ran"
    journal.close()


def test_a_long_poll_that_times_out_or_is_stopped_leaves_the_request_running() -> None:
    store = FutureStore("t")
    work: concurrent.futures.Future[str] = concurrent.futures.Future()
    request = store.get(store.add("alice", "sample", work, lambda r: {"out": r}), "alice")

    async def polls() -> tuple[bool, bool, float]:
        timed_out = await FutureStore.wait(request, 0.05)
        stop = asyncio.Event()
        stop.set()
        start = time.monotonic()
        stopped = await FutureStore.wait(request, 30, stop)
        return timed_out, stopped, time.monotonic() - start

    timed_out, stopped, seconds = asyncio.run(polls())
    assert not timed_out and not stopped and seconds < 1
    work.set_result("done")  # the polls gave up; the request did not
    assert request.answer.result(timeout=1) == {"out": "done"}


def test_each_tenants_unfinished_requests_are_counted_as_they_change() -> None:
    """What queued_requests is checked against: requests taken on and not finished, per tenant, including
    those failed at shutdown; finished results still in memory do not count."""
    store = FutureStore("t")
    running: list[concurrent.futures.Future[int]] = [concurrent.futures.Future() for _ in range(3)]
    for future, tenant in zip(running, ("alice", "alice", "bob"), strict=True):
        store.add(tenant, "forward", future, lambda x: {"value": x})
    store.add("bob", "forward", resolved(1), lambda x: {"value": x})  # answered at once
    assert (store.unfinished("alice"), store.unfinished("bob"), store.unfinished("carol")) == (2, 1, 0)
    running[0].set_result(7)
    assert store.unfinished("alice") == 1 and store.in_memory() == 4  # its result is still held
    assert len(store.fail_pending("stopping")) == 2
    assert (store.unfinished("alice"), store.unfinished("bob")) == (0, 0)
    running[1].set_result(8)  # finishing after it failed: the first answer stands, nothing counted twice
    assert store.unfinished("alice") == 0
