"""verl keys with no posttrain equivalent (no rule in verl_map or verl_agent_map), by exact key or prefix, with
the reason.

Part of the migration table (docs/migration_from_verl.md is generated from it, verl_map and verl_agent_map).
"""

from __future__ import annotations

from posttrain.commands.verl_map import A, C, D, M, R, T

# keys without a rule: exact key or prefix (ending in ".") -> why there is no posttrain equivalent
UNMAPPED: dict[str, str] = {
    f"{R}log_prob_micro_batch_size": "log-prob passes use actor.micro_batch_size / actor.max_token_len_per_worker",
    f"{R}log_prob_micro_batch_size_per_gpu": "log-prob passes use actor.micro_batch_size / actor.max_token_len_per_worker",
    "actor_rollout_ref.ref.": "the reference is the actor's initial weights (LoRA: adapter off), in the actor's workers or on a pool of its own (resources.ref); its batches and offload follow the actor's",
    f"{R}multi_turn.interaction_config_path": "verl's interactions (a simulated user who replies to each answer, e.g. with feedback and a request to retry): a posttrain tool_agent episode has no user turns and ends at the first answer without a tool call; a loop that answers as the user is an Env of your own registered with @register_agent (docs/agents.md)",
    f"{R}multi_turn.function_tool_path": "a Python file of functions with verl's @function_tool: posttrain takes a typed function (plain, or with posttrain.agents.tools.function_tool) by its dotted path as a class_name in agent.tool_config_path (its module must be importable; docs/agents.md, Tools)",
    f"{R}multi_turn.num_repeat_rollouts": "not read by verl's agent loop; the samples per prompt are rollout.n",
    f"{R}multi_turn.": "a verl multi-turn option with no posttrain equivalent (posttrain's are agent.*, docs/agents.md)",
    f"{R}agent.agent_loop_config_path": "verl's YAML list of agent-loop classes: a posttrain loop is a Python function registered with @register_agent(name) (posttrain.agents.registry) in a module listed in agent.modules (a dotted name or a .py file, imported at start; agent.options reach it); each row's agent_name, or agent.default_agent for rows without one, picks it",
    f"{R}agent.num_workers": "verl's agent-loop worker processes: posttrain runs every episode as a coroutine in the driver and generates the turns waiting at once as one batch on the rollout workers; tool calls at once: agent.tool_concurrency",
    f"{R}agent.agent_loop_manager_class": "no pluggable agent-loop manager: the driver's wave sampler batches every waiting episode's turn (posttrain/agents/batching.py)",
    f"{R}agent.custom_async_server.": "a vLLM/SGLang server class: the agent loop samples from the built-in engine",
    f"{R}agent.": "a verl agent-loop option with no posttrain equivalent (posttrain's are agent.*, docs/agents.md)",
    f"{R}val_kwargs.": "validation samples untruncated at rollout.val_temperature (greedy by default, as verl's val_kwargs.do_sample=false): no top-p/top-k",
    f"{R}engine_kwargs.": "another engine's arguments (SGLang's): no SGLang adapter; verl's engine_kwargs.vllm map to rollout.vllm.engine_kwargs",
    f"{R}": "a vLLM/SGLang engine setting that posttrain does not carry over (vLLM's further arguments: rollout.vllm.engine_kwargs)",
    f"{A}fsdp_config.": "FSDP2 is applied the same way for every model; only model.offload is configurable",
    f"{C}model.fsdp_config.": "the critic's FSDP2 setup follows the actor's (model.offload)",
    f"{C}model.": "the critic shares the actor's model settings (model.*)",
    f"{A}checkpoint.": "posttrain always saves model, optimizer and trainer state",
    f"{A}profiler.": "no profiler integration",
    f"{C}profiler.": "no profiler integration",
    "global_profiler.": "no profiler integration",
    f"{M}": "no posttrain equivalent for this model option (posttrain loads local HF directories)",
    f"{D}val_batch_size": "validation runs the whole split (up to data.val_max_prompts) as one batch",
    "reward_model.": "verl's reward model settings are not converted: posttrain's reward model is reward.model.* (path, weight, with_rule_rewards, pool), set by hand",
    f"{T}max_critic_ckpt_to_keep": "posttrain saves the actor and the critic in one checkpoint per step: trainer.max_checkpoints_to_keep (from max_actor_ckpt_to_keep) limits both",
    f"{T}": "no posttrain equivalent for this trainer option",
    f"{D}": "no posttrain equivalent for this data option",
    "algorithm.": "no posttrain equivalent for this algorithm option",
    f"{A}": "no posttrain equivalent for this actor option",
    f"{C}": "no posttrain equivalent for this critic option",
}
GENERIC = "from-verl knows no posttrain equivalent for this key"


def unmapped_reason(key: str) -> str:
    """Why `key` (without a rule) cannot be mapped: the longest matching entry of UNMAPPED."""
    if key in UNMAPPED and UNMAPPED[key]:
        return UNMAPPED[key]
    prefixes = [p for p in UNMAPPED if p.endswith(".") and key.startswith(p) and UNMAPPED[p]]
    return UNMAPPED[max(prefixes, key=len)] if prefixes else GENERIC
