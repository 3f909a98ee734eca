"""The command line's overrides, checked before Hydra composes them (launch.py calls this first).

Hydra reports a wrong type, an unknown key, an unknown option of a config group, a sweep without
-m or an unparsable override in 4-11 lines; here each becomes one line naming the override, what
it takes and a Fix. Only what Hydra would refuse anyway is refused; what cannot be judged before
composing is left to Hydra and settle(): interpolations, hydra.* keys, +/++/~ keys, sweeps other
than a choice list (each choice is checked). Imports no torch: a bad command fails in a second.
"""
from __future__ import annotations

import difflib
import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType, ValueType
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ValidationError
from omegaconf.nodes import BooleanNode, EnumNode, FloatNode, IntegerNode, StringNode

from trainer.config import Config, schema_node

CONF = Path(__file__).resolve().parents[2] / "conf"
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"
CHOICES = (ValueType.SIMPLE_CHOICE_SWEEP, ValueType.CHOICE_SWEEP)


def refuse_bad_command_line(argv: Sequence[str]) -> None:
    """Print the one line and exit 1 (Hydra's own exit code for a bad config)."""
    message = command_line_refusal(argv)
    if message:
        sys.stderr.write(message + "\n")
        sys.exit(1)


def command_line_refusal(argv: Sequence[str]) -> Optional[str]:
    """Why Hydra would refuse this command line, in one line; None if it would not (or if that
    cannot be known here)."""
    # Hydra's own flag parser; its usage errors (and --version) are left to Hydra to print.
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        try:
            args = get_args_parser().parse_args(list(argv))
        except SystemExit:
            return None
    # Help, info and another primary config or config file are not composed as checked here.
    if (args.help or args.hydra_help or args.info or args.shell_completion or args.config_name
            or args.config_path or args.experimental_rerun):
        return None
    overrides = args.overrides
    keys = [text.lstrip("+~").split("=")[0] for text in overrides]
    # Another config folder can bring more groups and options than conf/ holds.
    groups = args.config_dir is None and not any(k.startswith("hydra.searchpath") for k in keys)
    # hydra.mode=MULTIRUN (command line or a config file) sweeps without -m.
    sweeps = args.multirun or "hydra.mode" in keys or _conf_mentions("MULTIRUN")
    if groups and _conf_mentions("searchpath", "config.yaml"):  # Hydra reads it only there
        groups = False
    return overrides_refusal(overrides, sweeps=sweeps, groups=groups)


# Config groups that are null unless an option is picked: (what null means).
NULL_GROUPS = {"peft": "full fine-tuning"}


def overrides_refusal(overrides: Sequence[str], sweeps: bool = True,
                      groups: bool = True) -> Optional[str]:
    """The first override Hydra would refuse, as one line. sweeps: a sweep may run (-m);
    groups: conf/ holds every config group and option (no other search path)."""
    parser = OverridesParser.create()
    schema = OmegaConf.structured(Config)  # the composed config's types: a value fails as there
    unjudged: list[str] = []  # keys added or deleted before: their type is not the schema's
    for text in overrides:
        try:
            override = parser.parse_overrides([text])[0]
        except OverrideParseException as error:
            return parse_refusal(text, error)
        if (override.is_hydra_override() or override.key_or_group == "hydra"
                or override.package is not None):
            continue
        key = override.key_or_group
        # Judged: a plain override, and +group=option (whose option must exist all the same).
        if not (override.type is OverrideType.CHANGE
                or override.type is OverrideType.ADD and _is_group(key)):
            unjudged.append(key)
            continue
        if any(key == k or key.startswith(f"{k}.") for k in unjudged):
            continue
        group = key.split(".")[0]
        if "." in key and group in NULL_GROUPS and not any(
                o.split("=")[0].lstrip("+~") in (group, "experiment") for o in overrides):
            return (f"{text}: {group} is null by default ({NULL_GROUPS[group]}), so it has no "
                    f"keys to set. Fix: pick an option first, e.g. {group}=lora {text}.")
        if override.is_sweep_override():
            message = sweep_refusal(parser, override, sweeps, schema, groups)
        else:
            message = element_refusal(override, text.split("=", 1)[-1], schema, groups)
        if message:
            return message
    return None


def sweep_refusal(parser: OverridesParser, override: Override, sweeps: bool, schema: DictConfig,
                  groups: bool) -> Optional[str]:
    line = override.input_line
    if not sweeps:
        alternative = ""
        if override.value_type is ValueType.SIMPLE_CHOICE_SWEEP:
            key, value = line.split("=", 1)
            alternative = f", or write {key}=[{value}] for one list value"
        return (f"{line}: a value with commas (or choice/range/interval) is a sweep, and a sweep "
                f"runs only with -m. Fix: add -m to run one job per value{alternative}.")
    if override.value_type not in CHOICES:
        return None  # range, interval, glob: their points are composed and checked by the sweeper
    for value in override.sweep_string_iterator():
        try:  # each point as the sweeper writes it: key=value
            point = parser.parse_overrides([f"{override.get_key_element()}={value}"])[0]
        except OverrideParseException:
            continue  # not a plain value; the sweeper composes it
        if point.is_sweep_override():
            continue  # a nested sweep: not a plain value
        message = element_refusal(point, value, schema, groups)
        if message:  # the point, then where it comes from
            head, _, tail = message.partition(": ")
            return f"{head} (a point of the sweep {line}): {tail}"
    return None


def element_refusal(override: Override, text: str, schema: DictConfig,
                    groups: bool) -> Optional[str]:
    key, value = override.key_or_group, override.value()
    # A folder of conf/ is a config group whatever else is searched; a mapping value merges
    # into the group's keys instead, as Hydra does.
    if _is_group(key) and not isinstance(value, dict):
        return group_refusal(key, text, value) if groups else None
    if override.type is not OverrideType.CHANGE:
        return None
    if isinstance(value, str) and "${" in value:
        return None  # an interpolation: its value is known only once composed
    return key_refusal(schema, key, text, value, groups)


def group_refusal(group: str, text: str, value: Any) -> Optional[str]:
    options = sorted(path.stem for path in (CONF / group).glob("*.yaml"))
    if isinstance(value, str):
        if (CONF / group / f"{value}.yaml").is_file():
            return None
        close = difflib.get_close_matches(value, options, 1)
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        return (f"{group}={text}: there is no config {group}/{value} (no conf/{group}/{value}.yaml)"
                f"; the options of {group} are {', '.join(options)}. Fix: pick one of them{hint}.")
    if isinstance(value, list):
        return None  # several options at once: Hydra's to judge
    drop = f", or write ~{group} to leave the group out" if value is None else ""
    return (f"{group}={text}: {group} is a config group and takes the name of one of its options "
            f"({', '.join(options)}). Fix: pick one, e.g. {group}={options[0]}{drop}.")


def key_refusal(schema: DictConfig, key: str, text: str, value: Any,
                groups: bool) -> Optional[str]:
    parts = key.split(".")
    if parts[0] == "layout":
        if len(parts) == 1:
            return None  # layout=...: settle() refuses it with its own line
        return (f"{key}={text}: layout is derived from parallel.*, cluster.* and train.* and is "
                f"read-only. Fix: remove the override and set the parallel.* or cluster.* keys "
                f"it is derived from.")
    node: Any = schema
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None  # inside a list or a free-form value: not typed by the schema
        if part not in node.keys():  # `in` alone would miss keys whose value is ???
            if depth == 0 and not groups:
                return None  # another config folder may hold a group of this name
            return unknown_refusal(node, parts, depth, text)
        typed = schema_node(node, part)
        if typed is not node._get_node(part):  # a null group's keys (peft), to type the value
            node[part] = typed
        node = node._get_node(part)
    try:
        OmegaConf.update(schema, key, value, merge=True)  # what Hydra does with the override
    except ValidationError as error:
        return type_refusal(schema, error.full_key or key, key, text, value)
    return None


def unknown_refusal(node: DictConfig, parts: list[str], depth: int, text: str) -> str:
    """parts[depth] is not a key of node (the schema at parts[:depth])."""
    parent, part, rest = parts[:depth], parts[depth], parts[depth + 1:]
    keys = [str(k) for k in node.keys()]
    if not parent:
        keys += [path.name for path in CONF.iterdir() if path.is_dir() and path.name != "hydra"]
    close = difflib.get_close_matches(part, keys, 1)
    hint = f" (did you mean {'.'.join([*parent, close[0], *rest])}?)" if close else ""
    owner = (f"{'.'.join(parent)} has no key {part}" if parent
             else f"there is no key or config group {part}")
    return (f"{'.'.join(parts)}={text}: {owner}. Fix: correct the key{hint}; `python launch.py "
            f"--cfg job` lists the keys, and a new key cannot be added with +key=value.")


# What a node of each type takes, and how to write it.
TAKES = ((BooleanNode, "true or false"), (IntegerNode, "a whole number (int)"),
         (FloatNode, "a number (float)"), (StringNode, "a string"), (ListConfig, "a list [a,b]"),
         (DictConfig, "a mapping {key: value}"))


def type_refusal(schema: DictConfig, failed: str, key: str, text: str, value: Any) -> str:
    node: Any = schema
    for part in failed.split("."):
        node = node._get_node(part)
    if isinstance(node, EnumNode):
        names = [member.name for member in node.enum_type]
        takes, fix = f"one of {', '.join(names)}", f"pick one of them, e.g. {failed}={names[0]}"
    else:
        takes = next((words for kind, words in TAKES if isinstance(node, kind)), "another value")
        fix = f"write {failed}=<{takes.split(' (')[0]}>"
    optional = node._is_optional()
    if optional:
        takes += " or null"
    not_null = " (it cannot be null)" if value is None and not optional else ""
    where = f" ({failed} of it)" if failed != key else ""
    return f"{key}={text}{where}: {failed} takes {takes}{not_null}. Fix: {fix}."


def parse_refusal(text: str, error: OverrideParseException) -> str:
    key, equals, value = text.partition("=")
    if "~" in value:
        home = value.replace("~", "$HOME")
        return (f"{text}: Hydra reads ~ only as the delete prefix (~key), never as the home "
                f"folder, so it cannot parse this override. Fix: let the shell expand the home "
                f"folder: {key}={home}.")
    if not equals:
        return (f"{text}: an override is key=value (or ~key to delete a key). Fix: give it a "
                f"value, e.g. {text}=VALUE.")
    reason = next((line for line in str(error).splitlines()[1:]
                   if line.strip() not in ("", "^") and not line.startswith("See ")), None)
    cause = error.__cause__
    if reason is None and hasattr(cause, "startIndex"):  # the lexer's error: where, not why
        reason = f"unexpected character {text[cause.startIndex]!r}"
    if reason is None:
        reason = str(error).splitlines()[0]
    return (f"{text}: Hydra cannot parse this override ({reason.strip()}). Fix: quote a value "
            f"with spaces, commas or brackets ('{key}=\"...\"'); the grammar: {GRAMMAR}.")


def _is_group(key: str) -> bool:
    return key != "hydra" and (CONF / key).is_dir()


def _conf_mentions(word: str, paths: str = "**/*.yaml") -> bool:
    return any(word in path.read_text() for path in CONF.glob(paths))
