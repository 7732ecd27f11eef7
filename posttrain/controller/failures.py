"""One rank's failure, as Ray reports it, turned into a one-line `WorkerError` naming role, rank and cause.

When a rank's process dies inside a collective, its peers fail too (gloo: "Connection closed by peer"),
sometimes before Ray has noticed the death. The death is the cause worth reporting, so a peer's error is
held back for a short grace period while the other ranks' results come in.
"""

from __future__ import annotations

import logging
import re
import time
import traceback
from typing import Any

from posttrain.errors import ConfigError, DataError, WorkerError

log = logging.getLogger(__name__)

# what a worker raises for its input or settings: the same call raises it again after a restart
DETERMINISTIC_ERRORS = (ConfigError, DataError, ValueError, TypeError)

# How long a rank's error waits for news of a dead peer before it is reported as the cause.
PEER_DEATH_GRACE_S = 3.0
MEMORY_HINT = (
    "if memory ran out (dmesg shows the OOM killer), lower actor.micro_batch_size (or set "
    "actor.max_token_len_per_worker) and rollout.max_batch_size, or set model.gradient_checkpointing=true"
)


def death_reason(exc: Exception) -> str:
    """Why Ray says an actor is gone, in a few words: its pid and host, and the exit Ray saw."""
    text = str(exc)
    pid = re.search(r"\bpid: (\d+)", text)
    ip = re.search(r"\bip: ([\w.:-]+)", text)
    where = f"process {pid.group(1)}" if pid else "its process"
    if ip:
        where += f" on {ip.group(1)}"
    if "ray.kill" in text or "killed by `ray.kill`" in text:
        return f"{where} was killed by ray.kill"
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    if exit_type and exit_type.group(1) in ("SYSTEM_ERROR", "NODE_OUT_OF_MEMORY", "USER_ERROR"):
        cause = {
            "SYSTEM_ERROR": "killed by a signal (e.g. SIGKILL, the OOM killer) or crashed",
            "NODE_OUT_OF_MEMORY": "killed by Ray's memory monitor (node out of memory)",
            "USER_ERROR": "exited with an error",
        }[exit_type.group(1)]
        if exit_type.group(1) != "USER_ERROR":  # a process killed for memory cannot say so itself
            cause += f"; {MEMORY_HINT}"
        return f"{where} exited unexpectedly: {cause}"
    because = re.search(r"The actor is dead because ([^.]+)", text)
    if because:
        return f"{where}: {because.group(1)}"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"{where}: {first}"


def raised_message(exc: Any) -> str:
    """`Type: message` of the exception a rank raised (Ray wraps it in a RayTaskError): the first line of
    its message, where the cause is stated (a CUDA error's later lines are generic advice), marked `[...]`
    when more lines follow; the last line of a wrapper without its cause (a traceback ends with the error)."""
    cause = exc.cause if hasattr(exc, "cause") else exc  # a RayTaskError wraps it (or lost it: None)
    if cause is None:
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        return f"{type(exc).__name__}: {lines[-1] if lines else repr(exc)}"
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    if not lines:
        return f"{type(cause).__name__}: {cause!r}"
    more = " [...]" if len(lines) > 1 else ""
    return f"{type(cause).__name__}: {lines[0].strip()}{more}"


def raised_in(role: str, method: str, rank: int, exc: BaseException) -> WorkerError:
    """A rank's own exception as a `WorkerError`: deterministic (not worth a restart) when it is an error of
    the call's input or settings. Its full text, a remote traceback included, goes to the log first: the
    error keeps one line."""
    log.warning("%s rank %d raised in %s:\n%s", role, rank, method, _full_text(exc))
    cause = getattr(exc, "cause", None) or exc  # Ray's RayTaskError wraps it
    return WorkerError(
        f"{role} rank {rank} raised in {method}: {raised_message(exc)}",
        role=role,
        rank=rank,
        deterministic=isinstance(cause, DETERMINISTIC_ERRORS),
    )


def _full_text(exc: BaseException) -> str:
    """A RayTaskError's text holds the remote traceback; a local exception's traceback is formatted."""
    if getattr(exc, "cause", None) is not None:
        return str(exc)
    return "".join(traceback.format_exception(exc)).rstrip()


def rank_failure(
    role: str, method: str, rank: int, exc: Exception, pending: list[Any], rank_of: dict[Any, int]
) -> WorkerError:
    """The error to raise for `rank`'s failure in `method`: a dead peer among `pending` is preferred."""
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError):
        return WorkerError(
            f"{role} rank {rank} died during {method}: {death_reason(exc)}", role=role, rank=rank, died=True
        )
    dead = _dead_peer(pending, rank_of)
    if dead is not None:
        peer, peer_exc = dead
        return WorkerError(
            f"{role} rank {peer} died during {method}: {death_reason(peer_exc)} "
            f"(rank {rank} then failed: {_short(raised_message(exc))})",
            role=role,
            rank=peer,
            died=True,
        )
    return raised_in(role, method, rank, exc)


def _dead_peer(pending: list[Any], rank_of: dict[Any, int]) -> tuple[int, Exception] | None:
    """The first rank among `pending` that Ray reports dead within the grace period, with its error."""
    import ray
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + PEER_DEATH_GRACE_S
    remaining = list(pending)
    while remaining and (left := deadline - time.monotonic()) > 0:
        done, remaining = ray.wait(remaining, num_returns=1, timeout=left)
        if not done:
            break
        try:
            ray.get(done[0])
        except RayActorError as exc:
            return rank_of[done[0]], exc
        except Exception:  # another peer's own error: keep looking for a death
            continue
    return None


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
