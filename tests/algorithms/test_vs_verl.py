"""verl as an oracle: posttrain's algorithm layer against verl's own `core_algos` and `rollout_corr_helper`.

Every advantage estimator, policy loss, KL estimator and loss-aggregation mode that verl also has, the value
loss, the KL-in-reward penalty and controllers, and the rollout corrections (truncated IS weights, rejection
sampling, bypass mode) run on the same float64 inputs in both, and the outputs (advantages and returns,
aggregated losses and their gradients, the metrics both report) must agree to 1e-6, absolute and relative.
Inputs: random batches over several seeds, multi-turn masks (tool output inside a response), groups of one,
empty rows, an all-masked batch, tied scores, and log-ratios beyond verl's +-20 clamp.

Every deliberate difference is one entry of DELIBERATE, with its reason. A test that meets one compares what
is still comparable (e.g. verl given the inputs posttrain clamps), and a `test_deliberate_*` test builds a case
that shows the difference and asserts it, so an entry cannot outlive the difference it describes.

verl pins older transformers and tensordict than posttrain, so this runs in the separate .venv-verl:

    bash scripts/verl_oracle_env.sh && .venv-verl/bin/python -m pytest tests/algorithms/test_vs_verl.py -m verl_oracle

(`.ci/run` does this). Where verl cannot be imported (posttrain's own .venv) the module is skipped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from posttrain.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    apply_kl_penalty,
    get_advantage_estimator,
    get_policy_loss,
    kl_penalty,
)
from posttrain.algorithms.policy_loss import compute_policy_loss, own_options
from posttrain.algorithms.rollout_correction import (
    RolloutCorrection,
    importance_weights,
    rejection_mask,
)
from posttrain.algorithms.value_loss import clipped_value_loss
from posttrain.errors import ConfigError

pytestmark = pytest.mark.verl_oracle

try:
    from verl.trainer.config import AlgoConfig
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos as V
    from verl.trainer.ppo import rollout_corr_helper as VR
    from verl.workers.config import ActorConfig, PolicyLossConfig
except Exception as exc:  # ImportError in posttrain's .venv; anything else is a broken .venv-verl
    pytest.skip(
        f"verl is not importable here ({type(exc).__name__}: {exc}); the verl oracle runs in its own "
        "environment: bash scripts/verl_oracle_env.sh && .venv-verl/bin/python -m pytest "
        "tests/algorithms/test_vs_verl.py -m verl_oracle",
        allow_module_level=True,
    )

# ---------------------------------------------------------------------------------------------------------
# The one list of deliberate differences: name -> reason. Each is asserted by a test_deliberate_* below.
# ---------------------------------------------------------------------------------------------------------
DELIBERATE: dict[str, str] = {
    "outside_mask": (
        "posttrain's advantages and returns are exactly 0 outside response_mask; verl leaves GAE's whitened "
        "advantages and the returns of GAE, ReMax and the optimal-token-baseline estimators at masked positions. "
        "Compared on the mask; posttrain is asserted 0 elsewhere"
    ),
    "opo_empty_group": (
        "OPO: a group whose responses are all empty has length-weighted baseline 0/0; verl's advantages are "
        "NaN on those rows (NaN * mask 0 stays NaN), posttrain's are 0"
    ),
    "zero_total": (
        "aggregation of a batch without a valid token (token-mean and the seq-mean modes with local totals): "
        "posttrain treats the zero total as 1 (loss 0, gradient 0), verl divides 0 by 0 (NaN)"
    ),
    "log_ratio_clamp": (
        "posttrain clamps every token log-ratio log(pi/pi_old) to [-20, 20] before use in every policy loss; "
        "verl does so in vanilla, sapo, cispo and dppo but not in gspo, geo_mean, clip_cov and kl_cov (nor in "
        "dro's ppo_kl metric). Where |log r| > 20 on a valid token they are compared with verl given the "
        "clamped old log-probs: values everywhere, gradients on the unclamped tokens (posttrain's clamp stops a "
        "clamped token's gradient, as verl's own clamp does in vanilla)"
    ),
    "geo_mean_aggregation": (
        "verl's geo_mean ignores loss_agg_mode and takes torch.mean over all rows, empty rows included; "
        "posttrain honours loss_agg_mode. Equal under seq-mean-token-mean with global_seqs = the number of rows"
    ),
    "geo_mean_is_weights": (
        "with rollout IS weights, verl multiplies geo_mean's sequence loss by the geometric mean of the row's "
        "weights; posttrain multiplies the per-token losses by the weights (their arithmetic mean, in effect)"
    ),
    "sapo_aggregation": (
        "verl's sapo always aggregates with seq-mean-token-mean whatever loss_agg_mode says; posttrain honours "
        "loss_agg_mode. Equal under seq-mean-token-mean"
    ),
    "cov_metric_names": (
        "verl reports clip_cov's covariance-clip fraction as pg_clipfrac and kl_cov's mean |log r| as ppo_kl; "
        "posttrain names them clip_cov_frac and ppo_kl_abs and keeps pg_clipfrac / ppo_kl in their common "
        "meaning. Compared under the renamed keys"
    ),
    "rs_k1_bounds": (
        "k1 rejection sampling: verl's code bounds -log r (i.e. 1/r) by log(lower), log(upper); posttrain "
        "bounds r itself, as verl's documentation describes 'lower_upper'. Equal for one number u ([1/u, u]), "
        "different for asymmetric bounds"
    ),
    "rejection_normaliser": (
        "verl removes rejected tokens from response_mask before aggregating, so they leave the token and "
        "sequence counts and a row's length; posttrain keeps their place in every normaliser with loss 0, so "
        "rejecting never scales the other tokens up. Equal when verl is given the unrejected totals, except "
        "seq-mean-token-mean after token-level rejection (a row's own length)"
    ),
    "empty_rows_in_metrics": (
        "verl's overall rollout_rs_seq_masked_fraction, sequence-level rollout_is_ratio_fraction_* and its "
        "KL-in-reward metric average over every row, empty ones included; posttrain over rows with a valid "
        "token (as verl's per-option rejection fractions do). Compared when no row is empty"
    ),
    "empty_batch_correction": (
        "verl's rollout correction raises on a batch without a valid token; posttrain returns weight 0 and "
        "keeps everything (a micro-batch of padding is legal)"
    ),
    "rloo_vectorized_singletons": (
        "verl's two RLOO implementations disagree on a group of one: rloo (and posttrain) leaves the raw score "
        "as advantage (no baseline), rloo_vectorized gives 0. posttrain's rloo is compared with rloo_vectorized "
        "on the rows of larger groups"
    ),
    "gdpo_components_float32": (
        "GDPO with several reward components: verl casts the components to float32 (np.float32) before "
        "normalising; posttrain keeps the caller's dtype. Compared on components exact in float32 (quarters)"
    ),
}

RTOL = ATOL = 1e-6
DTYPE = torch.float64
R = 10  # response width


def deliberate(name: str) -> str:
    """The reason of DELIBERATE[name] (a KeyError here means a difference that is not on the list)."""
    return DELIBERATE[name]


def close(ours: torch.Tensor | float, theirs: torch.Tensor | float, what: str, tol: float = ATOL) -> None:
    ours_t = torch.as_tensor(ours, dtype=DTYPE)
    theirs_t = torch.as_tensor(theirs).to(DTYPE)
    torch.testing.assert_close(ours_t, theirs_t, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def differs(ours: torch.Tensor | float, theirs: torch.Tensor | float) -> bool:
    ours_t, theirs_t = torch.as_tensor(ours, dtype=DTYPE), torch.as_tensor(theirs).to(DTYPE)
    return not torch.allclose(ours_t, theirs_t, rtol=RTOL, atol=ATOL, equal_nan=False)


# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------
GROUP_SIZES = {
    "random": [4, 3, 1, 4],
    "multi_turn": [3, 3, 2, 4],
    "groups_of_one": [1, 1, 1, 1, 1, 1],
    "empty_rows": [3, 2, 3, 2],  # rows 0, 3 and 4 are empty: group p1 (rows 3, 4) has no valid token at all
    "ties": [4, 4, 2, 3],  # binary scores; p0 all right, p1 all wrong
    "extreme": [4, 4, 3],  # log-ratios beyond +-20 on valid tokens
    "all_masked": [3, 3],
}
SCENARIOS = (
    [("random", seed) for seed in range(4)]
    + [("multi_turn", seed) for seed in range(2)]
    + [("extreme", seed) for seed in range(2)]
    + [("groups_of_one", 0), ("empty_rows", 0), ("ties", 0), ("all_masked", 0)]
)
SCENARIO_IDS = [f"{kind}-{seed}" for kind, seed in SCENARIOS]


@dataclasses.dataclass(frozen=True)
class Batch:
    kind: str
    mask: torch.Tensor  # (B, R) float64 0/1
    lengths: torch.Tensor  # (B,) attended response length (a multi-turn row's tool tokens count)
    index: np.ndarray  # (B,) group ids, the `uid` column
    rewards: torch.Tensor  # token-level rewards
    components: torch.Tensor  # (B, 2) reward components for GDPO (quarters: exact in float32)
    values: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    reward_baselines: torch.Tensor  # (B,)
    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    ref_log_prob: torch.Tensor
    rollout_log_prob: torch.Tensor
    advantages: torch.Tensor
    sum_pi_squared: torch.Tensor

    @property
    def has_empty_rows(self) -> bool:
        return bool((self.mask.sum(-1) == 0).any())

    @property
    def empty(self) -> bool:
        return not bool(self.mask.any())

    def has_extreme(self) -> bool:
        """Whether a valid token's log(pi / pi_old) is beyond posttrain's (and part of verl's) +-20 clamp."""
        return bool((((self.log_prob - self.old_log_prob).abs() > 20) & (self.mask > 0)).any())


def make_batch(kind: str, seed: int) -> Batch:
    g = torch.Generator().manual_seed(1000 * seed + sorted(GROUP_SIZES).index(kind))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=DTYPE)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g, dtype=DTYPE)

    sizes = GROUP_SIZES[kind]
    batch = sum(sizes)
    index = np.array([f"p{group}" for group, size in enumerate(sizes) for _ in range(size)], dtype=object)
    lengths = torch.randint(1, R + 1, (batch,), generator=g)
    if kind == "empty_rows":
        lengths[[0, 3, 4]] = 0
    if kind == "all_masked":
        lengths[:] = 0
    mask = (torch.arange(R) < lengths.unsqueeze(-1)).to(DTYPE)
    if kind == "multi_turn":  # a tool-output span of 2 tokens inside each long enough response
        for row in range(batch):
            if lengths[row] >= 5:
                start = int(torch.randint(1, int(lengths[row]) - 2, (1,), generator=g))
                mask[row, start : start + 2] = 0.0

    if kind == "ties":
        outcome = torch.randint(0, 2, (batch,), generator=g).to(DTYPE)
        outcome[:4], outcome[4:8] = 1.0, 0.0
        shaping = torch.zeros(batch, R, dtype=DTYPE)
    else:
        outcome = randn(batch)
        shaping = 0.1 * randn(batch, R) * mask
    rewards = shaping.clone()
    for row in range(batch):
        valid = mask[row].nonzero()
        if valid.numel():
            rewards[row, int(valid[-1])] += outcome[row]

    p = rand(batch, R) * 0.98 + 0.01
    p_old = (p * torch.exp(0.3 * randn(batch, R))).clamp(max=0.995)
    p_ref = (p * torch.exp(0.3 * randn(batch, R))).clamp(max=0.995)
    p_rollout = (p_old * torch.exp(0.2 * randn(batch, R))).clamp(max=0.995)
    log_prob, old_log_prob = p.log(), p_old.log()
    ref_log_prob, rollout_log_prob = p_ref.log(), p_rollout.log()
    if kind == "extreme":  # |log r| > 20 on valid tokens, both ways; rollout and reference log-ratios too
        valid = mask.flatten().nonzero().squeeze(-1)
        picked = valid[torch.randperm(valid.numel(), generator=g)[:6]]
        lp, old, ref, roll = (t.view(-1) for t in (log_prob, old_log_prob, ref_log_prob, rollout_log_prob))
        lp[picked[:3]], old[picked[:3]] = -28.0, -1.0
        lp[picked[3:]], old[picked[3:]] = -0.5, -26.0
        ref[picked[::2]] = -30.0
        roll[picked[1::2]] = old[picked[1::2]] - 25.0
        roll[picked[::2]] = (old[picked[::2]] + 22.0).clamp(max=-0.01)

    sum_pi_squared = p_old.square() + (1 - p_old).square() * rand(batch, R)
    return Batch(
        kind=kind,
        mask=mask,
        lengths=lengths,
        index=index,
        rewards=rewards,
        components=torch.randint(0, 9, (batch, 2), generator=g).to(DTYPE) / 4,
        values=randn(batch, R),
        old_values=randn(batch, R),
        returns=2 * randn(batch, R),
        reward_baselines=randn(batch),
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        ref_log_prob=ref_log_prob,
        rollout_log_prob=rollout_log_prob,
        advantages=1.5 * randn(batch, R),
        sum_pi_squared=sum_pi_squared,
    )


@pytest.fixture(params=SCENARIOS, ids=SCENARIO_IDS)
def batch(request: pytest.FixtureRequest) -> Batch:
    return make_batch(*request.param)


def outcome(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """(result, None) or (None, the exception)."""
    try:
        return fn(), None
    except Exception as exc:  # the oracle compares raising too
        return None, exc


# ---------------------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------------------
def _ours(name: str, **options: Any) -> Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]:
    def run(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        resolved = {k: (v(b) if callable(v) else v) for k, v in options.items()}
        return get_advantage_estimator(name)(b.rewards.clone(), b.mask.clone(), b.index, **resolved)

    return run


def _is_weights(b: Batch) -> torch.Tensor:
    return (b.old_log_prob - b.rollout_log_prob).clamp(-20, 20).exp().clamp(max=2.0) * b.mask


def _gdpo_components_verl(b: Batch, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GDPO with two reward components, fed the way its trainer feeds them (non_tensor_batch + batch)."""
    prompt = 3
    attention = torch.cat(
        [torch.ones(b.mask.shape[0], prompt), torch.arange(R) < b.lengths[:, None]], 1
    ).long()
    config = AlgoConfig(
        gdpo_reward_keys=["c0", "c1"], gdpo_reward_weights=[1.0, 0.5], norm_adv_by_std_in_grpo=norm
    )
    return V.compute_gdpo_outcome_advantage(
        b.rewards.clone(),
        b.mask.clone(),
        b.index,
        norm_adv_by_std_in_grpo=norm,
        config=config,
        non_tensor_batch={"c0": b.components[:, 0].numpy(), "c1": b.components[:, 1].numpy()},
        batch={"prompts": torch.zeros(b.mask.shape[0], prompt), "attention_mask": attention},
    )


# id -> (posttrain, verl, posttrain's registered name, verl's registered name)
ESTIMATORS: dict[str, tuple[Callable, Callable, str, str]] = {
    "gae": (
        _ours("gae", values=lambda b: b.values, gamma=0.95, lam=0.9),
        lambda b: V.compute_gae_advantage_return(
            b.rewards.clone(), b.values, b.mask.clone(), gamma=0.95, lam=0.9
        ),
        "gae",
        "gae",
    ),
    "gae-gamma1-lam1": (
        _ours("gae", values=lambda b: b.values),
        lambda b: V.compute_gae_advantage_return(
            b.rewards.clone(), b.values, b.mask.clone(), gamma=1.0, lam=1.0
        ),
        "gae",
        "gae",
    ),
    "grpo": (
        _ours("grpo"),
        lambda b: V.compute_grpo_outcome_advantage(b.rewards.clone(), b.mask.clone(), b.index),
        "grpo",
        "grpo",
    ),
    "grpo-dr-no-std": (
        _ours("grpo", norm_by_std=False),
        lambda b: V.compute_grpo_outcome_advantage(
            b.rewards.clone(), b.mask.clone(), b.index, norm_adv_by_std_in_grpo=False
        ),
        "grpo",
        "grpo",
    ),
    "grpo-eps1e-2": (
        _ours("grpo", epsilon=1e-2),
        lambda b: V.compute_grpo_outcome_advantage(b.rewards.clone(), b.mask.clone(), b.index, epsilon=1e-2),
        "grpo",
        "grpo",
    ),
    "rloo": (
        _ours("rloo"),
        lambda b: V.compute_rloo_outcome_advantage(b.rewards.clone(), b.mask.clone(), b.index),
        "rloo",
        "rloo",
    ),
    "rloo-vs-rloo_vectorized": (
        _ours("rloo"),
        lambda b: V.compute_rloo_vectorized_outcome_advantage(b.rewards.clone(), b.mask.clone(), b.index),
        "rloo",
        "rloo_vectorized",
    ),
    "reinforce_plus_plus": (
        _ours("reinforce_plus_plus"),
        lambda b: V.compute_reinforce_plus_plus_outcome_advantage(
            b.rewards.clone(), b.mask.clone(), config=AlgoConfig(gamma=1.0)
        ),
        "reinforce_plus_plus",
        "reinforce_plus_plus",
    ),
    "reinforce_plus_plus-gamma0.9": (
        _ours("reinforce_plus_plus", gamma=0.9),
        lambda b: V.compute_reinforce_plus_plus_outcome_advantage(
            b.rewards.clone(), b.mask.clone(), config=AlgoConfig(gamma=0.9)
        ),
        "reinforce_plus_plus",
        "reinforce_plus_plus",
    ),
    "reinforce_plus_plus_baseline": (
        _ours("reinforce_plus_plus_baseline"),
        lambda b: V.compute_reinforce_plus_plus_baseline_outcome_advantage(
            b.rewards.clone(), b.mask.clone(), b.index
        ),
        "reinforce_plus_plus_baseline",
        "reinforce_plus_plus_baseline",
    ),
    "remax": (
        _ours("remax", reward_baselines=lambda b: b.reward_baselines),
        lambda b: V.compute_remax_outcome_advantage(b.rewards.clone(), b.reward_baselines, b.mask.clone()),
        "remax",
        "remax",
    ),
    "opo": (
        _ours("opo"),
        lambda b: V.compute_opo_outcome_advantage(b.rewards.clone(), b.mask.clone(), b.index),
        "opo",
        "opo",
    ),
    "gpg": (
        _ours("gpg"),
        lambda b: V.compute_gpg_outcome_advantage(b.rewards.clone(), b.mask.clone(), b.index),
        "gpg",
        "gpg",
    ),
    "gpg-f_norm2": (
        _ours("gpg", f_norm=2.0),
        lambda b: V.compute_gpg_outcome_advantage(b.rewards.clone(), b.mask.clone(), b.index, f_norm=2.0),
        "gpg",
        "gpg",
    ),
    "grpo_passk": (
        _ours("grpo_passk"),
        lambda b: V.compute_grpo_passk_outcome_advantage(
            b.rewards.clone(), b.mask.clone(), b.index, config=AlgoConfig(norm_adv_by_std_in_grpo=True)
        ),
        "grpo_passk",
        "grpo_passk",
    ),
    "grpo_passk-no-std": (
        _ours("grpo_passk", norm_by_std=False),
        lambda b: V.compute_grpo_passk_outcome_advantage(
            b.rewards.clone(), b.mask.clone(), b.index, config=AlgoConfig(norm_adv_by_std_in_grpo=False)
        ),
        "grpo_passk",
        "grpo_passk",
    ),
    "gdpo": (
        _ours("gdpo"),
        lambda b: V.compute_gdpo_outcome_advantage(b.rewards.clone(), b.mask.clone(), b.index),
        "gdpo",
        "gdpo",
    ),
    "gdpo-no-std": (
        _ours("gdpo", norm_by_std=False),
        lambda b: V.compute_gdpo_outcome_advantage(
            b.rewards.clone(), b.mask.clone(), b.index, norm_adv_by_std_in_grpo=False
        ),
        "gdpo",
        "gdpo",
    ),
    "optimal_token_baseline": (
        _ours(
            "optimal_token_baseline",
            old_log_probs=lambda b: b.old_log_prob,
            sum_pi_squared=lambda b: b.sum_pi_squared,
        ),
        lambda b: V.compute_optimal_token_baseline_advantage(
            b.rewards.clone(), b.mask.clone(), b.index, b.old_log_prob, b.sum_pi_squared
        ),
        "optimal_token_baseline",
        "optimal_token_baseline",
    ),
    "optimal_token_baseline-is-no-zero-tail": (
        _ours(
            "optimal_token_baseline",
            old_log_probs=lambda b: b.old_log_prob,
            sum_pi_squared=lambda b: b.sum_pi_squared,
            rollout_is_weights=_is_weights,
            handle_zero_tail=False,
        ),
        lambda b: V.compute_optimal_token_baseline_advantage(
            b.rewards.clone(),
            b.mask.clone(),
            b.index,
            b.old_log_prob,
            b.sum_pi_squared,
            _is_weights(b),
            False,
        ),
        "optimal_token_baseline",
        "optimal_token_baseline",
    ),
    "tir_optimal_token_baseline": (
        _ours(
            "tir_optimal_token_baseline",
            old_log_probs=lambda b: b.old_log_prob,
            sum_pi_squared=lambda b: b.sum_pi_squared,
        ),
        lambda b: V.compute_multi_turn_optimal_token_baseline_advantage(
            b.rewards.clone(), b.mask.clone(), b.index, b.old_log_prob, b.sum_pi_squared
        ),
        "tir_optimal_token_baseline",
        "tir_optimal_token_baseline",
    ),
    "tir_optimal_token_baseline-is-no-zero-tail": (
        _ours(
            "tir_optimal_token_baseline",
            old_log_probs=lambda b: b.old_log_prob,
            sum_pi_squared=lambda b: b.sum_pi_squared,
            rollout_is_weights=_is_weights,
            handle_zero_tail=False,
        ),
        lambda b: V.compute_multi_turn_optimal_token_baseline_advantage(
            b.rewards.clone(),
            b.mask.clone(),
            b.index,
            b.old_log_prob,
            b.sum_pi_squared,
            _is_weights(b),
            False,
        ),
        "tir_optimal_token_baseline",
        "tir_optimal_token_baseline",
    ),
}


def test_every_shared_estimator_is_compared() -> None:
    shared = set(ADVANTAGE_ESTIMATORS.names()) & set(V.ADV_ESTIMATOR_REGISTRY)
    assert shared == {ours for _, _, ours, _ in ESTIMATORS.values()}
    verl_only = set(V.ADV_ESTIMATOR_REGISTRY) - shared
    # verl's vectorised GRPO computes in float32 (utils.groupwise), so it is no float64 oracle; its vectorised
    # RLOO is compared with posttrain's rloo above.
    assert verl_only == {"grpo_vectorized", "rloo_vectorized"}


@pytest.mark.parametrize("case", list(ESTIMATORS))
def test_advantage_estimator(case: str, batch: Batch) -> None:
    ours_fn, verl_fn, _, _ = ESTIMATORS[case]
    theirs, verl_error = outcome(lambda: verl_fn(batch))
    ours, ours_error = outcome(lambda: ours_fn(batch))
    if verl_error is not None or ours_error is not None:
        # whitening fewer than 2 tokens, pass@k with a group of one: both must refuse
        assert verl_error is not None and ours_error is not None, (verl_error, ours_error)
        assert isinstance(ours_error, ValueError | ConfigError), ours_error
        return
    outside = batch.mask == 0
    rows = torch.ones(batch.mask.shape[0], dtype=torch.bool)
    for name, o, t in zip(("advantages", "returns"), ours, theirs, strict=True):
        assert o.dtype == DTYPE and not o.requires_grad
        assert bool((o[outside] == 0).all()), f"{name} not 0 outside the mask ({deliberate('outside_mask')})"
        nan_rows = torch.isnan(t).any(-1)
        if nan_rows.any():  # only OPO's all-empty group
            assert case == "opo" and not bool(batch.mask[nan_rows].any()), deliberate("opo_empty_group")
            rows = ~nan_rows
        if case == "rloo-vs-rloo_vectorized":  # rloo_vectorized_singletons
            rows = torch.tensor([int((batch.index == i).sum()) > 1 for i in batch.index])
        close(o[rows], (t * batch.mask)[rows], f"{case} {name}")


def test_gdpo_reward_components(batch: Batch) -> None:
    for norm in (True, False):
        theirs, verl_error = outcome(lambda norm=norm: _gdpo_components_verl(batch, norm))
        ours, ours_error = outcome(
            lambda norm=norm: get_advantage_estimator("gdpo")(
                batch.rewards,
                batch.mask,
                batch.index,
                reward_components=batch.components,
                reward_weights=[1.0, 0.5],
                norm_by_std=norm,
            )
        )
        if verl_error is not None or ours_error is not None:
            assert verl_error is not None and ours_error is not None, (verl_error, ours_error)
            continue
        close(ours[0], theirs[0] * batch.mask, "gdpo components")  # gdpo_components_float32: quarters


# ---------------------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------------------
def test_aggregation_modes_are_verls() -> None:
    loss, mask = torch.ones(2, 3, dtype=DTYPE), torch.ones(2, 3, dtype=DTYPE)
    for mode in LOSS_AGG_MODES:
        V.agg_loss(loss, mask, mode)  # verl accepts every posttrain mode
    with pytest.raises(ValueError):
        V.agg_loss(loss, mask, "seq-sum")
    with pytest.raises(ConfigError):
        aggregate_loss(loss, mask, "seq-sum")


@pytest.mark.parametrize("totals", ["local", "global-dp2", "scale-factor"])
def test_aggregation(totals: str, batch: Batch) -> None:
    mask = batch.mask
    ours_kw: dict[str, Any] = {}
    verl_kw: dict[str, Any] = {}
    if totals == "global-dp2":  # this micro-batch is one of several: totals of the whole mini-batch
        tokens, seqs = float(mask.sum()) + 17, int((mask.sum(-1) > 0).sum()) + 3
        ours_kw = {"global_tokens": tokens, "global_seqs": seqs, "dp_size": 2}
        verl_kw = {"batch_num_tokens": tokens, "global_batch_size": seqs, "dp_size": 2}
    elif totals == "scale-factor":
        ours_kw, verl_kw = {"width": 32}, {"loss_scale_factor": 32}
    for mode in LOSS_AGG_MODES:
        loss_mat = batch.advantages.clone().requires_grad_(True)
        ours = aggregate_loss(loss_mat, mask, mode, **ours_kw)
        theirs = V.agg_loss(loss_mat, mask, mode, **verl_kw)
        if torch.isnan(theirs):
            assert batch.empty and totals != "global-dp2", deliberate("zero_total")
            assert ours.item() == 0.0
            continue
        close(ours, theirs, f"agg_loss {mode}")
        (ours_grad,) = torch.autograd.grad(ours, loss_mat)
        (theirs_grad,) = torch.autograd.grad(theirs, loss_mat)
        close(ours_grad, theirs_grad, f"agg_loss {mode} gradient")


# ---------------------------------------------------------------------------------------------------------
# KL estimators, KL in the reward, KL controllers
# ---------------------------------------------------------------------------------------------------------
def _verl_accepts_kl(name: str) -> bool:
    x = torch.zeros(1, dtype=DTYPE)
    return outcome(lambda: V.kl_penalty(x, x, name))[1] is None


def test_every_kl_estimator_is_verls() -> None:
    verl_names = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    verl_names |= {f"{n}+" for n in verl_names}
    assert all(_verl_accepts_kl(n) for n in verl_names)
    assert set(KL_ESTIMATORS.names()) == verl_names  # the same names, "+" variants included
    # "full" (the exact KL over the vocabulary) is a name in verl's code, but it raises NotImplementedError
    x = torch.zeros(1, dtype=DTYPE)
    with pytest.raises(NotImplementedError):
        V.kl_penalty(x, x, "full")
    with pytest.raises(ConfigError):
        kl_penalty(x, x, "full")


@pytest.mark.parametrize(
    "name",
    sorted(
        {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
        | {f"{n}+" for n in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")}
    ),
)
def test_kl_estimator(name: str, batch: Batch) -> None:
    log_prob = batch.log_prob.clone().requires_grad_(True)
    ours = kl_penalty(log_prob, batch.ref_log_prob, name)
    theirs = V.kl_penalty(log_prob, batch.ref_log_prob, name)
    close(ours, theirs, f"kl {name}")
    (ours_grad,) = torch.autograd.grad((ours * batch.mask).sum(), log_prob)
    (theirs_grad,) = torch.autograd.grad((theirs * batch.mask).sum(), log_prob)
    close(ours_grad, theirs_grad, f"kl {name} gradient")


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "k2", "abs"])
def test_kl_in_reward(kind: str, batch: Batch) -> None:
    """posttrain's apply_kl_penalty against verl's: ray_trainer.apply_kl_penalty is three lines on top of
    core_algos.kl_penalty (ray_trainer itself needs verl's data stack, not installed here), written out."""
    coef = 0.05
    ours, metrics = apply_kl_penalty(
        batch.rewards, batch.old_log_prob, batch.ref_log_prob, batch.mask, coef, kind
    )
    kld = V.kl_penalty(batch.old_log_prob, batch.ref_log_prob, kl_penalty=kind) * batch.mask
    close(ours, batch.rewards - coef * kld, f"kl in reward {kind}")
    if batch.has_empty_rows:
        return  # empty_rows_in_metrics
    from verl.utils.torch_functional import masked_mean

    current_kl = torch.mean(masked_mean(kld, mask=batch.mask, axis=-1), dim=0).item()
    close(metrics["kl_in_reward_token_mean"], current_kl, "kl_in_reward_token_mean")


def test_kl_controllers() -> None:
    g = torch.Generator().manual_seed(0)
    ours, theirs = AdaptiveKLController(0.05, 0.1, 1000), V.AdaptiveKLController(0.05, 0.1, 1000)
    fixed_ours, fixed_theirs = FixedKLController(0.05), V.FixedKLController(0.05)
    for _ in range(30):
        kl, n = float(torch.rand(1, generator=g)) * 0.4, int(torch.randint(1, 300, (1,), generator=g))
        for controller in (ours, theirs, fixed_ours, fixed_theirs):
            controller.update(current_kl=kl, n_steps=n)
        close(ours.value, theirs.value, "adaptive KL coefficient")
        close(fixed_ours.value, fixed_theirs.value, "fixed KL coefficient")


# ---------------------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------------------
# Options set in both, beyond posttrain's defaults (which are passed to verl too, so both use one number).
LOSS_OPTIONS: dict[str, list[dict[str, float]]] = {
    "vanilla": [{}, {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "clip_ratio_c": 2.0}],
    "gspo": [{}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}],
    "sapo": [{}, {"tau_pos": 0.5, "tau_neg": 2.0}],
    "gpg": [{}],
    "clip_cov": [
        {},
        {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.2, "clip_cov_ub": 4.0, "clip_ratio_high": 0.28},
    ],
    "kl_cov": [{}, {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0}],
    "geo_mean": [{}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3}],
    "dro": [{}, {"beta": 0.5}],
    "cispo": [{}, {"clip_ratio_low": 10.0, "clip_ratio_high": 0.2}],
    "dppo_tv": [{}, {"clip_ratio_low": 0.05, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}],
    "dppo_kl": [{}, {"clip_ratio_low": 0.02, "clip_ratio_high": 0.1, "clip_ratio_c": 5.0}],
}
LOSS_CASES = [(name, i) for name, sets in LOSS_OPTIONS.items() for i in range(len(sets))]
_ACTOR_KEYS = {"clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg"}
_POLICY_LOSS_KEYS = {"clip_cov_ratio": "clip_cov_ratio", "clip_cov_lb": "clip_cov_lb",
                     "clip_cov_ub": "clip_cov_ub", "kl_cov_ratio": "kl_cov_ratio", "ppo_kl_coef": "ppo_kl_coef",
                     "beta": "dro_beta"}  # fmt: skip
# verl's metric -> posttrain's metric of the same meaning (cov_metric_names)
_METRIC_NAMES = {"clip_cov": {"pg_clipfrac": "clip_cov_frac"}, "kl_cov": {"ppo_kl": "ppo_kl_abs"}}
# losses where verl uses the token log-ratio unclamped (log_ratio_clamp)
_UNCLAMPED_IN_VERL = {"gspo", "geo_mean", "clip_cov", "kl_cov"}
_CLIP_COV_SEED = 1234


def loss_options(name: str, case: int) -> dict[str, Any]:
    options = {k: v for k, v in own_options(get_policy_loss(name)).items() if k != "generator"}
    options.update(LOSS_OPTIONS[name][case])
    return options


def actor_config(
    name: str, options: dict[str, Any], rollout_correction: Any = None, **global_batch_info: Any
) -> Any:
    """verl's ActorConfig carrying `options` (posttrain's names) the way verl's loss functions read them."""
    policy_loss = {_POLICY_LOSS_KEYS[k]: v for k, v in options.items() if k in _POLICY_LOSS_KEYS}
    if rollout_correction is not None:
        policy_loss["rollout_correction"] = rollout_correction
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=PolicyLossConfig(loss_mode=name, **policy_loss),
        global_batch_info=dict(global_batch_info),
        **{k: v for k, v in options.items() if k in _ACTOR_KEYS},
    )


def unclamped_tokens(b: Batch) -> torch.Tensor:
    """Where posttrain's clamp of the token log-ratio to [-20, 20] is inactive."""
    return (b.log_prob - b.old_log_prob).abs() <= 20


def clamped_old(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """The old log-probs for which verl's unclamped log-ratio equals posttrain's clamped one."""
    return log_prob.detach() - (log_prob.detach() - old_log_prob).clamp(-20, 20)


def run_policy_loss_pair(
    name: str,
    options: dict[str, Any],
    b: Batch,
    mode: str,
    *,
    ours_mode: str | None = None,
    ours_kw: dict[str, Any] | None = None,
    verl_weights: torch.Tensor | None = None,
    verl_old: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, dict, torch.Tensor], tuple[torch.Tensor, dict, torch.Tensor]]:
    """(loss, metrics, d loss / d log_prob) of posttrain's compute_policy_loss and of verl's loss function."""
    log_prob = b.log_prob.clone().requires_grad_(True)
    torch.manual_seed(_CLIP_COV_SEED)  # clip_cov draws with the global generator in both
    ours, ours_metrics = compute_policy_loss(
        get_policy_loss(name),
        log_prob,
        b.old_log_prob,
        b.advantages,
        b.mask,
        options=options,
        loss_agg_mode=ours_mode or mode,
        **(ours_kw or {}),
    )
    (ours_grad,) = torch.autograd.grad(ours, log_prob)

    log_prob = b.log_prob.clone().requires_grad_(True)
    torch.manual_seed(_CLIP_COV_SEED)
    theirs, theirs_metrics = V.get_policy_loss_fn(name)(
        old_log_prob=b.old_log_prob if verl_old is None else verl_old,
        log_prob=log_prob,
        advantages=b.advantages,
        response_mask=b.mask,
        loss_agg_mode=mode,
        config=actor_config(name, options),
        rollout_is_weights=verl_weights,
    )
    theirs_grad = torch.autograd.grad(theirs, log_prob, allow_unused=True)[0]
    theirs_grad = torch.zeros_like(log_prob) if theirs_grad is None else theirs_grad
    return (ours, ours_metrics, ours_grad), (theirs, theirs_metrics, theirs_grad)


def compare_policy_loss(
    name: str,
    options: dict[str, Any],
    b: Batch,
    mode: str,
    *,
    ours_kw: dict[str, Any] | None = None,
    verl_weights: torch.Tensor | None = None,
) -> None:
    verl_old, ours_mode = None, None
    if name in _UNCLAMPED_IN_VERL and b.has_extreme():
        verl_old = clamped_old(b.log_prob, b.old_log_prob)  # log_ratio_clamp
    if name == "geo_mean":  # geo_mean_aggregation: verl's mean over all rows
        ours_mode = "seq-mean-token-mean"
        ours_kw = {**(ours_kw or {}), "global_seqs": b.mask.shape[0]}
    if name == "sapo":  # sapo_aggregation
        ours_mode = "seq-mean-token-mean"
    (ours, ours_metrics, ours_grad), (theirs, theirs_metrics, theirs_grad) = run_policy_loss_pair(
        name,
        options,
        b,
        mode,
        ours_mode=ours_mode,
        ours_kw=ours_kw,
        verl_weights=verl_weights,
        verl_old=verl_old,
    )
    if torch.isnan(theirs):
        assert b.empty, deliberate("zero_total")
        assert ours.item() == 0.0 and bool((ours_grad == 0).all())
        return
    what = f"{name} {options} {mode}"
    close(ours, theirs, f"{what} loss")
    unclamped = unclamped_tokens(b) if verl_old is not None else torch.ones_like(b.mask, dtype=torch.bool)
    close(ours_grad[unclamped], theirs_grad[unclamped], f"{what} gradient")
    for key, value in theirs_metrics.items():
        key = key.removeprefix("actor/")
        if name == "dro" and key == "ppo_kl" and b.has_extreme():
            continue  # log_ratio_clamp: verl's dro reports ppo_kl of the unclamped log-ratio
        close(ours_metrics[_METRIC_NAMES.get(name, {}).get(key, key)], value, f"{what} metric {key}")


def test_every_shared_policy_loss_is_compared() -> None:
    shared = set(POLICY_LOSSES.names()) & set(V.POLICY_LOSS_REGISTRY)
    assert shared == set(LOSS_OPTIONS)
    # verl's bypass_mode is a mode of the rollout correction in posttrain: test_bypass_mode
    assert set(V.POLICY_LOSS_REGISTRY) - shared == {"bypass_mode"}


def comparable_modes(name: str) -> tuple[str, ...]:
    """The loss_agg_modes where posttrain's loss `name` is comparable with verl's: all but for geo_mean and sapo,
    which verl aggregates its own way (geo_mean_aggregation, sapo_aggregation)."""
    return ("seq-mean-token-mean",) if name in {"geo_mean", "sapo"} else LOSS_AGG_MODES


@pytest.mark.parametrize(("name", "case"), LOSS_CASES, ids=[f"{n}-{i}" for n, i in LOSS_CASES])
def test_policy_loss(name: str, case: int, batch: Batch) -> None:
    for mode in comparable_modes(name):
        compare_policy_loss(name, loss_options(name, case), batch, mode)


def test_policy_loss_scale_factor(batch: Batch) -> None:
    """seq-mean-token-sum-norm with verl's loss_scale_factor (global_batch_info) and posttrain's."""
    for name in ("vanilla", "gspo", "cispo"):
        options = loss_options(name, 0)
        log_prob = batch.log_prob.clone().requires_grad_(True)
        ours, _ = compute_policy_loss(
            get_policy_loss(name),
            log_prob,
            batch.old_log_prob,
            batch.advantages,
            batch.mask,
            options=options,
            loss_agg_mode="seq-mean-token-sum-norm",
            loss_scale_factor=64,
        )
        verl_old = clamped_old(batch.log_prob, batch.old_log_prob) if name == "gspo" else batch.old_log_prob
        theirs, _ = V.get_policy_loss_fn(name)(
            old_log_prob=verl_old,
            log_prob=log_prob,
            advantages=batch.advantages,
            response_mask=batch.mask,
            loss_agg_mode="seq-mean-token-sum-norm",
            config=actor_config(name, options, loss_scale_factor=64),
        )
        if torch.isnan(theirs):
            assert batch.empty, deliberate("zero_total")
            continue
        close(ours, theirs, f"{name} loss_scale_factor")


def test_policy_loss_defaults_that_claim_verls() -> None:
    """The losses whose docstrings say their defaults are verl's configured ones."""
    actor, policy_loss = (
        ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1),
        PolicyLossConfig(),
    )
    assert own_options(get_policy_loss("vanilla")) == {
        "clip_ratio_low": actor.clip_ratio_low, "clip_ratio_high": actor.clip_ratio_high,
        "clip_ratio_c": actor.clip_ratio_c,
    }  # fmt: skip
    assert own_options(get_policy_loss("sapo")) == {"tau_pos": actor.tau_pos, "tau_neg": actor.tau_neg}
    clip_cov = own_options(get_policy_loss("clip_cov"))
    assert (clip_cov["clip_cov_ratio"], clip_cov["clip_cov_lb"], clip_cov["clip_cov_ub"]) == (
        policy_loss.clip_cov_ratio, policy_loss.clip_cov_lb, policy_loss.clip_cov_ub,
    )  # fmt: skip
    assert (clip_cov["clip_ratio_low"], clip_cov["clip_ratio_high"]) == (
        actor.clip_ratio_low,
        actor.clip_ratio_high,
    )
    assert own_options(get_policy_loss("kl_cov")) == {
        "kl_cov_ratio": policy_loss.kl_cov_ratio, "ppo_kl_coef": policy_loss.ppo_kl_coef,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cliprange", [0.2, 0.5])
def test_value_loss(cliprange: float, batch: Batch) -> None:
    for mode in LOSS_AGG_MODES:
        vpreds = batch.values.clone().requires_grad_(True)
        per_token, metrics = clipped_value_loss(
            vpreds, batch.old_values, batch.returns, batch.mask, cliprange_value=cliprange
        )
        ours = aggregate_loss(per_token, batch.mask, mode)
        (ours_grad,) = torch.autograd.grad(ours, vpreds)
        vpreds = batch.values.clone().requires_grad_(True)
        theirs, clipfrac = V.compute_value_loss(
            vpreds, batch.returns, batch.old_values, batch.mask, cliprange_value=cliprange, loss_agg_mode=mode
        )
        close(metrics["vf_clipfrac"], clipfrac, "vf_clipfrac")
        if torch.isnan(theirs):
            assert batch.empty, deliberate("zero_total")
            assert ours.item() == 0.0
            continue
        (theirs_grad,) = torch.autograd.grad(theirs, vpreds)
        close(ours, theirs, f"value loss {mode}")
        close(ours_grad, theirs_grad, f"value loss {mode} gradient")


# ---------------------------------------------------------------------------------------------------------
# Rollout correction
# ---------------------------------------------------------------------------------------------------------
RS_CASES = {  # rollout_rs -> rollout_rs_threshold (k1: one number u = [1/u, u], symmetric: rs_k1_bounds)
    "token_k1": "1.5",
    "token_k2": "0.05",
    "token_k3": "0.05",
    "seq_sum_k1": "3.0",
    "seq_sum_k2": "0.3",
    "seq_sum_k3": "0.3",
    "seq_mean_k1": "1.3",
    "seq_mean_k2": "0.05",
    "seq_mean_k3": "0.05",
    "seq_max_k2": "0.15",
    "seq_max_k3": "0.15",
    "token_k1,seq_max_k3": "1.5,0.15",
    "token_k2,seq_mean_k3": "0.05",
    "seq_sum_k1,token_k3": "0.5_2.0,0.1",
}


def test_every_rejection_option_is_compared() -> None:
    from posttrain.algorithms.rollout_correction import RS_OPTIONS

    assert set(RS_OPTIONS) == VR.SUPPORTED_ROLLOUT_RS_OPTIONS
    assert {o for case in RS_CASES for o in case.split(",")} == set(RS_OPTIONS)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.2])
def test_importance_weights(level: str, threshold: float, batch: Batch) -> None:
    log_ratio = batch.old_log_prob - batch.rollout_log_prob
    ours, metrics = importance_weights(log_ratio, batch.mask, level, threshold)
    result, verl_error = outcome(
        lambda: VR.compute_rollout_correction_weights(log_ratio, batch.mask, level, threshold)
    )
    if batch.empty:
        assert isinstance(verl_error, ValueError), deliberate("empty_batch_correction")
        assert bool((ours == 0).all())
        return
    theirs, theirs_metrics = result
    close(ours, theirs, f"IS weights {level}")
    keys = ["rollout_is_mean"]
    if level == "token":
        keys += ["rollout_is_max", "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low"]
    elif not batch.has_empty_rows:  # empty_rows_in_metrics
        keys += ["rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low"]
    for key in keys:
        close(metrics[key], theirs_metrics[key], f"{level} {key}")


@pytest.mark.parametrize("options", list(RS_CASES))
def test_rejection_mask(options: str, batch: Batch) -> None:
    log_ratio = batch.old_log_prob - batch.rollout_log_prob
    bounds = RolloutCorrection(rollout_rs=options, rollout_rs_threshold=RS_CASES[options]).rejection_bounds()
    keep, metrics = rejection_mask(log_ratio, batch.mask, bounds)
    result, verl_error = outcome(
        lambda: VR.compute_rollout_rejection_mask(log_ratio, batch.mask, options, RS_CASES[options])
    )
    if batch.empty:
        assert isinstance(verl_error, ValueError), deliberate("empty_batch_correction")
        assert metrics["rollout_rs_masked_fraction"] == 0.0
        return
    theirs, theirs_metrics = result
    close(keep * batch.mask, theirs, f"rejection {options}")
    keys = ["rollout_rs_masked_fraction"]
    keys += [
        f"rollout_rs_{o}_{m}" for o in options.split(",") for m in ("masked_fraction", "seq_masked_fraction")
    ]
    if not batch.has_empty_rows:  # empty_rows_in_metrics
        keys.append("rollout_rs_seq_masked_fraction")
    for key in keys:
        close(metrics[key], theirs_metrics[key], f"rejection {options} {key}")


def _verl_correction(
    b: Batch, old_log_prob: torch.Tensor, **config: Any
) -> tuple[torch.Tensor | None, torch.Tensor]:
    proto, modified_mask, _ = VR.compute_rollout_correction_and_rejection_mask(
        old_log_prob, b.rollout_log_prob, b.mask, **config
    )
    return (None if proto is None else proto.batch["rollout_is_weights"]), modified_mask


def rejection_comparable_modes(rollout_rs: str | None) -> tuple[str, ...]:
    """All modes, less seq-mean-token-mean after a token-level rejection (rejection_normaliser)."""
    token_level = rollout_rs is not None and any(o.startswith("token") for o in rollout_rs.split(","))
    return tuple(m for m in LOSS_AGG_MODES if not (token_level and m == "seq-mean-token-mean"))


def _unrejected_totals(b: Batch) -> dict[str, Any]:
    """verl's global_batch_info with posttrain's normalisers: the counts before rejection."""
    return {"batch_num_tokens": b.mask.sum(), "global_batch_size": (b.mask.sum(-1) > 0).sum(), "dp_size": 1}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("name", sorted(set(LOSS_OPTIONS) - {"geo_mean"}))  # geo_mean_is_weights
def test_policy_loss_with_is_weights(name: str, level: str, batch: Batch) -> None:
    """Decoupled mode (three policies): every loss times verl's truncated IS weights."""
    if batch.empty:
        pytest.skip(deliberate("empty_batch_correction"))
    correction = RolloutCorrection(rollout_is=level, rollout_is_threshold=2.0)
    weights, _ = _verl_correction(batch, batch.old_log_prob, rollout_is=level, rollout_is_threshold=2.0)
    for mode in comparable_modes(name):
        compare_policy_loss(
            name,
            loss_options(name, 0),
            batch,
            mode,
            ours_kw={"rollout_log_probs": batch.rollout_log_prob, "rollout_correction": correction},
            verl_weights=weights,
        )


@pytest.mark.parametrize("options", ["token_k1", "seq_mean_k3", "token_k1,seq_max_k3"])
def test_decoupled_rejection(options: str, batch: Batch) -> None:
    """Decoupled mode with IS weights and rejection sampling, the PPO loss; verl given the unrejected totals."""
    if batch.empty:
        pytest.skip(deliberate("empty_batch_correction"))
    threshold = RS_CASES[options]
    correction = RolloutCorrection(rollout_is="token", rollout_rs=options, rollout_rs_threshold=threshold)
    weights, modified_mask = _verl_correction(
        batch, batch.old_log_prob, rollout_is="token", rollout_rs=options, rollout_rs_threshold=threshold
    )
    loss_options_ = loss_options("vanilla", 1)
    for mode in rejection_comparable_modes(options):
        log_prob = batch.log_prob.clone().requires_grad_(True)
        ours, _ = compute_policy_loss(
            get_policy_loss("vanilla"), log_prob, batch.old_log_prob, batch.advantages, batch.mask,
            options=loss_options_, rollout_log_probs=batch.rollout_log_prob, rollout_correction=correction,
            loss_agg_mode=mode,
        )  # fmt: skip
        (ours_grad,) = torch.autograd.grad(ours, log_prob)
        log_prob = batch.log_prob.clone().requires_grad_(True)
        theirs, _ = V.compute_policy_loss_vanilla(
            old_log_prob=batch.old_log_prob, log_prob=log_prob, advantages=batch.advantages,
            response_mask=modified_mask, loss_agg_mode=mode,
            config=actor_config("vanilla", loss_options_, **_unrejected_totals(batch)), rollout_is_weights=weights,
        )  # fmt: skip
        (theirs_grad,) = torch.autograd.grad(theirs, log_prob)
        close(ours, theirs, f"decoupled {options} {mode}")
        close(ours_grad, theirs_grad, f"decoupled {options} {mode} gradient")


# (loss_type, rollout_rs, rollout_rs_threshold, rollout_is); posttrain refuses rollout_is with bypass ppo_clip,
# where it has no effect (verl computes the weights and ignores them)
BYPASS_CASES = [
    ("ppo_clip", None, None, None),
    ("ppo_clip", "token_k1", "1.5", None),
    ("ppo_clip", "seq_max_k3", "0.15", None),
    ("reinforce", None, None, None),
    ("reinforce", None, None, "token"),
    ("reinforce", None, None, "sequence"),
    ("reinforce", "seq_mean_k3", "0.05", "token"),
    ("reinforce", "token_k2", "0.05", "sequence"),
]


@pytest.mark.parametrize(("loss_type", "rs", "rs_threshold", "rollout_is"), BYPASS_CASES)
def test_bypass_mode(
    loss_type: str, rs: str | None, rs_threshold: str | None, rollout_is: str | None, batch: Batch
) -> None:
    """Bypass mode (two policies: the rollout log-probs are the old policy) against verl's bypass_mode loss."""
    if batch.empty:
        pytest.skip(deliberate("empty_batch_correction"))
    correction = RolloutCorrection(
        bypass_mode=True,
        loss_type=loss_type,
        rollout_is=rollout_is,
        rollout_rs=rs,
        rollout_rs_threshold=rs_threshold,
    )
    verl_correction = RolloutCorrectionConfig(
        rollout_is=rollout_is, rollout_is_threshold=2.0, rollout_rs=rs, rollout_rs_threshold=rs_threshold,
        bypass_mode=True, loss_type=loss_type,
    )  # fmt: skip
    loss_name = "vanilla" if loss_type == "ppo_clip" else "gpg"
    options = loss_options(loss_name, 0)
    config = actor_config(
        "bypass_mode",
        loss_options("vanilla", 0),
        rollout_correction=verl_correction,
        **_unrejected_totals(batch),
    )
    for mode in rejection_comparable_modes(rs):
        log_prob = batch.log_prob.clone().requires_grad_(True)
        ours, _ = compute_policy_loss(
            get_policy_loss(loss_name), log_prob, torch.full_like(batch.old_log_prob, float("nan")),
            batch.advantages, batch.mask, options=options, rollout_log_probs=batch.rollout_log_prob,
            rollout_correction=correction, loss_agg_mode=mode,
        )  # fmt: skip
        (ours_grad,) = torch.autograd.grad(ours, log_prob)
        log_prob = batch.log_prob.clone().requires_grad_(True)
        theirs, _ = V.compute_policy_loss_bypass_mode(
            old_log_prob=batch.rollout_log_prob, log_prob=log_prob, advantages=batch.advantages,
            response_mask=batch.mask, loss_agg_mode=mode, config=config,
        )  # fmt: skip
        (theirs_grad,) = torch.autograd.grad(theirs, log_prob)
        what = f"bypass {loss_type} {rs} {rollout_is} {mode}"
        close(ours, theirs, what)
        close(ours_grad, theirs_grad, f"{what} gradient")


# ---------------------------------------------------------------------------------------------------------
# The deliberate differences, each shown on a case built for it
# ---------------------------------------------------------------------------------------------------------
def test_deliberate_entries_are_all_tested() -> None:
    tested = {
        name.removeprefix("test_deliberate_") for name in globals() if name.startswith("test_deliberate_")
    }
    assert set(DELIBERATE) <= tested


def test_deliberate_outside_mask() -> None:
    b = make_batch("multi_turn", 0)
    ours, _ = ESTIMATORS["gae"][0](b)
    theirs, _ = ESTIMATORS["gae"][1](b)
    outside = b.mask == 0
    assert bool((ours[outside] == 0).all()) and bool((theirs[outside] != 0).any())


def test_deliberate_opo_empty_group() -> None:
    b = make_batch("empty_rows", 0)
    ours, _ = ESTIMATORS["opo"][0](b)
    theirs, _ = ESTIMATORS["opo"][1](b)
    assert bool(torch.isnan(theirs[3:5]).all()) and bool((ours[3:5] == 0).all())


def test_deliberate_zero_total() -> None:
    loss, mask = torch.ones(2, 3, dtype=DTYPE), torch.zeros(2, 3, dtype=DTYPE)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert (
            math.isnan(float(V.agg_loss(loss, mask, mode))) and float(aggregate_loss(loss, mask, mode)) == 0.0
        )


def test_deliberate_log_ratio_clamp() -> None:
    b = make_batch("extreme", 0)
    for name in sorted(_UNCLAMPED_IN_VERL):
        options = loss_options(name, 1)
        (ours, _, ours_grad), (theirs, _, theirs_grad) = run_policy_loss_pair(
            name, options, b, "seq-mean-token-mean", ours_kw={"global_seqs": b.mask.shape[0]}
        )
        assert differs(ours, theirs) or differs(ours_grad, theirs_grad), name
        (ours, _, ours_grad), (theirs, _, theirs_grad) = run_policy_loss_pair(
            name, options, b, "seq-mean-token-mean", ours_kw={"global_seqs": b.mask.shape[0]},
            verl_old=clamped_old(b.log_prob, b.old_log_prob),
        )  # fmt: skip
        close(ours, theirs, f"{name} with clamped inputs")
        unclamped = unclamped_tokens(b)
        close(ours_grad[unclamped], theirs_grad[unclamped], f"{name} gradient with clamped inputs")


def test_deliberate_geo_mean_aggregation() -> None:
    b = make_batch("empty_rows", 0)
    (ours, _, _), (theirs, _, _) = run_policy_loss_pair(
        "geo_mean", loss_options("geo_mean", 0), b, "token-mean"
    )
    assert differs(ours, theirs)  # mode honoured here; and verl's mean counts the 3 empty rows
    (ours, _, _), (theirs, _, _) = run_policy_loss_pair(
        "geo_mean", loss_options("geo_mean", 0), b, "token-mean", ours_mode="seq-mean-token-mean",
        ours_kw={"global_seqs": b.mask.shape[0]},
    )  # fmt: skip
    close(ours, theirs, "geo_mean as seq-mean-token-mean over all rows")


def test_deliberate_geo_mean_is_weights() -> None:
    b = make_batch("random", 0)
    correction = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0)
    weights, _ = _verl_correction(b, b.old_log_prob, rollout_is="token", rollout_is_threshold=2.0)
    kw = {"rollout_log_probs": b.rollout_log_prob, "rollout_correction": correction}
    (ours, _, _), (theirs, _, _) = run_policy_loss_pair(
        "geo_mean", loss_options("geo_mean", 0), b, "seq-mean-token-mean", ours_kw=kw, verl_weights=weights
    )
    assert differs(ours, theirs)
    # sequence-level weights are constant over a row, where both means agree
    correction = RolloutCorrection(rollout_is="sequence", rollout_is_threshold=2.0)
    weights, _ = _verl_correction(b, b.old_log_prob, rollout_is="sequence", rollout_is_threshold=2.0)
    kw["rollout_correction"] = correction
    (ours, _, _), (theirs, _, _) = run_policy_loss_pair(
        "geo_mean", loss_options("geo_mean", 0), b, "seq-mean-token-mean", ours_kw=kw, verl_weights=weights
    )
    close(ours, theirs, "geo_mean with sequence IS weights")


def test_deliberate_sapo_aggregation() -> None:
    b = make_batch("random", 1)
    (ours, _, _), (theirs, _, _) = run_policy_loss_pair("sapo", loss_options("sapo", 0), b, "token-mean")
    assert differs(ours, theirs)
    (ours, _, _), (theirs, _, _) = run_policy_loss_pair(
        "sapo", loss_options("sapo", 0), b, "token-mean", ours_mode="seq-mean-token-mean"
    )
    close(ours, theirs, "sapo as seq-mean-token-mean")


def test_deliberate_cov_metric_names() -> None:
    b = make_batch("random", 0)
    for name, renamed in _METRIC_NAMES.items():
        (_, ours, _), (_, theirs, _) = run_policy_loss_pair(name, loss_options(name, 1), b, "token-mean")
        for verl_key, ours_key in renamed.items():
            assert differs(ours[verl_key], theirs[f"actor/{verl_key}"]), (name, verl_key)
            close(ours[ours_key], theirs[f"actor/{verl_key}"], f"{name} {verl_key} as {ours_key}")


def test_deliberate_rs_k1_bounds() -> None:
    log_ratio = torch.tensor([[math.log(2.5), math.log(0.7), 0.0]], dtype=DTYPE)  # weights 2.5, 0.7, 1
    mask = torch.ones_like(log_ratio)
    bounds = RolloutCorrection(rollout_rs="token_k1", rollout_rs_threshold="0.5_3.0").rejection_bounds()
    keep, _ = rejection_mask(log_ratio, mask, bounds)
    theirs, _ = VR.compute_rollout_rejection_mask(log_ratio, mask, "token_k1", "0.5_3.0")
    assert keep.tolist() == [[1.0, 1.0, 1.0]]  # every weight in [0.5, 3]
    assert theirs.tolist() == [[0.0, 1.0, 1.0]]  # 1/2.5 = 0.4 < 0.5
    bounds = RolloutCorrection(rollout_rs="token_k1", rollout_rs_threshold="2.0").rejection_bounds()
    keep, _ = rejection_mask(log_ratio, mask, bounds)
    theirs, _ = VR.compute_rollout_rejection_mask(log_ratio, mask, "token_k1", "2.0")
    close(keep, theirs, "symmetric k1 bounds")


def test_deliberate_rejection_normaliser() -> None:
    b = make_batch("random", 2)
    correction = RolloutCorrection(rollout_rs="token_k1", rollout_rs_threshold="1.5")
    _, modified_mask = _verl_correction(
        b, b.old_log_prob, rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="1.5"
    )
    assert 0 < int((modified_mask != b.mask).sum()) < int(b.mask.sum())
    options = loss_options("vanilla", 0)
    for mode, totals, same in [
        ("token-mean", {}, False),
        ("token-mean", _unrejected_totals(b), True),
        ("seq-mean-token-mean", _unrejected_totals(b), False),
    ]:
        ours, _ = compute_policy_loss(
            get_policy_loss("vanilla"), b.log_prob, b.old_log_prob, b.advantages, b.mask, options=options,
            rollout_log_probs=b.rollout_log_prob, rollout_correction=correction, loss_agg_mode=mode,
        )  # fmt: skip
        theirs, _ = V.compute_policy_loss_vanilla(
            old_log_prob=b.old_log_prob, log_prob=b.log_prob, advantages=b.advantages, response_mask=modified_mask,
            loss_agg_mode=mode, config=actor_config("vanilla", options, **totals),
        )  # fmt: skip
        if same:
            close(ours, theirs, f"rejection with unrejected totals, {mode}")
        else:
            assert differs(ours, theirs), (mode, totals)


def test_deliberate_empty_rows_in_metrics() -> None:
    b = make_batch("empty_rows", 0)
    log_ratio = b.old_log_prob - b.rollout_log_prob
    bounds = RolloutCorrection(rollout_rs="token_k2", rollout_rs_threshold="0.01").rejection_bounds()
    _, ours = rejection_mask(log_ratio, b.mask, bounds)
    _, theirs = VR.compute_rollout_rejection_mask(log_ratio, b.mask, "token_k2", "0.01")
    rows, non_empty = b.mask.shape[0], int((b.mask.sum(-1) > 0).sum())
    close(
        ours["rollout_rs_seq_masked_fraction"] * non_empty / rows,
        theirs["rollout_rs_seq_masked_fraction"],
        "",
    )
    assert differs(ours["rollout_rs_seq_masked_fraction"], theirs["rollout_rs_seq_masked_fraction"])
    _, ours = importance_weights(log_ratio, b.mask, "sequence", 1.1)
    _, theirs = VR.compute_rollout_correction_weights(log_ratio, b.mask, "sequence", 1.1)
    close(
        ours["rollout_is_ratio_fraction_high"] * non_empty / rows,
        theirs["rollout_is_ratio_fraction_high"],
        "",
    )
    _, metrics = apply_kl_penalty(b.rewards, b.old_log_prob, b.ref_log_prob, b.mask, 0.1, "kl")
    from verl.utils.torch_functional import masked_mean

    kld = V.kl_penalty(b.old_log_prob, b.ref_log_prob, "kl") * b.mask
    current_kl = torch.mean(masked_mean(kld, mask=b.mask, axis=-1)).item()
    close(metrics["kl_in_reward_token_mean"] * non_empty / rows, current_kl, "kl in reward metric")
    assert differs(metrics["kl_in_reward_token_mean"], current_kl)


def test_deliberate_empty_batch_correction() -> None:
    b = make_batch("all_masked", 0)
    log_ratio = b.old_log_prob - b.rollout_log_prob
    with pytest.raises(ValueError):
        VR.compute_rollout_correction_and_rejection_mask(
            b.old_log_prob, b.rollout_log_prob, b.mask, rollout_is="token"
        )
    weights, _ = importance_weights(log_ratio, b.mask, "token", 2.0)
    assert bool((weights == 0).all())


def test_deliberate_rloo_vectorized_singletons() -> None:
    b = make_batch("groups_of_one", 0)
    ours, _ = ESTIMATORS["rloo"][0](b)
    loop, _ = ESTIMATORS["rloo"][1](b)
    vectorized, _ = ESTIMATORS["rloo-vs-rloo_vectorized"][1](b)
    close(ours, loop * b.mask, "rloo on groups of one")
    assert bool((vectorized == 0).all()) and bool((ours != 0).any())


def test_deliberate_gdpo_components_float32() -> None:
    b = make_batch("random", 3)
    # 1e8 + 1 and 1e8 are one float32: verl sees no spread in the first component of group p0
    components = b.components.clone()
    components[:4, 0] = torch.tensor([1e8 + 1, 1e8, 1e8, 1e8], dtype=DTYPE)
    b = dataclasses.replace(b, components=components)
    ours, _ = get_advantage_estimator("gdpo")(
        b.rewards, b.mask, b.index, reward_components=b.components, reward_weights=[1.0, 0.5]
    )
    theirs, _ = _gdpo_components_verl(b, True)
    assert differs(ours, theirs * b.mask)
    b = dataclasses.replace(
        b, components=components - torch.tensor([1e8, 0.0], dtype=DTYPE) * (components > 1e7)
    )
    ours, _ = get_advantage_estimator("gdpo")(
        b.rewards, b.mask, b.index, reward_components=b.components, reward_weights=[1.0, 0.5]
    )
    theirs, _ = _gdpo_components_verl(b, True)
    close(ours, theirs * b.mask, "gdpo with the components shifted into float32's exact range")
