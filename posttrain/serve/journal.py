"""The server's journal: what `posttrain serve` must remember across a restart, in one SQLite file.

It lives in the state folder (`<state-dir>/serve-journal.sqlite3`, write-ahead log, `synchronous=NORMAL`:
a committed row survives the process being killed, not the machine losing power) and records

- sessions and their tenant;
- training models: tinker model id, tenant, base model name, the backend's model id, the LoRA spec, and the
  path of the model's last durable state (its last `save_state`, or the server's own save when it released
  the model's idle adapter);
- which tenant owns the checkpoints written under each backend model id;
- per model, each `seq_id` seen and the request id it got (the next `seq_id` is one past the highest);
- every request: id, tenant, kind, model, status, and once finished the answer `retrieve_future` gives
  (JSON, or protobuf bytes), kept for `journal_keep_seconds`.

What is durable, and what is not: a request's answer is written before the poller can see it, and a
`save_state` is journaled as the model's restore point before its future resolves, so a `save_state`
whose result you have survives a crash. Training after the last save lives only in memory: after a crash
the model comes back from that save (with its optimizer state) and later steps are lost; the requests that
were running answer an error saying so. A model that never saved is gone (410). A graceful stop (SIGTERM)
saves every loaded adapter first, so it loses nothing.

Sampling sessions are journaled by what they sample from: one on a base model or on saved sampler weights (a
`tinker://` path) is opened again on its first use after a restart; one on an in-memory snapshot of a
training model's weights (`save_weights_and_get_sampling_client` without a name) cannot be, and answers 410
saying so (snapshots are copies in memory by design: no disk round trip per RL step).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Answer = dict[str, Any] | bytes  # what retrieve_future returns: a JSON body, or protobuf bytes

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS finished_sessions (
    session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, why TEXT NOT NULL, finished REAL NOT NULL);
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, base_name TEXT NOT NULL, backend_id TEXT NOT NULL,
    lora TEXT NOT NULL, restore_path TEXT, tenant_saved INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS checkpoints (backend_id TEXT PRIMARY KEY, tenant TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS seqs (
    model_id TEXT NOT NULL, seq_id INTEGER NOT NULL, request_id TEXT NOT NULL, PRIMARY KEY (model_id, seq_id));
CREATE TABLE IF NOT EXISTS futures (
    request_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, kind TEXT NOT NULL, model_id TEXT,
    status TEXT NOT NULL, answer BLOB, proto INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL, finished REAL);
CREATE INDEX IF NOT EXISTS futures_finished ON futures (finished);
CREATE TABLE IF NOT EXISTS samplers (
    sampler_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, base_name TEXT NOT NULL, model_path TEXT,
    snapshot_of TEXT, released INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL);
"""
SEQS_KEPT = 1024  # per model: seq_ids older than the latest minus this are forgotten (a retry comes soon)


@dataclass(frozen=True)
class ModelRow:
    model_id: str
    tenant: str
    base_name: str
    backend_id: str
    lora: dict[str, Any]
    restore_path: str | None
    tenant_saved: bool  # whether restore_path was written by the tenant's save_state (else by a release)


@dataclass(frozen=True)
class SamplerRow:
    """A sampling session: on a base model (`model_path` and `snapshot_of` None), on saved sampler weights
    (`model_path`), or on an in-memory snapshot of training model `snapshot_of`."""

    sampler_id: str
    tenant: str
    base_name: str
    model_path: str | None = None
    snapshot_of: str | None = None
    released: bool = False


@dataclass(frozen=True)
class FutureRow:
    request_id: str
    tenant: str
    kind: str
    model_id: str | None
    status: str  # "pending" or "done"
    answer: Answer | None


class Journal:
    """Thread-safe (one connection behind a lock): the event loop, the backend thread and request threads
    all write to it. Every write commits at once."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._closed = False
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)

    def _write(self, sql: str, *args: Any) -> None:
        with self._lock:
            if not self._closed:  # a request finishing after the stop: its answer is not kept
                self._db.execute(sql, args)

    def _read(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self._lock:
            return [] if self._closed else self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        """Fold the write-ahead log into the file and close (later writes are dropped)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._db.close()

    # ---- sessions and ownership --------------------------------------------------------------------
    def session(self, session_id: str, tenant: str) -> None:
        self._write("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?)", session_id, tenant, time.time())

    def sessions(self) -> dict[str, str]:
        return {
            session_id: tenant for session_id, tenant in self._read("SELECT session_id, tenant FROM sessions")
        }

    def session_finished(self, session_id: str, tenant: str, why: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
            self._db.execute(
                "INSERT OR REPLACE INTO finished_sessions VALUES (?, ?, ?, ?)",
                (session_id, tenant, why, time.time()),
            )
            self._db.execute("COMMIT")

    def finished_sessions(self) -> dict[str, tuple[str, str]]:
        rows = self._read("SELECT session_id, tenant, why FROM finished_sessions ORDER BY finished")
        return {session_id: (tenant, why) for session_id, tenant, why in rows}

    def checkpoint_owner(self, backend_id: str, tenant: str) -> None:
        self._write("INSERT OR REPLACE INTO checkpoints VALUES (?, ?)", backend_id, tenant)

    def checkpoint_owners(self) -> dict[str, str]:
        return {
            backend_id: tenant
            for backend_id, tenant in self._read("SELECT backend_id, tenant FROM checkpoints")
        }

    # ---- training models -----------------------------------------------------------------------------
    def model(self, row: ModelRow) -> None:
        self._write(
            "INSERT OR REPLACE INTO models VALUES (?, ?, ?, ?, ?, ?, ?)",
            row.model_id, row.tenant, row.base_name, row.backend_id, json.dumps(row.lora),
            row.restore_path, int(row.tenant_saved),
        )  # fmt: skip

    def models(self) -> list[ModelRow]:
        rows = self._read("SELECT * FROM models")
        return [ModelRow(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5], bool(r[6])) for r in rows]

    # ---- sampling sessions ---------------------------------------------------------------------------
    def sampler(self, row: SamplerRow) -> None:
        self._write(
            "INSERT OR REPLACE INTO samplers VALUES (?, ?, ?, ?, ?, ?, ?)",
            row.sampler_id, row.tenant, row.base_name, row.model_path, row.snapshot_of, int(row.released),
            time.time(),
        )  # fmt: skip

    def sampler_released(self, sampler_id: str) -> None:
        self._write("UPDATE samplers SET released = 1 WHERE sampler_id = ?", sampler_id)

    def samplers(self) -> list[SamplerRow]:
        """Every sampling session, oldest first (the order of their last use is not kept)."""
        rows = self._read(
            "SELECT sampler_id, tenant, base_name, model_path, snapshot_of, released FROM samplers "
            "ORDER BY created"
        )
        return [SamplerRow(r[0], r[1], r[2], r[3], r[4], bool(r[5])) for r in rows]

    # ---- sequencing ----------------------------------------------------------------------------------
    def seq(self, model_id: str, seq_id: int, request_id: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._db.execute("INSERT OR REPLACE INTO seqs VALUES (?, ?, ?)", (model_id, seq_id, request_id))
            if seq_id % 256 == 0:  # now and then, forget the old ones
                self._db.execute(
                    "DELETE FROM seqs WHERE model_id = ? AND seq_id < ?", (model_id, seq_id - SEQS_KEPT)
                )

    def forget_seqs(self, key: str) -> None:
        self._write("DELETE FROM seqs WHERE model_id = ?", key)

    def seqs(self) -> dict[str, dict[int, str]]:
        out: dict[str, dict[int, str]] = {}
        for model_id, seq_id, request_id in self._read("SELECT model_id, seq_id, request_id FROM seqs"):
            out.setdefault(model_id, {})[seq_id] = request_id
        return out

    # ---- futures -------------------------------------------------------------------------------------
    def submitted(self, request_id: str, tenant: str, kind: str, model_id: str | None) -> None:
        self._write(
            "INSERT OR REPLACE INTO futures VALUES (?, ?, ?, ?, 'pending', NULL, 0, ?, NULL)",
            request_id, tenant, kind, model_id, time.time(),
        )  # fmt: skip

    def finished(self, request_id: str, answer: Answer) -> None:
        proto = isinstance(answer, bytes)
        blob = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        self._write(
            "UPDATE futures SET status = 'done', answer = ?, proto = ?, finished = ? WHERE request_id = ?",
            blob, int(proto), time.time(), request_id,
        )  # fmt: skip

    def future(self, request_id: str) -> FutureRow | None:
        rows = self._read(
            "SELECT request_id, tenant, kind, model_id, status, answer, proto FROM futures WHERE request_id = ?",
            request_id,
        )
        return _future_row(rows[0]) if rows else None

    def pending(self) -> list[FutureRow]:
        rows = self._read(
            "SELECT request_id, tenant, kind, model_id, status, answer, proto FROM futures WHERE status = 'pending'"
        )
        return [_future_row(r) for r in rows]

    def creations(self) -> dict[str, tuple[str, str]]:
        """model id -> (tenant, request id) of the request that created it (create_model or load_weights from
        a session; a model's first request): what a retried creation is answered with after a restart."""
        rows = self._read(
            "SELECT model_id, tenant, request_id FROM futures WHERE kind IN ('create_model', 'load_weights') "
            "AND model_id IS NOT NULL ORDER BY created DESC"
        )
        return {model_id: (tenant, request_id) for model_id, tenant, request_id in rows}  # the first wins

    def count_done(self) -> int:
        rows = self._read("SELECT COUNT(*) FROM futures WHERE status = 'done'")
        return int(rows[0][0]) if rows else 0

    def forget_sampler(self, sampler_id: str) -> None:
        self._write("DELETE FROM samplers WHERE sampler_id = ?", sampler_id)

    def purge(self, keep_seconds: float) -> int:
        """Forget answers finished, and sessions finished or sampling sessions released, more than
        `keep_seconds` ago (their rows are kept only to say so in a 410 or 404); how many answers."""
        with self._lock:
            if self._closed:
                return 0
            horizon = time.time() - keep_seconds
            self._db.execute("DELETE FROM samplers WHERE released = 1 AND created < ?", (horizon,))
            self._db.execute("DELETE FROM finished_sessions WHERE finished < ?", (horizon,))
            cursor = self._db.execute(
                "DELETE FROM futures WHERE status = 'done' AND finished < ?", (horizon,)
            )
            return cursor.rowcount


def _future_row(row: tuple[Any, ...]) -> FutureRow:
    request_id, tenant, kind, model_id, status, blob, proto = row
    answer: Answer | None = None
    if blob is not None:
        answer = bytes(blob) if proto else json.loads(blob)
    return FutureRow(request_id, tenant, kind, model_id, status, answer)
