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
    """A reward function cannot be loaded or returned an unusable value."""


class WorkerError(PosttrainError):
    """A worker raised or died; the message names the role and rank."""
