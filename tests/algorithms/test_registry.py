import pytest

from posttrain.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    compute_grpo_advantages,
    get_advantage_estimator,
    get_policy_loss,
    ppo_clip_loss,
)
from posttrain.errors import ConfigError, RewardError


def test_builtin_names_are_registered():
    assert "grpo" in ADVANTAGE_ESTIMATORS.names()
    assert "vanilla" in POLICY_LOSSES.names()
    assert {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"} <= set(KL_ESTIMATORS.names())
    assert get_advantage_estimator("grpo") is compute_grpo_advantages
    assert get_policy_loss("vanilla") is ppo_clip_loss


def test_unknown_name_lists_valid_names():
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'grpoo'; valid: .*grpo"):
        get_advantage_estimator("grpoo")
    with pytest.raises(ConfigError, match=r"unknown policy loss 'vanila'; valid: .*vanilla"):
        get_policy_loss("vanila")


def test_register_get_names_and_aliases():
    registry: Registry = Registry("widget")

    @registry.register("b", "alias_b")
    def fn_b():
        return "b"

    @registry.register("a")
    def fn_a():
        return "a"

    assert registry.get("b") is fn_b and registry.get("alias_b") is fn_b
    assert registry.names() == ["a", "alias_b", "b"]
    assert "a" in registry and "c" not in registry
    with pytest.raises(ConfigError, match=r"^unknown widget 'c'; valid: a, alias_b, b$"):
        registry.get("c")


def test_duplicate_name_is_an_error_and_keeps_the_first():
    registry: Registry = Registry("widget")

    @registry.register("x")
    def first():
        return 1

    with pytest.raises(ConfigError, match=r"widget 'x' is already registered .*first"):

        @registry.register("y", "x")
        def second():
            return 2

    assert registry.get("x") is first
    assert "y" not in registry  # a failed registration registers nothing


def test_custom_error_class():
    registry: Registry = Registry("data_source", error=RewardError)
    with pytest.raises(RewardError, match="unknown data_source 'gsm9k'"):
        registry.get("gsm9k")
