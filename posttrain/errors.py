"""Project exceptions: every error a user can act on is one of these, with a message naming the problem."""


class PosttrainError(Exception):
    """Base class for all posttrain errors."""


class ConfigError(PosttrainError):
    """A configuration key or value is unknown, missing or inconsistent."""


class DataError(PosttrainError):
    """A dataset file or row is missing, malformed or unusable."""


class ModelError(PosttrainError):
    """A model or tokenizer directory is missing or cannot be loaded."""


class RewardError(PosttrainError):
    """A reward function cannot be loaded or returned an unusable value, or its scores failed too often
    (rewards/health.py: the message then carries the first failure's traceback)."""


class WorkerError(PosttrainError):
    """A worker raised or died; the message names the role and rank.

    `role` and `rank` say which worker (None when the error is not one rank's, e.g. a batch that does not
    split); `died` is True when its process is gone (killed, crashed), not merely raised; `deterministic` when
    what it raised is an error of the input or the settings (a ConfigError, DataError, ValueError or
    TypeError), which the same call would raise again after a restart.
    """

    def __init__(
        self,
        message: str,
        *,
        role: str | None = None,
        rank: int | None = None,
        died: bool = False,
        deterministic: bool = False,
    ) -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.died = died
        self.deterministic = deterministic


class OutOfMemoryError(PosttrainError):
    """An allocation failed (accelerator or CPU memory); the message names the settings that lower memory
    (engine/memory.py, rollout/native.py)."""


_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a failed allocation: MemoryError, torch.OutOfMemoryError (CUDA: "... out of memory")
    or the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory"), not another error."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MARKERS)
