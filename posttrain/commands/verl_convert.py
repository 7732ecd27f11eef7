"""Apply verl_map's and verl_agent_map's rules to a set of verl settings, and write the migration table from
the same rules.

`convert` sorts every verl key into mapped (posttrain key = value), no effect (posttrain does this anyway)
and not mapped (with the reason), and carries over verl's defaults where they differ from posttrain's.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from importlib.util import find_spec
from typing import Any

from posttrain.algorithms.policy_loss import own_options
from posttrain.algorithms.registry import get_policy_loss
from posttrain.commands import verl_map
from posttrain.commands.verl_agent_map import AGENT_RULES
from posttrain.commands.verl_map import VERL_DEFAULTS, Context, NoEffect, Rule, Unmappable
from posttrain.commands.verl_optim_map import OPTIM_RULES
from posttrain.commands.verl_unmapped import UNMAPPED, unmapped_reason
from posttrain.config.load import from_dict, to_dict
from posttrain.config.schema import RLConfig
from posttrain.errors import ConfigError
from posttrain.rollout import VLLM_INSTALL_HINT
from posttrain.trainers.settings_in_effect import unused_rl_settings
from posttrain.trainers.setup import LOSS_OPTION_ALIASES, LOSS_OPTION_FIELDS

RULES: tuple[Rule, ...] = (*verl_map.RULES, *OPTIM_RULES, *AGENT_RULES)  # every rule: one per verl key
BY_KEY: dict[str, Rule] = {r.verl: r for r in RULES}


@dataclasses.dataclass(frozen=True)
class Mapped:
    verl_key: str
    verl_value: Any
    key: str  # posttrain's
    value: Any
    origin: str  # "given" | "verl default"
    note: str


@dataclasses.dataclass(frozen=True)
class Skipped:
    verl_key: str
    verl_value: Any
    reason: str


@dataclasses.dataclass
class Conversion:
    mapped: list[Mapped] = dataclasses.field(default_factory=list)
    no_effect: list[Skipped] = dataclasses.field(default_factory=list)
    unmapped: list[Skipped] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # about mapped values, shown with the command

    def overrides(self) -> list[str]:
        """The posttrain command line (`key=value`, Hydra syntax; `+key=value` for a chat template argument: a
        new key of that mapping, as in verl)."""
        first = {m.key: m for m in reversed(self.mapped)}  # one verl key per posttrain key: the first
        return [
            f"{'+' if m.key.startswith(ADDED_KEYS) else ''}{m.key}={hydra_value(m.value)}"
            for m in self.mapped
            if first[m.key] is m
        ]


def posttrain_default(key: str) -> Any:
    value: Any = RLConfig()
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _norm(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_norm(v) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


TEMPLATE_KWARGS = "data.apply_chat_template_kwargs."  # verl's `+data.apply_chat_template_kwargs.<name>=...`
VERL_VLLM_KWARGS = "actor_rollout_ref.rollout.engine_kwargs.vllm."  # verl's further vllm.LLM arguments
VLLM_KWARGS = "rollout.vllm.engine_kwargs."  # posttrain's
ADDED_KEYS = (TEMPLATE_KWARGS, VLLM_KWARGS)  # keys of a mapping: `+key=value` on the command line


def convert(given: Mapping[str, Any], train_rows: int | None = None) -> Conversion:
    """posttrain's settings for the verl settings `given` (flattened keys -> values). A key given as null
    (verl's `key=null`) is not a setting: verl's code falls back as for an unset key without a default (a
    micro-batch size, `clip_ratio` for a clip bound), so neither it nor verl's default for it is carried. A key
    whose verl default is null (`max_actor_ckpt_to_keep`: keep all) is converted as that default."""
    null_default = {k for k, v in given.items() if v is None and k in BY_KEY and k in VERL_DEFAULTS}
    null_default = {k for k in null_default if VERL_DEFAULTS[k] is None}
    nulls = frozenset(k for k, v in given.items() if v is None and k not in null_default)
    given = {k: v for k, v in given.items() if k not in nulls}
    ctx = Context(given, train_rows, nulls)
    out = Conversion()
    for key in sorted(nulls):
        out.no_effect.append(Skipped(key, None, "null: verl's fallback for an unset key"))
    source: dict[str, str] = {}  # posttrain key -> the verl key that set it

    def add(rule_key: str, verl_value: Any, values: dict[str, Any], origin: str, note: str) -> None:
        for key, value in values.items():
            if key in source:
                previous = next(m for m in out.mapped if m.key == key)
                if _norm(previous.value) != _norm(value):
                    out.unmapped.append(
                        Skipped(
                            rule_key, verl_value, f"conflicts with {source[key]} ({key}={previous.value})"
                        )
                    )
                elif origin == "given":  # agrees with the key that set it: shown, set once
                    out.mapped.append(Mapped(rule_key, verl_value, key, value, origin, note))
                continue
            if origin == "verl default" and _norm(value) == _norm(posttrain_default(key)):
                continue
            source[key] = rule_key
            out.mapped.append(Mapped(rule_key, verl_value, key, value, origin, note))

    for key, value in given.items():
        if key.startswith(TEMPLATE_KWARGS):  # one argument of the chat template: the same key here
            add(key, value, {key: value}, "given", "the chat template's own argument")
            continue
        if key.startswith(VERL_VLLM_KWARGS):  # one vllm.LLM argument: passed as given with rollout.name=vllm
            name = VLLM_KWARGS + key.removeprefix(VERL_VLLM_KWARGS)
            add(key, value, {name: value}, "given", "a vllm.LLM argument, with rollout.name=vllm")
            continue
        rule = BY_KEY.get(key)
        if rule is None:
            out.unmapped.append(Skipped(key, value, unmapped_reason(key)))
            continue
        try:
            add(key, value, rule.convert(value, ctx), "given", rule.note)
        except NoEffect as exc:
            out.no_effect.append(Skipped(key, value, str(exc)))
        except Unmappable as exc:
            out.unmapped.append(Skipped(key, value, str(exc)))
    for rule in RULES:
        if (
            rule.verl in given
            or rule.verl in nulls
            or not rule.apply_default
            or rule.verl not in VERL_DEFAULTS
        ):
            continue
        value = VERL_DEFAULTS[rule.verl]
        try:
            add(rule.verl, value, rule.convert(value, ctx), "verl default", rule.note)
        except NoEffect:
            pass
        except Unmappable as exc:
            out.unmapped.append(Skipped(rule.verl, value, f"verl's default {value!r}: {exc}"))
    _leave_out_unused(out)
    if any(m.key == "rollout.name" and m.value == "vllm" for m in out.mapped) and find_spec("vllm") is None:
        out.notes.append(
            f"{VLLM_INSTALL_HINT}: not installed here (or drop rollout.name=vllm: the built-in engine)"
        )
    return out


def _leave_out_unused(out: Conversion) -> None:
    """Move to `no_effect` the mapped keys whose switch is off in the converted run (verl's `kl_loss_type`
    default while `use_kl_loss` is false, a critic's settings without a critic, a policy-loss option the chosen
    loss does not take: every full verl config has clip_cov_ratio ... ppo_kl_coef with loss_mode vanilla):
    posttrain refuses a key that would be ignored, and verl does not read these either."""
    nested: dict[str, Any] = to_dict(RLConfig())
    for m in out.mapped:
        node = nested
        *parents, leaf = m.key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = m.value
    try:
        cfg = from_dict(RLConfig, nested)
    except ConfigError:
        return  # an invalid value: `posttrain train` on the converted line names it
    unused = {key.split("=", 1)[0]: because for keys, because in unused_rl_settings(cfg) for key in keys}
    unused |= _loss_options_not_taken(cfg.actor.policy_loss)
    kept = []
    for m in out.mapped:
        # a key of a mapping (rollout.vllm.engine_kwargs.<name>) is unused when its mapping is
        section = next((k for k in unused if m.key == k or m.key.startswith(k + ".")), None)
        if section is not None:
            out.no_effect.append(Skipped(m.verl_key, m.verl_value, f"not used: {unused[section]}"))
        else:
            kept.append(m)
    out.mapped = kept


def _loss_options_not_taken(policy_loss: str) -> dict[str, str]:
    """actor.<option> -> why, for the policy-loss options (trainers.setup.LOSS_OPTION_FIELDS) that the loss
    `policy_loss` does not take (posttrain's start-up check refuses them when set)."""
    try:
        takes = own_options(get_policy_loss(policy_loss))
    except ConfigError:
        return {}  # an unknown loss: the converter's check names it
    return {
        f"actor.{name}": f"actor.policy_loss={policy_loss} does not take it"
        for name in LOSS_OPTION_FIELDS
        if LOSS_OPTION_ALIASES.get(name, name) not in takes
    }


# characters Hydra reads in an unquoted value (its grammar's ID, digits and UNQUOTED_CHAR, and ':'): `~`, `$`,
# `\`, brackets, quotes, commas, spaces and anything else is quoted
UNQUOTED = re.compile(r"[A-Za-z0-9_/\-+.%*@?|:]+")


def hydra_value(value: Any) -> str:
    """`value` in Hydra's override syntax (lists in brackets, strings quoted unless Hydra reads them back
    unquoted as the same string: `~/data/x.parquet`, `true`, `1e-5`, `a b` are quoted)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, str):
        return value if _reads_back(value) else _quoted(value)
    return str(value)


def _reads_back(text: str) -> bool:
    from hydra.errors import HydraException

    if not UNQUOTED.fullmatch(text):
        return False
    try:
        (override,) = _override_parser().parse_overrides([f"k={text}"])
    except HydraException:
        return False
    return override.value() == text


def _quoted(text: str) -> str:
    """`text` in single quotes, Hydra's way: a quote is escaped with a backslash, and so is each backslash of a
    run that ends at a quote or at the closing quote; other backslashes are literal. `${` is escaped too (a
    quoted string is still interpolated)."""
    escaped = re.sub(r"(\\*)('|\Z)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text)
    return "'" + escaped.replace("${", "\\${") + "'"


@functools.cache
def _override_parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def migration_markdown() -> str:
    """docs/migration_from_verl.md: every rule and every unmapped key or prefix, from the tables."""
    lines = [
        "# Coming from verl",
        "",
        "Generated from `posttrain/commands/verl_map.py` and `verl_agent_map.py` (do not edit; a test checks "
        "this page against the code). `posttrain config from-verl` applies the same table to a command line or "
        "YAML:",
        "",
        "```bash",
        "posttrain config from-verl --script examples/grpo_trainer/run_qwen2-7b.sh   # a verl launch script",
        "posttrain config from-verl data.train_batch_size=1024 actor_rollout_ref.rollout.n=5 ...",
        "posttrain config from-verl --yaml my_verl_config.yaml",
        "```",
        "",
        "It prints the `posttrain train` command line, each conversion, and every key it cannot map with the "
        "reason. Units differ in a few places: verl's `ppo_mini_batch_size` counts prompts, posttrain's "
        "`mini_batch_size` counts samples (prompt x response), so it is multiplied by `rollout.n`; verl's "
        "global `ppo_micro_batch_size` is divided by the GPUs; verl's lr warm-up counts RL steps (it steps its "
        "scheduler once per update) and posttrain's `optim.warmup_steps` optimizer steps, so it is multiplied "
        "by `ppo_epochs` x mini-batches per step; `total_epochs` becomes `trainer.total_steps` from the train "
        "file's rows (with `data.filter_overlong_prompts`, the rows that fit `data.max_prompt_length`, counted "
        "with the model's tokenizer when `actor_rollout_ref.model.path` is a local directory). A verl command "
        "line relies on verl's defaults: where one differs from posttrain's (last column), it is carried over, "
        "so the converted run is the verl run.",
        "",
        "## Mapped keys",
        "",
        "| verl key | posttrain key | conversion | verl default carried over |",
        "|---|---|---|---|",
    ]
    for rule in RULES:
        targets = ", ".join(f"`{t}`" for t in rule.targets) or "(nothing to set)"
        default = ""
        if rule.apply_default and rule.verl in VERL_DEFAULTS:
            value = VERL_DEFAULTS[rule.verl]
            default = "`null`" if value is None else f"`{value}`"
        lines.append(f"| `{rule.verl}` | {targets} | {rule.note or 'same value'} | {default} |")
    lines += [
        "",
        "## Keys with no posttrain equivalent",
        "",
        "A key ending in `.` stands for every key under it that has no rule above.",
        "",
        "| verl key | why |",
        "|---|---|",
    ]
    lines += [f"| `{key}` | {reason} |" for key, reason in UNMAPPED.items()]
    return "\n".join(lines) + "\n"
