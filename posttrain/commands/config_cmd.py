"""`posttrain config show | reference | from-verl`: the resolved config of a command line, every key with its
type, default and meaning, and a verl command line or YAML in posttrain's keys."""

from __future__ import annotations

import argparse
import dataclasses
import json

from posttrain.commands.reference import COMMANDS, iter_keys, markdown, schema_of


def add_parser(sub: argparse._SubParsersAction) -> None:
    from posttrain.commands import from_verl_cmd

    config = sub.add_parser(
        "config", help="the resolved config, the key reference, and verl's keys in posttrain's"
    )
    actions = config.add_subparsers(dest="action", required=True, metavar="{show,reference,from-verl}")

    p = actions.add_parser("show", help="the fully resolved config of a command line (defaults + overrides)")
    p.add_argument("config_command", choices=list(COMMANDS), metavar="command", help=", ".join(COMMANDS))
    p.add_argument("overrides", nargs="*", help="key=value, as given to the command")
    p.add_argument("--config-name", help="a YAML under posttrain/config/yaml (default: the command's own)")
    p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    p.set_defaults(func=_show)

    p = actions.add_parser("reference", help="every config key with its type, default and meaning")
    p.add_argument("--command", choices=[*COMMANDS, "all"], default="all", help="whose keys")
    p.add_argument("--format", choices=("markdown", "json"), default="markdown")
    p.set_defaults(func=_reference)

    from_verl_cmd.add_parser(actions)


def _show(args: argparse.Namespace) -> None:
    from posttrain.config.load import load_config, to_dict

    schema, config_name = schema_of(args.config_command)
    cfg = load_config(schema, args.config_name or config_name, args.overrides)
    resolved = to_dict(cfg)
    if args.format == "json":
        print(json.dumps(resolved, indent=1))
    else:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.create(resolved)), end="")


def _reference(args: argparse.Namespace) -> None:
    commands = list(COMMANDS) if args.command == "all" else [args.command]
    if args.format == "markdown":
        print(markdown(commands), end="")
        return
    out = {
        command: [dataclasses.asdict(doc) for doc in iter_keys(schema_of(command)[0])] for command in commands
    }
    print(json.dumps(out, indent=1))
