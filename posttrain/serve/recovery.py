"""Starting again from the journal: what a restarted `posttrain serve` recovers, and how it says so.

- interrupted checkpoint writes are repaired first (checkpoints.recover);
- sessions and checkpoint ownership come back as they were: a tenant still reaches only its own;
- finished requests' answers stay in the journal: a poller gets its result as if nothing happened, and a
  create_model the SDK sends again (its answer lost in the restart) gets the first one's request id;
- requests that were in flight get an error naming what was lost (`the server restarted while this
  request ran; ...`), and what the model does next;
- a training model whose last durable state exists (its last `save_state`, or the server's own save of
  its idle adapter) keeps its tinker model id and its seq_id numbering; its adapter is loaded again from
  that state, with its optimizer, on its first request (adapters.py). Steps after that state are lost;
- a model with no durable state is gone: every request naming it answers 410, saying it had no save_state;
- a sampling session on a base model or on saved sampler weights is opened again on its first use; one on
  an in-memory snapshot of a training model's weights is gone: it answers 410 saying so.
"""

from __future__ import annotations

import logging
import time

from posttrain.serve.adapters import TrainingModel
from posttrain.serve.checkpoints import recover as repair_checkpoints
from posttrain.serve.journal import FutureRow, ModelRow
from posttrain.serve.state import ServerState

log = logging.getLogger("posttrain.serve")
RESTARTED = "the server restarted while this request ran; its result is lost"


def recover(state: ServerState) -> dict[str, int]:
    """Load the journal into a fresh state; counts of what was recovered (also logged)."""
    journal = state.journal
    repaired = repair_checkpoints(state.service.backend.root)
    state.finished_sessions.update(journal.finished_sessions())
    now = time.monotonic()  # a session's heartbeats resume after a restart: each gets a fresh idle window
    for session_id, tenant in journal.sessions().items():
        if session_id not in state.finished_sessions:
            state.sessions[session_id] = tenant
            state.session_heard[session_id] = now
    state.checkpoint_owner.update(journal.checkpoint_owners())
    state.creations.update(journal.creations())  # a creation retried across the restart gets its first answer
    seqs = journal.seqs()
    restorable, lost = [], []
    for key, seen in seqs.items():  # training models' and sampling sessions' seq_ids
        state.sequencer.restore(key, seen)
    for row in journal.models():
        if _exists(state, row.restore_path):
            state.models[row.model_id] = TrainingModel(
                row.model_id, row.tenant, row.base_name, row.lora, row.backend_id, row.restore_path,
                row.tenant_saved, gate=None,
            )  # fmt: skip
            restorable.append(f"{row.model_id} from {row.restore_path}")
        else:
            state.lost[row.model_id] = (row.tenant, _gone(row))
            lost.append(row.model_id)
    snapshots = _samplers(state)
    interrupted = journal.pending()
    for request in interrupted:
        journal.finished(request.request_id, {"error": _interrupted(state, request), "category": "server"})
    counts = {
        "sessions": len(state.sessions),
        "checkpoint_owners": len(state.checkpoint_owner),
        "finished_results": journal.count_done() - len(interrupted),
        "interrupted_requests": len(interrupted),
        "models_restorable": len(restorable),
        "models_lost": len(lost),
        "checkpoints_repaired": len(repaired),
        "sampling_sessions_restorable": len(state.dormant_samplers),
        "sampling_sessions_lost": snapshots,
    }
    if any(counts.values()):
        log.warning(
            "recovered from the journal %s: %d sessions, %d checkpoint owners, %d finished results kept, "
            "%d requests interrupted (they now answer an error), %d models to load again on first use "
            "(%s), %d models lost for want of a save_state (%s), %d sampling sessions to open again on first "
            "use, %d lost (in-memory snapshots)",
            journal.path, counts["sessions"], counts["checkpoint_owners"], counts["finished_results"],
            counts["interrupted_requests"], counts["models_restorable"], "; ".join(restorable) or "-",
            counts["models_lost"], ", ".join(lost) or "-", counts["sampling_sessions_restorable"], snapshots,
        )  # fmt: skip
    return counts


def _samplers(state: ServerState) -> int:
    """Journaled sampling sessions: released ones are remembered (for their 404), those on a base model or
    saved weights wait to be opened on first use, snapshots are lost (410; their rows are dropped). How many
    were lost."""
    lost = 0
    for row in state.journal.samplers():
        if row.released:
            state.released_samplers[row.sampler_id] = row.tenant
        elif row.snapshot_of is None:
            state.dormant_samplers[row.sampler_id] = row
        else:
            lost += 1
            state.lost_samplers[row.sampler_id] = (
                row.tenant,
                f"sampling session {row.sampler_id!r} was lost when the server restarted: it sampled from an "
                f"in-memory snapshot of training model {row.snapshot_of}'s weights "
                "(save_weights_and_get_sampling_client), and snapshots are not saved to disk; make a new one "
                "(or save sampler weights with a name: sessions on those survive a restart)",
            )
            state.journal.forget_sampler(row.sampler_id)
    return lost


def _exists(state: ServerState, path: str | None) -> bool:
    if path is None:
        return False
    try:
        state.service.backend.resolve(path, "weights")
    except ValueError:
        return False
    return True


def _gone(row: ModelRow) -> str:
    return (
        f"training model {row.model_id} was lost when the server restarted: it had no save_state (nothing "
        "durable to restore it from); create a new model"
    )


def _interrupted(state: ServerState, request: FutureRow) -> str:
    """What a request in flight at the restart answers: what was lost, and what the model does next."""
    message = f"{RESTARTED} ({request.kind})"
    if request.kind in ("create_model", "load_weights") and request.model_id not in state.models:
        return f"{message}: the model was not created; create it again"
    if request.model_id is None:
        return f"{message}; send it again"
    model = state.models.get(request.model_id)
    if model is None:
        return f"{message}; training model {request.model_id} had no save_state and is gone"
    saved = "its last save_state" if model.tenant_saved else "the server's own save of its idle adapter"
    return (
        f"{message}; training model {request.model_id} continues from {saved} ({model.restore_path}): this "
        "request and any step after that save are not in it; send them again"
    )
