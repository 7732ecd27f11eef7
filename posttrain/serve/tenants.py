"""API keys -> tenants. Keys come from a file or the environment; none are built in.

A key has tinker's form (`tml-` followed by at least 16 letters, digits, '-' or '_'; the SDK refuses other
keys before sending them). The file is JSON, `{"tml-...": "tenant-name", ...}`; the environment variable
`POSTTRAIN_API_KEYS` holds `tml-...=tenant,tml-...=tenant`. A request without a key, or with one not listed,
is answered 401.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from fastapi import HTTPException

from posttrain.errors import ConfigError

KEY = re.compile(r"^tml-[A-Za-z0-9_-]{16,}$")
TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENV = "POSTTRAIN_API_KEYS"


class ApiKeys:
    def __init__(self, keys: Mapping[str, str]) -> None:
        if not keys:
            raise ConfigError(f"no API keys: give --keys FILE or set {ENV} (tml-...=tenant,...)")
        for key, tenant in keys.items():
            if not KEY.fullmatch(key):
                raise ConfigError(
                    f"API key {key[:8]}... must be 'tml-' followed by 16+ letters, digits, '-', '_'"
                )
            if not TENANT.fullmatch(tenant):
                raise ConfigError(f"tenant name {tenant!r}: letters, digits, '.', '_', '-' (at most 64)")
        self._keys = dict(keys)
        # looked up by digest: one dict lookup per request whatever the number of tenants, and no
        # comparison that exits early on the presented key itself
        self._by_digest = {_digest(key): tenant for key, tenant in keys.items()}

    @classmethod
    def load(cls, path: str | Path | None = None) -> ApiKeys:
        """From a JSON file, else from the environment."""
        if path is not None:
            try:
                data = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"API key file {path}: {exc}") from None
            if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
                raise ConfigError(f"API key file {path}: expected a JSON object of key -> tenant name")
            return cls(data)
        pairs = [p for p in os.environ.get(ENV, "").split(",") if p.strip()]
        keys = {}
        for pair in pairs:
            key, sep, tenant = pair.strip().partition("=")
            if not sep:
                raise ConfigError(f"{ENV}: expected tml-...=tenant, got {pair[:12]!r}...")
            keys[key] = tenant
        return cls(keys)

    def tenant(self, key: str | None) -> str:
        """The tenant of `key`, or a 401."""
        tenant = self._by_digest.get(_digest(key)) if key else None
        if tenant is None:
            raise HTTPException(401, "missing or unknown API key (X-API-Key)")
        return tenant

    def peek(self, key: str | None) -> str:
        """The tenant for logs ('-' when unknown)."""
        return self._keys.get(key or "", "-")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
