"""verl's config keys in posttrain's: the mapping rules, unit conversions and reasons, as data.

Each verl key has one `Rule`: the posttrain keys it sets and a converter from its value (with the rest of the
command line as context, for conversions that need another key, e.g. verl's `ppo_mini_batch_size` counts
prompts and posttrain's `actor.mini_batch_size` samples, so it is multiplied by `rollout.n`). A converter
raises `Unmappable` (no posttrain equivalent for this value) or `NoEffect` (nothing to set: posttrain does
this anyway); verl's optimizer keys have theirs in verl_optim_map.py (with the warm-up's unit: verl counts RL
steps, posttrain optimizer steps), its multi-turn and agent-loop keys in verl_agent_map.py. Keys with no rule
fall to `verl_unmapped.UNMAPPED` (by exact key or prefix) with their reason.
A verl command line relies on verl's defaults; where one differs from posttrain's (verl's `adv_estimator`
is gae, its lr 1e-6, `use_kl_loss` false, ...) the default is carried over too (`apply_default`).
The migration page `docs/migration_from_verl.md` is generated from these rules, verl_optim_map.py,
verl_agent_map.py and verl_unmapped.py.
Pure: no I/O except counting the rows of a train file that exists, for `total_epochs`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

A, R, C, T, D = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "critic.", "trainer.", "data."
M = "actor_rollout_ref.model."

# verl's defaults (verl/trainer/config/_generated_ppo_trainer.yaml, Jan 2026) that the rules below use
VERL_DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "gae", f"{A}optim.lr": 1e-6, f"{A}optim.weight_decay": 0.01,
    f"{C}optim.weight_decay": 0.01, f"{A}use_kl_loss": False, f"{A}kl_loss_type": "low_var_kl",
    f"{R}n": 1, f"{D}train_batch_size": 1024, f"{D}max_prompt_length": 512, f"{D}max_response_length": 512,
    f"{A}ppo_mini_batch_size": 256, f"{M}enable_gradient_checkpointing": True, f"{D}filter_overlong_prompts": False,
    f"{D}truncation": "error", f"{T}test_freq": -1, f"{T}save_freq": -1, f"{T}total_epochs": 30,
    f"{T}n_gpus_per_node": 8, f"{T}nnodes": 1, f"{T}project_name": "verl_examples", f"{T}experiment_name": "gsm8k",
    f"{A}optim.lr_warmup_steps": -1, f"{A}optim.lr_warmup_steps_ratio": 0.0, f"{A}fsdp_config.param_offload": False,
    f"{A}fsdp_config.optimizer_offload": False, f"{A}use_dynamic_bsz": False, f"{A}ppo_max_token_len_per_gpu": 16384,
    f"{C}ppo_max_token_len_per_gpu": 32768, f"{R}val_kwargs.do_sample": False, f"{R}val_kwargs.temperature": 0.0,
    f"{A}clip_ratio_low": 0.2, f"{A}clip_ratio_high": 0.2, f"{A}clip_ratio_c": 3.0,
    "reward_model.overlong_buffer.enable": False, f"{R}multi_turn.max_parallel_calls": 1,
    f"{R}multi_turn.max_tool_response_length": 256, f"{R}multi_turn.tool_response_truncate_side": "middle",
    f"{A}ppo_epochs": 1, f"{C}optim.lr_warmup_steps": -1, f"{C}optim.lr_warmup_steps_ratio": 0.0,
    f"{R}do_sample": True,
    f"{T}max_actor_ckpt_to_keep": None,  # null: keep every checkpoint (a null given is this default, not a fallback)
}  # fmt: skip


class Unmappable(Exception):
    """This value has no posttrain equivalent; the message says why and what to do instead."""


class NoEffect(Exception):
    """Nothing to set: posttrain behaves this way already; the message says why."""


@dataclass
class Context:
    """The verl settings given (flattened keys), verl's defaults for the rest, and the train rows if known."""

    given: Mapping[str, Any]
    train_rows: int | None = None
    nulls: frozenset[str] = (
        frozenset()
    )  # keys the command line sets to null: verl's fallback, not its default

    def get(self, key: str) -> Any:
        return self.given[key] if key in self.given else VERL_DEFAULTS.get(key)

    def world_size(self) -> int:
        return int(self.get(f"{T}n_gpus_per_node")) * int(self.get(f"{T}nnodes"))

    def total_steps(self) -> int:
        if self.given.get(f"{T}total_training_steps") is not None:
            return int(self.given[f"{T}total_training_steps"])
        if self.train_rows is None:
            raise Unmappable(
                "posttrain counts trainer.total_steps, verl epochs: set trainer.total_steps = total_epochs x "
                "(train rows // data.train_batch_size), or give --train-rows N (or a readable data.train_files)"
            )
        return int(self.get(f"{T}total_epochs")) * (self.train_rows // int(self.get(f"{D}train_batch_size")))


Convert = Callable[[Any, Context], dict[str, Any]]


@dataclass(frozen=True)
class Rule:
    verl: str
    targets: tuple[str, ...]  # the posttrain keys it may set (for the docs)
    convert: Convert = field(repr=False)
    note: str = ""  # the conversion, in words
    apply_default: bool = True  # carry verl's default over when the command line does not set the key


def same(target: str) -> Convert:
    return lambda v, ctx: {target: v}


def rule(verl: str, target: str, note: str = "", apply_default: bool = True) -> Rule:
    return Rule(verl, (target,), same(target), note, apply_default)


def _template_kwargs(v: Any, ctx: Context) -> dict[str, Any]:
    """verl's whole mapping, as one `+data.apply_chat_template_kwargs.<name>=value` per argument."""
    if not isinstance(v, dict):
        raise Unmappable(f"{v!r} is not a mapping of the chat template's arguments")
    return {f"data.apply_chat_template_kwargs.{k}": value for k, value in v.items()}


def _critic_warmup(v: Any, ctx: Context) -> dict[str, Any]:
    """verl counts steps from 1 and updates the actor once `critic_warmup <= global_steps`: N gives N - 1
    critic-only steps; posttrain's algorithm.critic_warmup is the number of critic-only steps."""
    return {"algorithm.critic_warmup": max(int(v) - 1, 0)}


def _times_n(target: str) -> Convert:
    return lambda v, ctx: {target: int(v) * int(ctx.get(f"{R}n"))}


def _actor_and_critic(actor_target: str, critic_key: str, convert: Convert) -> Convert:
    """An actor setting that verl's critic inherits when its own key is not given (with a critic: gae)."""

    def both(v: Any, ctx: Context) -> dict[str, Any]:
        out = convert(v, ctx)
        if ctx.get("algorithm.adv_estimator") == "gae" and f"{C}{critic_key}" not in ctx.given:
            out[actor_target.replace("actor.", "critic.", 1)] = out[actor_target]
        return out

    return both


def _per_worker(target: str) -> Convert:
    def convert(v: Any, ctx: Context) -> dict[str, Any]:
        if int(v) % ctx.world_size():
            raise Unmappable(
                f"{v} does not split over {ctx.world_size()} GPUs; set {target} (samples per worker)"
            )
        return {target: int(v) // ctx.world_size()}

    return convert


def _token_budget(prefix: str, target: str) -> Convert:
    def convert(v: Any, ctx: Context) -> dict[str, Any]:
        if not ctx.get(f"{prefix}use_dynamic_bsz"):
            raise NoEffect("used by verl only with use_dynamic_bsz=True")
        return {target: int(v)}

    return convert


def _dynamic_bsz(prefix: str, target: str) -> Convert:
    def convert(v: Any, ctx: Context) -> dict[str, Any]:
        if not v:
            raise NoEffect(f"batches by sample count, as posttrain with {target}=0")
        return {target: int(ctx.get(f"{prefix}ppo_max_token_len_per_gpu"))}

    return convert


def _offload(other: str) -> Convert:
    def convert(v: Any, ctx: Context) -> dict[str, Any]:
        if bool(v) != bool(ctx.get(f"{A}fsdp_config.{other}")):
            raise Unmappable(
                "posttrain offloads parameters, gradients and optimizer together (model.offload)"
            )
        return {"model.offload": bool(v)}

    return convert


def _adv(v: Any, ctx: Context) -> dict[str, Any]:
    return {"algorithm.adv_estimator": v, **({"critic.enable": True} if v == "gae" else {})}


def _clip_ratio(v: Any, ctx: Context) -> dict[str, Any]:
    """verl reads `clip_ratio` only for a bound set to null (`clip_ratio_low if not None else clip_ratio`);
    both bounds default to 0.2, so alone it changes nothing."""
    sides = [side for side in ("low", "high") if f"{A}clip_ratio_{side}" in ctx.nulls]
    if not sides:
        raise NoEffect("verl uses clip_ratio only for clip_ratio_low/high set to null; they default to 0.2")
    return {f"actor.clip_ratio_{side}": v for side in sides}


def _val_files(v: Any, ctx: Context) -> dict[str, Any]:
    """verl validates every row of its val files; posttrain's default takes the first 256 prompts."""
    return {"data.val_files": [v] if isinstance(v, str) else list(v), "data.val_max_prompts": 0}


def _val_temperature(v: Any, ctx: Context) -> dict[str, Any]:
    if not ctx.get(f"{R}val_kwargs.do_sample"):
        raise NoEffect("verl decodes validation greedily while val_kwargs.do_sample is false (its default)")
    return {"rollout.val_temperature": v}


def _overlong_buffer(target: str) -> Convert:
    def convert(v: Any, ctx: Context) -> dict[str, Any]:
        if not ctx.get("reward_model.overlong_buffer.enable"):
            raise NoEffect("verl applies the overlong penalty only with overlong_buffer.enable=true")
        return {target: v}

    return convert


def _overlong_enable(v: Any, ctx: Context) -> dict[str, Any]:
    if v and ctx.get("reward_model.overlong_buffer.len") is None:
        raise Unmappable("overlong_buffer.enable=true needs overlong_buffer.len (reward.overlong_buffer_len)")
    raise NoEffect("posttrain applies the overlong penalty when reward.overlong_buffer_len > 0")


def _overlong(v: Any, ctx: Context) -> dict[str, Any]:
    if v:
        return {"data.overlong_prompts": "filter"}
    if ctx.get(f"{D}truncation") != "error":
        raise Unmappable(
            "posttrain never truncates prompts: data.overlong_prompts=filter drops them, error fails"
        )
    return {"data.overlong_prompts": "error"}


def _truncation(v: Any, ctx: Context) -> dict[str, Any]:
    if v == "error" or ctx.get(f"{D}filter_overlong_prompts"):
        raise NoEffect("see data.filter_overlong_prompts (data.overlong_prompts)")
    raise Unmappable(
        f"truncation={v}: posttrain never truncates prompts (data.overlong_prompts=filter|error)"
    )


def _freq(target: str) -> Convert:
    return lambda v, ctx: {target: max(int(v), 0)}  # verl -1 = never; posttrain 0


def _target_modules(v: Any, ctx: Context) -> dict[str, Any]:
    if v == "all-linear":
        raise NoEffect("all-linear is posttrain's default list (model.lora.target_modules)")
    return {"model.lora.target_modules": [v] if isinstance(v, str) else v}


def _files(target: str) -> Convert:
    return lambda v, ctx: {target: [v] if isinstance(v, str) else list(v)}


def _epochs(v: Any, ctx: Context) -> dict[str, Any]:
    if ctx.given.get(f"{T}total_training_steps") is not None:
        raise NoEffect("trainer.total_training_steps is given and wins, as in verl")
    return {"trainer.total_steps": ctx.total_steps()}


def _do_sample(v: Any, ctx: Context) -> dict[str, Any]:
    """verl's training rollouts with do_sample=false decode greedily, whatever the temperature: posttrain's
    rollout.temperature=0 (greedy, its log-probs those of the untempered softmax)."""
    if v:
        raise NoEffect("samples at rollout.temperature, as posttrain")
    return {"rollout.temperature": 0.0}


def _temperature(v: Any, ctx: Context) -> dict[str, Any]:
    if not ctx.get(f"{R}do_sample"):
        raise NoEffect("verl decodes greedily while do_sample is false (rollout.temperature=0)")
    return {"rollout.temperature": v}


# verl's max_num_gen_batches <= 0 (no limit: it regenerates until the batch is full) as posttrain's cap, which
# must be >= 1. At the cap posttrain fills the step with zero-advantage groups (verl, at a positive cap, stops
# the run); 100 rounds are reached only when under 1% of a round's groups have a reward spread.
UNLIMITED_GEN_ROUNDS = 100


def _gen_rounds(v: Any, ctx: Context) -> dict[str, Any]:
    return {"algorithm.max_gen_rounds": int(v) if int(v) > 0 else UNLIMITED_GEN_ROUNDS}


def _checkpoints_to_keep(v: Any, ctx: Context) -> dict[str, Any]:
    """verl keeps every checkpoint with null (its default) or a value <= 0; posttrain's 0 keeps all."""
    return {"trainer.max_checkpoints_to_keep": int(v) if v is not None and int(v) > 0 else 0}


def _top_k(v: Any, ctx: Context) -> dict[str, Any]:
    return {"rollout.top_k": max(int(v), 0)}  # verl -1 = off, posttrain 0 = off


def _val_sample(v: Any, ctx: Context) -> dict[str, Any]:
    if not v:
        return {"rollout.val_temperature": 0.0}
    raise NoEffect("validation samples at rollout.val_temperature (val_kwargs.temperature)")


def _val_n(v: Any, ctx: Context) -> dict[str, Any]:
    if int(v) == 1:
        raise NoEffect("posttrain validates one sample per prompt")
    raise Unmappable("validation takes one sample per prompt; `posttrain eval --n N` gives pass@k")


def _loggers(v: Any, ctx: Context) -> dict[str, Any]:
    from posttrain.tracking.loggers import VALID_BACKENDS

    names = [v] if isinstance(v, str) else list(v)
    kept = [n for n in names if n in VALID_BACKENDS]
    dropped = [n for n in names if n not in VALID_BACKENDS]
    if dropped:
        raise Unmappable(
            f"loggers {dropped} are not posttrain's ({', '.join(VALID_BACKENDS)}); the others: "
            f"trainer.loggers=[{','.join(kept + ['jsonl'])}]"
        )
    return {"trainer.loggers": kept}


def _run_dir(v: Any, ctx: Context) -> dict[str, Any]:
    if f"{T}default_local_dir" in ctx.given:
        raise NoEffect("trainer.default_local_dir is given")
    return {"trainer.run_dir": f"checkpoints/{ctx.get(f'{T}project_name')}/{ctx.get(f'{T}experiment_name')}"}


def _resume(v: Any, ctx: Context) -> dict[str, Any]:
    if v in ("auto", "disable"):
        return {"trainer.resume": v == "auto"}
    if v == "resume_path":
        path = ctx.get(f"{T}resume_from_path")
        if not path:
            raise Unmappable("resume_mode=resume_path needs trainer.resume_from_path")
        return {"trainer.resume": True, "trainer.resume_from": str(path)}
    raise Unmappable(f"resume_mode={v!r}: verl's modes are auto, disable, resume_path")


def _resume_path(v: Any, ctx: Context) -> dict[str, Any]:
    """Read by resume_mode's rule; verl ignores it under the other modes."""
    if ctx.get(f"{T}resume_mode") != "resume_path":
        raise NoEffect("verl reads it with resume_mode=resume_path only")
    return {}


RM = "reward_model."


def _reward_model(v: Any, ctx: Context) -> dict[str, Any]:
    """verl's reward model: with enable=true its score is the reward (the rule reward is not computed), as
    posttrain's reward.model.path with with_rule_rewards=false. The directory must hold a sequence classifier
    (posttrain checks it at start)."""
    if not v:
        raise NoEffect("function rewards, as posttrain")
    if f"{RM}model.path" not in ctx.given:
        raise Unmappable("reward_model.enable=true needs reward_model.model.path (a sequence classifier)")
    return {"reward.model.path": str(ctx.get(f"{RM}model.path"))}


def _with_reward_model(target: str) -> Convert:
    def convert(v: Any, ctx: Context) -> dict[str, Any]:
        if not ctx.get(f"{RM}enable"):
            raise NoEffect("verl reads it with reward_model.enable=true only")
        return {target: v} if target else {}

    return convert


def _must_be(expected: Any, reason: str, effect: str) -> Convert:
    def convert(v: Any, ctx: Context) -> dict[str, Any]:
        if v == expected or (isinstance(expected, tuple) and v in expected):
            raise NoEffect(effect)
        raise Unmappable(reason)

    return convert


def _always_on(effect: str) -> Convert:
    def convert(v: Any, ctx: Context) -> dict[str, Any]:
        raise NoEffect(effect)

    return convert


def _same_as_actor_sp(v: Any, ctx: Context) -> dict[str, Any]:
    """verl sets Ulysses sp per role; posttrain has one `model.sequence_parallel_size` for actor, reference and
    critic, so the reference's or critic's value must equal the actor's."""
    actor = ctx.get(f"{A}ulysses_sequence_parallel_size") or 1
    if int(v) == int(actor):
        raise NoEffect("the actor's value (model.sequence_parallel_size)")
    raise Unmappable(
        f"{v} differs from the actor's ulysses_sequence_parallel_size={actor}: posttrain uses one "
        "model.sequence_parallel_size for every role"
    )


def _rollout_name(v: Any, ctx: Context) -> dict[str, Any]:
    if v in ("hf", "vllm"):
        return {"rollout.name": v}
    raise Unmappable(
        f"{v}: no SGLang adapter is included; posttrain generates with its built-in engine (rollout.name=native, "
        "the default), vLLM (vllm) or HF generate (hf)"
    )


def _max_model_len(v: Any, ctx: Context) -> dict[str, Any]:
    return {"rollout.vllm.max_model_len": 0 if v is None else int(v)}


def _tensor_parallel(v: Any, ctx: Context) -> dict[str, Any]:
    if int(v) == 1:
        raise NoEffect("one model copy per worker, as posttrain's engines run")
    raise Unmappable(
        f"{v}: posttrain runs one engine (built-in or vLLM) per worker, without tensor parallelism: "
        "use a model that fits one device, or more workers"
    )


def _critic_path(v: Any, ctx: Context) -> dict[str, Any]:
    if v == ctx.get(f"{M}path"):
        raise NoEffect("the actor's model, as posttrain's default (critic.model_path empty)")
    return {"critic.model_path": v}


RULES: tuple[Rule, ...] = (
    Rule("algorithm.adv_estimator", ("algorithm.adv_estimator", "critic.enable"), _adv, "gae also enables the critic"),
    *(rule(f"algorithm.{k}", f"algorithm.{k}") for k in ("norm_adv_by_std_in_grpo", "gamma", "lam", "use_kl_in_reward", "kl_penalty")),
    rule("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef"),
    rule("algorithm.kl_ctrl.type", "algorithm.kl_ctrl_type"),
    rule("algorithm.kl_ctrl.target_kl", "algorithm.kl_target"),
    rule("algorithm.kl_ctrl.horizon", "algorithm.kl_horizon"),
    rule("algorithm.filter_groups.enable", "algorithm.dynamic_sampling", "DAPO's dynamic sampling"),
    Rule("algorithm.filter_groups.max_num_gen_batches", ("algorithm.max_gen_rounds",), _gen_rounds, f"<= 0 (verl: no limit) = {UNLIMITED_GEN_ROUNDS} rounds; at the cap posttrain fills the step with zero-advantage groups"),
    *(rule(f"algorithm.rollout_correction.{k}", f"algorithm.rollout_correction.{k}") for k in (
        "rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold", "bypass_mode", "loss_type")),
    Rule(f"{D}train_files", ("data.train_files",), _files("data.train_files")),
    Rule(f"{D}val_files", ("data.val_files", "data.val_max_prompts"), _val_files, "every row, as verl (val_max_prompts=0)"),
    rule(f"{D}train_batch_size", "data.train_batch_prompts", "both count prompts"),
    rule(f"{D}max_prompt_length", "data.max_prompt_length"),
    rule(f"{D}max_response_length", "data.max_response_length"),
    rule(f"{D}shuffle", "data.shuffle"),
    Rule(f"{D}apply_chat_template_kwargs", ("data.apply_chat_template_kwargs",), _template_kwargs, "the same arguments, passed to the chat template wherever it renders (each key also as data.apply_chat_template_kwargs.<name>)"),
    Rule(f"{D}filter_overlong_prompts", ("data.overlong_prompts",), _overlong, "True: filter; False with truncation=error: error"),
    Rule(f"{D}truncation", (), _truncation, "error only; posttrain never truncates"),
    Rule(f"{D}prompt_key", (), _must_be("prompt", "posttrain reads the 'prompt' column: rename the column", "the same column"), "prompt only"),
    Rule(f"{D}reward_fn_key", (), _must_be("data_source", "posttrain picks scorers by 'data_source'", "the same column"), "data_source only"),
    rule(f"{M}path", "model.path", "a local directory: posttrain never downloads (hf download first)"),
    rule(f"{M}enable_gradient_checkpointing", "model.gradient_checkpointing"),
    rule(f"{M}use_remove_padding", "model.remove_padding", "posttrain packs sequences by default"),
    rule(f"{M}lora_rank", "model.lora.rank"),
    rule(f"{M}lora_alpha", "model.lora.alpha"),
    Rule(f"{M}target_modules", ("model.lora.target_modules",), _target_modules, "all-linear = posttrain's default"),
    Rule(f"{A}ppo_mini_batch_size", ("actor.mini_batch_size", "critic.mini_batch_size"), _actor_and_critic("actor.mini_batch_size", "ppo_mini_batch_size", _times_n("actor.mini_batch_size")), "verl counts prompts, posttrain samples: x rollout.n (the critic's too, unless given)"),
    Rule(f"{A}ppo_micro_batch_size_per_gpu", ("actor.micro_batch_size",), same("actor.micro_batch_size"), "samples per worker in both", False),
    Rule(f"{A}ppo_micro_batch_size", ("actor.micro_batch_size",), _per_worker("actor.micro_batch_size"), "global in verl: / GPUs", False),
    Rule(f"{A}use_dynamic_bsz", ("actor.max_token_len_per_worker",), _dynamic_bsz(A, "actor.max_token_len_per_worker"), "True: the token budget"),
    Rule(f"{A}ppo_max_token_len_per_gpu", ("actor.max_token_len_per_worker",), _token_budget(A, "actor.max_token_len_per_worker"), "with use_dynamic_bsz"),
    *(rule(f"{A}{k}", f"actor.{k}", "verl's default 0.2 / 0.2 / 3.0 for every loss") for k in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")),
    *(rule(f"{A}{k}", f"actor.{k}", apply_default=False) for k in ("tau_pos", "tau_neg")),
    Rule(f"{A}clip_ratio", ("actor.clip_ratio_low", "actor.clip_ratio_high"), _clip_ratio, "a bound set to null only", False),
    *(rule(f"{A}{k}", f"actor.{k}") for k in ("loss_agg_mode", "loss_scale_factor", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type")),
    Rule(f"{A}ppo_epochs", ("actor.ppo_epochs", "critic.ppo_epochs"), _actor_and_critic("actor.ppo_epochs", "ppo_epochs", same("actor.ppo_epochs")), "the critic's too, unless given"),
    rule(f"{A}policy_loss.loss_mode", "actor.policy_loss"),
    *(rule(f"{A}policy_loss.{k}", f"actor.{k}", apply_default=False) for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")),
    Rule(f"{A}fsdp_config.param_offload", ("model.offload",), _offload("optimizer_offload"), "with optimizer_offload: one switch"),
    Rule(f"{A}fsdp_config.optimizer_offload", ("model.offload",), _offload("param_offload"), "with param_offload: one switch"),
    Rule(f"{R}name", ("rollout.name",), _rollout_name, "given: vllm or hf as named (sglang: none); unset: the built-in engine", False),
    rule(f"{R}gpu_memory_utilization", "rollout.vllm.gpu_memory_utilization", "with rollout.name=vllm", False),
    rule(f"{R}enforce_eager", "rollout.vllm.enforce_eager", "with rollout.name=vllm", False),
    Rule(f"{R}max_model_len", ("rollout.vllm.max_model_len",), _max_model_len, "with rollout.name=vllm; null = 0 (the model's)", False),
    Rule(f"{R}tensor_model_parallel_size", (), _tensor_parallel, "1 only", False),
    *(rule(f"{R}{k}", f"rollout.vllm.engine_kwargs.{k}", "vLLM's own argument, with rollout.name=vllm", False)
      for k in ("max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching")),
    Rule(f"{R}free_cache_engine", (), _must_be(True, "posttrain always frees the rollout's KV cache while the trainer runs (where the engine can: vLLM on CPU cannot)", "posttrain frees it while training"), "true only", False),
    Rule(f"{R}calculate_log_probs", (), _always_on("posttrain's engines always return the sampled tokens' log-probs"), "either: always computed", False),
    rule(f"{R}n", "rollout.n"),
    Rule(f"{R}temperature", ("rollout.temperature",), _temperature, "with do_sample=true (verl's default) only"),
    Rule(f"{R}do_sample", ("rollout.temperature",), _do_sample, "False: greedy training rollouts (temperature 0)"),
    rule(f"{R}top_p", "rollout.top_p"),
    Rule(f"{R}top_k", ("rollout.top_k",), _top_k, "-1 (off) = 0"),
    rule(f"{R}max_num_seqs", "rollout.max_batch_size", "sequences decoded together per worker", False),
    Rule(f"{R}val_kwargs.temperature", ("rollout.val_temperature",), _val_temperature, "with do_sample=true only"),
    Rule(f"{R}val_kwargs.do_sample", ("rollout.val_temperature",), _val_sample, "False: greedy"),
    Rule(f"{R}val_kwargs.n", (), _val_n, "1 only; pass@k: posttrain eval"),
    Rule(f"{C}model.path", ("critic.model_path",), _critic_path, "the actor's path = empty"),
    Rule(f"{C}ppo_mini_batch_size", ("critic.mini_batch_size",), _times_n("critic.mini_batch_size"), "prompts in verl: x rollout.n", False),
    Rule(f"{C}ppo_micro_batch_size_per_gpu", ("critic.micro_batch_size",), same("critic.micro_batch_size"), "samples per worker in both", False),
    Rule(f"{C}ppo_micro_batch_size", ("critic.micro_batch_size",), _per_worker("critic.micro_batch_size"), "global in verl: / GPUs", False),
    Rule(f"{C}ppo_max_token_len_per_gpu", ("critic.max_token_len_per_worker",), _token_budget(C, "critic.max_token_len_per_worker"), "with use_dynamic_bsz"),
    Rule(f"{C}use_dynamic_bsz", ("critic.max_token_len_per_worker",), _dynamic_bsz(C, "critic.max_token_len_per_worker"), "True: the token budget", False),
    rule(f"{C}cliprange_value", "critic.cliprange_value"),
    rule(f"{C}ppo_epochs", "critic.ppo_epochs"),
    rule("custom_reward_function.path", "reward.custom_function_path"),
    rule("custom_reward_function.name", "reward.custom_function_name"),
    Rule("reward_model.overlong_buffer.enable", (), _overlong_enable, "true: the len below"),
    Rule("reward_model.overlong_buffer.len", ("reward.overlong_buffer_len",), _overlong_buffer("reward.overlong_buffer_len"), "with enable=true only"),
    Rule("reward_model.overlong_buffer.penalty_factor", ("reward.overlong_penalty_factor",), _overlong_buffer("reward.overlong_penalty_factor"), "with enable=true only"),
    Rule("reward_model.enable", ("reward.model.path",), _reward_model, "true: reward.model.path = reward_model.model.path, its score alone (as verl)", False),
    Rule("reward_model.model.path", (), _with_reward_model(""), "with enable=true (there)", False),
    Rule("reward_model.micro_batch_size_per_gpu", ("reward.model.micro_batch_size",), _with_reward_model("reward.model.micro_batch_size"), "with enable=true only", False),
    Rule("reward_model.max_length", ("reward.model.max_length",), _with_reward_model("reward.model.max_length"), "with enable=true only", False),
    Rule("reward_model.reward_manager", (), _must_be(("naive", "dapo"), "posttrain's reward manager is verl's naive one (+ DAPO overlong shaping)", "posttrain's reward manager"), "naive, dapo"),
    rule(f"{T}total_training_steps", "trainer.total_steps"),
    Rule(f"{T}total_epochs", ("trainer.total_steps",), _epochs, "epochs x (train rows // train_batch_size)"),
    rule(f"{T}n_gpus_per_node", "trainer.n_workers_per_node", apply_default=False),
    rule(f"{T}nnodes", "trainer.nnodes", apply_default=False),
    Rule(f"{T}save_freq", ("trainer.save_every",), _freq("trainer.save_every"), "-1 = 0 (posttrain still saves at the end)"),
    Rule(f"{T}test_freq", ("trainer.val_every",), _freq("trainer.val_every"), "-1 = 0 (never)"),
    rule(f"{T}val_before_train", "trainer.val_before_train"),
    Rule(f"{T}critic_warmup", ("algorithm.critic_warmup",), _critic_warmup, "verl's N: actor from its (1-based) step N = N-1 critic-only steps"),
    rule(f"{T}balance_batch", "trainer.balance_batch"),
    Rule(f"{T}max_actor_ckpt_to_keep", ("trainer.max_checkpoints_to_keep",), _checkpoints_to_keep, "null or <= 0 (keep all) = 0; the actor's and critic's checkpoint is one"),
    rule(f"{T}device", "trainer.device", apply_default=False),
    rule(f"{T}default_local_dir", "trainer.run_dir", "checkpoints and logs", False),
    Rule(f"{T}project_name", ("trainer.run_dir",), _run_dir, "run_dir = checkpoints/<project>/<experiment>", False),
    Rule(f"{T}experiment_name", ("trainer.run_dir",), _run_dir, "run_dir = checkpoints/<project>/<experiment>", False),
    Rule(
        f"{T}logger",
        ("trainer.loggers",),
        _loggers,
        "wandb runs offline (files in <run_dir>/wandb; `wandb sync` uploads them), mlflow in <run_dir>/mlflow.db",
        False,
    ),
    Rule(f"{T}resume_from_path", (), _resume_path, "with resume_mode=resume_path (there)", False),
    Rule(f"{T}resume_mode", ("trainer.resume", "trainer.resume_from"), _resume, "auto: true, disable: false, resume_path: resume_from = resume_from_path (a posttrain checkpoint folder)"),
    rule("ray_kwargs.ray_init.num_cpus", "ray.num_cpus", apply_default=False),
    rule("ray_init.num_cpus", "ray.num_cpus", "older name", False),
    Rule("actor_rollout_ref.hybrid_engine", (), _must_be(True, "posttrain's rollout is always the hybrid engine", "posttrain's default"), "True only"),
    Rule(f"{A}ulysses_sequence_parallel_size", ("model.sequence_parallel_size",), same("model.sequence_parallel_size"), "Ulysses sequence parallelism (actor, reference and critic alike)"),
    *(Rule(f"{p}ulysses_sequence_parallel_size", (), _same_as_actor_sp, "the actor's value only (one sp for every role)") for p in (C, "actor_rollout_ref.ref.")),
    *(Rule(f"{p}strategy", (), _must_be(("fsdp", "fsdp2"), "posttrain trains with FSDP2 only (no Megatron)", "FSDP2, as posttrain"), "fsdp, fsdp2") for p in (A, C)),
)  # fmt: skip
