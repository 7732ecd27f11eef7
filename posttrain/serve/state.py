"""What `posttrain serve` knows beyond the backend: who owns what, by the ids the SDK uses; kept in the
journal (journal.py) so that it survives a restart (recovery.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from posttrain.client import ServiceClient
from posttrain.client.sampling import SamplingClient
from posttrain.serve.adapters import Adapters, TrainingModel, is_internal
from posttrain.serve.futures import FutureStore, Request, Sequencer
from posttrain.serve.journal import Journal, SamplerRow
from posttrain.serve.limits import Limits, Meter
from posttrain.serve.tenants import ApiKeys

JOURNAL_NAME = "serve-journal.sqlite3"


@dataclass
class Sampler:
    """A sampling session in memory: its client, and the journal's record of what it samples from."""

    client: SamplingClient
    row: SamplerRow

    @property
    def tenant(self) -> str:
        return self.row.tenant

    @property
    def base_name(self) -> str:
        return self.row.base_name

    @property
    def model_path(self) -> str | None:
        return self.row.model_path


@dataclass(repr=False)
class ServerState:
    service: ServiceClient
    keys: ApiKeys
    served: dict[str, str]  # base model name -> model directory
    tokenizer_ids: dict[str, str] = field(
        default_factory=dict
    )  # base model name -> id reported (else its dir)
    poll_timeout_s: float = 20.0
    limits: Limits = field(default_factory=Limits)
    public_metrics: bool = False  # /metrics without a key, every tenant's series (else a key, its own)
    journal: Journal = field(init=False)  # <the backend's folder>/serve-journal.sqlite3
    meter: Meter = field(init=False)
    futures: FutureStore = field(init=False)
    sequencer: Sequencer = field(init=False)
    adapters: Adapters = field(init=False)
    sessions: dict[str, str] = field(default_factory=dict)  # session id -> tenant
    session_heard: dict[str, float] = field(default_factory=dict)  # session id -> monotonic time last heard
    # session id -> (tenant, why): finished by /finish or for want of heartbeats; 410 to whatever names it
    finished_sessions: dict[str, tuple[str, str]] = field(default_factory=dict)
    models: dict[str, TrainingModel] = field(default_factory=dict)  # tinker model id -> model
    lost: dict[str, tuple[str, str]] = field(default_factory=dict)  # model id -> (tenant, why): 410
    samplers: dict[str, Sampler] = field(default_factory=dict)  # in order of last use
    released_samplers: dict[str, str] = field(default_factory=dict)  # sampler id -> tenant
    dormant_samplers: dict[str, SamplerRow] = field(default_factory=dict)  # journaled, opened on first use
    lost_samplers: dict[str, tuple[str, str]] = field(
        default_factory=dict
    )  # sampler id -> (tenant, why): 410
    checkpoint_owner: dict[str, str] = field(default_factory=dict)  # backend model id -> tenant
    creating: dict[str, str] = field(default_factory=dict)  # model ids being created -> tenant (slots held)
    # model id -> (tenant, request id) of the create_model / load_weights that made it: a repeat gets that id
    creations: dict[str, tuple[str, str]] = field(default_factory=dict)
    stop: asyncio.Event | None = None  # set when a graceful stop begins: long polls return at once
    loop: asyncio.AbstractEventLoop | None = None

    def __post_init__(self) -> None:
        self.journal = Journal(self.service.backend.root / JOURNAL_NAME)
        self.meter = Meter(self.limits)
        self.futures = FutureStore(uuid.uuid4().hex[:8], self.journal, self._finished)
        self.sequencer = Sequencer(self.journal)
        self.adapters = Adapters(self)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "limits" and "meter" in self.__dict__:  # limits changed at run time: the rates follow
            self.meter.limits = value

    def _finished(self, request: Request, queue_seconds: float) -> None:
        self.meter.queued(request.tenant, queue_seconds)

    def queued(self, tenant: str) -> int:
        return self.futures.unfinished(tenant)

    def begin_stop(self) -> None:
        """A graceful stop begins (called from the signal handler): end the long polls now."""
        if self.loop is not None and self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)

    # ---- sessions and ownership ------------------------------------------------------------------
    def add_session(self, session_id: str, tenant: str) -> None:
        self.sessions[session_id] = tenant
        self.session_heard[session_id] = time.monotonic()
        self.journal.session(session_id, tenant)

    def session(self, session_id: str, tenant: str) -> None:
        """A tenant's live session, heard from now; 410 for one that finished (the SDK's heartbeat stops on
        it), 404 for an unknown or another tenant's."""
        if self.sessions.get(session_id) != tenant:
            finished = self.finished_sessions.get(session_id)
            if finished is not None and finished[0] == tenant:
                raise HTTPException(410, finished[1])
            raise HTTPException(404, f"no session {session_id!r}")
        self.session_heard[session_id] = time.monotonic()

    def heard_from(self, resource_id: str) -> None:
        """A request on a model or sampler (`<session>:train:<n>`, `<session>:sample:<n>`, ...) keeps its
        session alive, as a heartbeat does."""
        session_id = resource_id.split(":", 1)[0]
        if session_id in self.session_heard:
            self.session_heard[session_id] = time.monotonic()

    def finish_session(self, session_id: str, why: str) -> None:
        """End a session: its sampling sessions are released, its models' adapters saved and unloaded (the
        models stay: they are the tenant's, loaded again on their next request), and what names it later
        gets 410 with `why`."""
        tenant = self.sessions.pop(session_id, None)
        self.session_heard.pop(session_id, None)
        if tenant is None:
            return
        for sampler_id in [
            k for k in [*self.samplers, *self.dormant_samplers] if k.startswith(f"{session_id}:")
        ]:
            self.release_sampler(sampler_id)
        # its models stay the tenant's (a request naming one loads it again), but their slots are freed
        self.adapters.release_later(
            [m for m in list(self.models.values()) if m.model_id.startswith(f"{session_id}:")],
            "its session finished",
        )
        self.finished_sessions[session_id] = (tenant, why)
        while len(self.finished_sessions) > 100_000:  # remembered for a clear 410, within bounds
            self.finished_sessions.pop(next(iter(self.finished_sessions)))
        self.journal.session_finished(session_id, tenant, why)

    def expire_sessions(self, idle_seconds: float) -> list[str]:
        """Finish the sessions not heard from (no heartbeat, no request) for `idle_seconds`; their ids."""
        horizon = time.monotonic() - idle_seconds
        expired = [k for k, heard in list(self.session_heard.items()) if heard < horizon]
        for session_id in expired:
            self.finish_session(
                session_id,
                f"session {session_id!r} expired: no heartbeat or request for session_idle_seconds="
                f"{idle_seconds:g}; its sampling sessions were released (its models were kept); create a new "
                "session",
            )
        return expired

    def own_checkpoints(self, backend_id: str, tenant: str) -> None:
        self.checkpoint_owner[backend_id] = tenant
        self.journal.checkpoint_owner(backend_id, tenant)

    def model(self, model_id: str, tenant: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.tenant != tenant:
            lost = self.lost.get(model_id)
            if lost is not None and lost[0] == tenant:
                raise HTTPException(410, lost[1])
            raise HTTPException(404, f"no training model {model_id!r}")
        self.heard_from(model_id)
        return model

    def sampler(self, sampler_id: str, tenant: str) -> Sampler:
        """A tenant's sampling session (one journaled before a restart is opened again here, on its first
        use); 404 for an unknown or released one, 410 for one a restart lost."""
        dormant = self.dormant_samplers.get(sampler_id)
        if dormant is not None and dormant.tenant == tenant:
            self._reopen(dormant)
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.tenant != tenant:
            if self.released_samplers.get(sampler_id) == tenant:
                raise HTTPException(
                    404,
                    f"sampling session {sampler_id!r} was released: a tenant keeps its "
                    f"samplers_per_tenant={self.limits.samplers_per_tenant} most recently used ones, and a "
                    "finished session releases its own; create a new one",
                )
            lost = self.lost_samplers.get(sampler_id)
            if lost is not None and lost[0] == tenant:
                raise HTTPException(410, lost[1])
            raise HTTPException(404, f"no sampling session {sampler_id!r}")
        self.samplers[sampler_id] = self.samplers.pop(sampler_id)  # the most recently used: last
        self.heard_from(sampler_id)
        return sampler

    def open_sampler(self, row: SamplerRow) -> SamplingClient:
        """A sampling client on what `row` names: saved sampler weights, or a base model served here."""
        if row.model_path is not None:
            return self.service.create_sampling_client(model_path=row.model_path)
        return self.service.create_sampling_client(base_model=self.base_dir(row.base_name))

    def _reopen(self, row: SamplerRow) -> None:
        """Open a journaled sampling session again; if what it sampled from is gone, it is lost (410)."""
        del self.dormant_samplers[row.sampler_id]
        try:
            client = self.open_sampler(row)
        except (ValueError, HTTPException) as exc:
            source = (
                f"sampler weights {row.model_path}" if row.model_path else f"base model {row.base_name!r}"
            )
            detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
            why = (
                f"sampling session {row.sampler_id!r} could not be opened again after the server restarted: "
                f"its {source} is no longer here ({detail}); create a new one"
            )
            self.lost_samplers[row.sampler_id] = (row.tenant, why)
            self.journal.forget_sampler(row.sampler_id)
            return
        self.add_sampler(Sampler(client, row), journal=False)

    def add_sampler(self, sampler: Sampler, journal: bool = True) -> None:
        """Keep a new sampling session (and journal it); release the tenant's least recently used beyond
        the limit (the engine and its copy of the weights go with the last reference to the client)."""
        sampler_id = sampler.row.sampler_id
        if journal:
            self.journal.sampler(sampler.row)
        self.samplers[sampler_id] = sampler
        mine = [k for k, v in list(self.samplers.items()) if v.tenant == sampler.tenant]
        for old in mine[: max(0, len(mine) - self.limits.samplers_per_tenant)]:
            self.release_sampler(old)

    def release_sampler(self, sampler_id: str) -> None:
        sampler = self.samplers.pop(sampler_id, None)
        dormant = self.dormant_samplers.pop(sampler_id, None)
        tenant = sampler.tenant if sampler is not None else dormant.tenant if dormant is not None else None
        if tenant is not None:
            self.released_samplers[sampler_id] = tenant
            self.journal.sampler_released(sampler_id)
            self.sequencer.forget(sampler_id)
            while len(self.released_samplers) > 100_000:  # remembered for a clear 404, within bounds
                self.released_samplers.pop(next(iter(self.released_samplers)))

    def check_path(self, path: str, tenant: str, kind: str) -> None:
        """A tinker:// path of this tenant's own checkpoints (the backend then resolves it in its folder)."""
        try:
            backend_model_id, _ = self.service.backend.resolve(path, kind)
        except ValueError as exc:
            raise HTTPException(404, str(exc)) from None
        if self.checkpoint_owner.get(backend_model_id) != tenant or is_internal(path.rsplit("/", 1)[-1]):
            raise HTTPException(404, f"{path!r}: no such checkpoint")

    def served_name(self, base_dir: str | None, asked: str | None = None) -> str | None:
        """The served name of a checkpoint's base model directory (compared resolved: the server may have
        been started with another spelling of it); else `asked` (the client's), when served; else the only
        served model; None when it cannot be told."""
        for name, path in self.served.items():
            if base_dir and Path(path).resolve() == Path(base_dir).resolve():
                return name
        if asked in self.served:
            return asked
        return next(iter(self.served)) if len(self.served) == 1 else None

    def tokenizer_id(self, base_name: str, base_dir: str) -> str:
        """What `get_info` reports for the SDK's `AutoTokenizer.from_pretrained`: `--tokenizer-id` if given
        (e.g. a hub id, for clients on other machines), else the served directory (loads on this machine)."""
        return self.tokenizer_ids.get(base_name, base_dir)

    def base_dir(self, name: str) -> str:
        if name not in self.served:
            raise HTTPException(
                404, f"base model {name!r} is not served here; served: {', '.join(self.served)}"
            )
        return self.served[name]

    def hold_slot(self, model_id: str, tenant: str) -> None:
        """Count a model being created against the adapter limits from the moment it is asked for: per
        tenant and in total, the adapters loaded (a released model holds disk, not a slot: counting every
        model a tenant ever made blocked it for good after its fourth script run)."""
        if model_id in self.models or model_id in self.creating or model_id in self.lost:
            raise HTTPException(409, f"model {model_id!r} exists already")
        mine = self.adapters.loaded_by(tenant)
        self.limits.check_adapters(mine, self.adapters.occupied())
        self.creating[model_id] = tenant
