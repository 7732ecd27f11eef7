"""The server's upkeep while it runs, and its graceful stop.

Upkeep (a task on the event loop, every quarter second when adapters may go idle, else every second):
finished results leave memory after `future_ttl_seconds`, the journal forgets answers older than
`journal_keep_seconds` and checkpoints whose `ttl_seconds` ran out are deleted (checked every minute), sessions not heard from for `session_idle_seconds` finish,
requests waiting longer than `seq_gap_seconds` for a missing seq_id of their model go on without it, and
adapters idle for `adapter_idle_seconds` are released.

A graceful stop (SIGTERM or SIGINT; uvicorn has stopped taking requests, and the long polls have returned
`try_again`): requests parked behind a missing seq_id fail at once (that id will not come now), running
ones get `shutdown_grace_seconds` to finish, those still running then fail with an error saying so; every
loaded adapter is saved (the server's own save, as for an idle one; one whose request still runs after that
request, waiting at most `BUSY_SAVE_WAIT_S` or the grace time), so after a restart each model goes on exactly
where it stopped; the journal is closed. Every answer is in the journal for pollers to fetch from
the restarted server.
"""

from __future__ import annotations

import asyncio
import logging
import time

from posttrain.serve.state import ServerState

log = logging.getLogger("posttrain.serve")
PURGE_EVERY_S = 60.0
# a stop saves a model whose request outlived the grace time after that request: how long it may wait for both
BUSY_SAVE_WAIT_S = 60.0


class ServerStopped(RuntimeError):
    """The server stopped before this request could run."""


async def maintain(state: ServerState) -> None:
    last_purge = 0.0
    while True:
        limits = state.limits
        await asyncio.sleep(0.25 if limits.adapter_idle_seconds > 0 else 1.0)
        try:
            state.futures.evict(limits.future_ttl_seconds)
            if limits.session_idle_seconds > 0:
                for session_id in state.expire_sessions(limits.session_idle_seconds):
                    log.warning(
                        "session %s expired (not heard from in %gs)", session_id, limits.session_idle_seconds
                    )
            if limits.seq_gap_seconds > 0:
                for model_id, seq_id in state.sequencer.skip_gaps(limits.seq_gap_seconds):
                    log.warning(
                        "model %s: seq_id %d never came within seq_gap_seconds=%g; its later requests run",
                        model_id, seq_id, limits.seq_gap_seconds,
                    )  # fmt: skip
            if time.monotonic() - last_purge > PURGE_EVERY_S:
                last_purge = time.monotonic()
                await asyncio.to_thread(state.journal.purge, limits.journal_keep_seconds)
                for path in await asyncio.to_thread(state.adapters.expire):
                    log.info("checkpoint %s expired (its ttl_seconds ran out): deleted", path)
            if limits.adapter_idle_seconds > 0:
                await asyncio.to_thread(state.adapters.sweep, limits.adapter_idle_seconds)
        except Exception:  # noqa: BLE001 - upkeep goes on; the next round tries again
            log.exception("server upkeep failed")


def shut_down(state: ServerState) -> dict[str, int]:
    """Finish or fail what is running, save the loaded adapters, close the journal (blocking)."""
    grace = state.limits.shutdown_grace_seconds
    parked = state.sequencer.fail_parked(
        ServerStopped(
            "the server stopped while this request waited for an earlier seq_id of its model; not applied"
        )
    )
    pending = len(state.futures.pending())
    state.futures.wait_all(grace)
    failed = state.futures.fail_pending(
        f"the server stopped while this request ran (it did not finish within shutdown_grace_seconds={grace:g}); "
        "it may or may not have been applied"
    )
    saved = state.adapters.release_all(wait_s=max(grace, BUSY_SAVE_WAIT_S))
    state.journal.close()
    counts = {"parked_failed": parked, "finished": pending - len(failed), "failed": len(failed)}
    counts["adapters_saved"] = saved
    log.warning(
        "stopped: %d running requests finished, %d failed (%d waiting for a seq_id, %d past the grace "
        "time); %d adapters saved; journal closed",
        counts["finished"], parked + len(failed), parked, len(failed), saved,
    )  # fmt: skip
    return counts
