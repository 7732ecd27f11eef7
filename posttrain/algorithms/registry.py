"""Name -> function registries for the algorithm zoo (advantage estimators, policy losses, KL estimators).

Users pick an algorithm by the name they know from papers and from verl ("grpo", "vanilla", "low_var_kl");
an unknown name fails at lookup with the list of valid names, so a typo in a config is caught at start.
This module is pure: it imports nothing but the project errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from posttrain.errors import ConfigError, PosttrainError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions of one kind.

    `kind` is the human name used in error messages ("advantage estimator", "policy loss").
    `error` is the exception raised for an unknown or duplicate name, so that other pure packages
    (rewards) can reuse the registry with their own project exception.
    """

    def __init__(self, kind: str, error: type[PosttrainError] = ConfigError) -> None:
        self.kind = kind
        self._error = error
        self._entries: dict[str, F] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator registering a function under `name` (and optional aliases, e.g. "k3" and "low_var_kl").

        Registering a name twice is an error: a silent override would make the meaning of a config
        depend on import order.
        """

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._entries:
                    previous = self._entries[key]
                    raise self._error(
                        f"{self.kind} {key!r} is already registered "
                        f"(by {previous.__module__}.{previous.__qualname__})"
                    )
            for key in (name, *aliases):
                self._entries[key] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """Return the function registered as `name`; raise with the valid names if there is none."""
        try:
            return self._entries[name]
        except KeyError:
            raise self._error(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """All registered names (aliases included), sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


ADVANTAGE_ESTIMATORS: Registry[Callable] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable] = Registry("KL estimator")


def register_advantage(name: str, *aliases: str) -> Callable[[F], F]:
    """Register an advantage estimator `(token_level_rewards, response_mask, group_ids, **kwargs)`."""
    return ADVANTAGE_ESTIMATORS.register(name, *aliases)


def register_policy_loss(name: str, *aliases: str) -> Callable[[F], F]:
    """Register a policy loss `(log_prob, old_log_prob, advantages, response_mask, **own_options)` returning
    `(per-token loss (B, R), metrics)`; its own options are keyword-only, with its defaults in the signature."""
    return POLICY_LOSSES.register(name, *aliases)


def register_kl(name: str, *aliases: str) -> Callable[[F], F]:
    """Register a per-token KL estimator `(log_prob, ref_log_prob) -> (B, R)`."""
    return KL_ESTIMATORS.register(name, *aliases)


def get_advantage_estimator(name: str) -> Callable:
    """The advantage estimator registered as `name` (ConfigError listing valid names otherwise)."""
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as `name` (ConfigError listing valid names otherwise)."""
    return POLICY_LOSSES.get(name)


def get_kl_estimator(name: str) -> Callable:
    """The KL estimator registered as `name` (ConfigError listing valid names otherwise)."""
    return KL_ESTIMATORS.get(name)
