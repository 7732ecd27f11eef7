import pytest

from posttrain.errors import RewardError
from posttrain.rewards import SCORERS, default_compute_score, get_scorer, register_scorer
from posttrain.rewards import gsm8k as gsm8k_module


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test are undone afterwards."""
    monkeypatch.setattr(SCORERS, "_entries", dict(SCORERS._entries))


def test_builtin_sources():
    assert {"arithmetic", "gsm8k", "openai/gsm8k"} <= set(SCORERS.names())
    assert get_scorer("gsm8k") is get_scorer("openai/gsm8k") is gsm8k_module.compute_score


def test_unknown_data_source_lists_known():
    with pytest.raises(
        RewardError,
        match=r"unknown data_source 'gsm9k'; valid: arithmetic, gsm8k, long_addition, openai/gsm8k",
    ):
        get_scorer("gsm9k")


def test_default_compute_score_dispatches_with_kwargs():
    assert default_compute_score("arithmetic", "so it is 12", "12") == 1.0
    assert default_compute_score("openai/gsm8k", "the answer is 72", "72") == 0.0  # strict needs ####
    assert default_compute_score("openai/gsm8k", "the answer is 72", "72", method="flexible") == 1.0


def test_register_scorer(scratch_registry):
    @register_scorer("tests/echo", "tests/echo2")
    def echo(solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str == ground_truth), "len": len(solution_str)}

    assert default_compute_score("tests/echo2", "ab", "ab", extra_info={}) == {"score": 1.0, "len": 2}
    with pytest.raises(RewardError, match="'gsm8k' is already registered"):
        register_scorer("gsm8k")(echo)
