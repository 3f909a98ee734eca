"""docs/reference.md, generated: every key of every config group with its type, its default (the
composed default config's value) and its meaning (the field's own comment in trainer/config.py).
No torch. `python -m trainer.compose.reference` rewrites the page; tests hold it equal.
"""
from __future__ import annotations

import ast
import dataclasses
import io
import sys
import tokenize
from enum import Enum
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from trainer import config as schema

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference.md"
CONF = ROOT / "conf"
SOURCE = Path(schema.__file__)

HEADER = """# Configuration reference

Every key of every config group: its type, its default (what `python launch.py` composes with
no override) and its meaning. Generated from the schemas' own field comments in
`trainer/config.py` by `python -m trainer.compose.reference`; `tests/unit/test_reference.py`
holds this page equal to the schema and fails when a field has no comment. Set any key on the
command line (`train.seq_length=256`), pick a group's option (`model=small`), or see the
composed values with `python launch.py --cfg job --resolve`. The layout's keys are explained in
[layout.md](layout.md), the other topics in the [docs index](README.md).
"""


def field_comments(source: str) -> dict[str, dict[str, str]]:
    """{class: {field: comment}}: the comment lines directly above a field (no blank line
    between) followed by the comment on its own line, joined into one sentence run."""
    comments, code_lines = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    found: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            line, above = item.lineno, []
            while line - 1 in comments and line - 1 not in code_lines:
                line -= 1
                above.insert(0, comments[line])
            own = [comments[item.lineno]] if item.lineno in comments else []
            found.setdefault(node.name, {})[item.target.id] = " ".join(above + own)
    return found


def type_name(annotation: str) -> str:
    """A schema annotation as a user writes the value: enums as their choices, Optional as
    `or null`."""
    if annotation.startswith("Optional[") and annotation.endswith("]"):
        return f"{type_name(annotation[len('Optional['):-1])} or null"
    if annotation.startswith("List[") and annotation.endswith("]"):
        return f"list of {type_name(annotation[len('List['):-1])}"
    kind = getattr(schema, annotation, None)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return " / ".join(f"`{member.value}`" for member in kind)
    return {"Any": "any (see meaning)", "str": "string"}.get(annotation, annotation)


def value_text(value: Any) -> str:
    if isinstance(value, Enum):
        value = value.value
    if value is None:
        return "null"
    if value == "???":
        return "required"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).replace("'", "")


def default_config() -> dict[str, Any]:
    """The composed default config, interpolations kept as written (no layout resolved)."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return OmegaConf.to_container(compose("config"), resolve=False)


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


def section(title: str, cls: type, comments: dict[str, str], values: dict[str, Any],
            prefix: str, missing: list[str]) -> list[str]:
    lines = [f"## {title}", ""]
    if cls.__doc__ and cls is not schema.Config:
        lines += [" ".join(cls.__doc__.split()), ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for spec in dataclasses.fields(cls):
        if dataclasses.is_dataclass(spec.type) or spec.type in GROUPS:
            continue
        meaning = comments.get(spec.name, "")
        if not meaning:
            missing.append(f"{cls.__name__}.{spec.name}")
        default = values.get(spec.name)
        shown = "derived (read-only)" if spec.name == "layout" else f"`{value_text(default)}`"
        lines.append(f"| `{prefix}{spec.name}` | {type_name(spec.type)} | {shown} | "
                     f"{meaning.replace('|', '/')} |")
    return [*lines, ""]


GROUPS = {spec.name: spec.type for spec in dataclasses.fields(schema.Config)
          if spec.type.endswith("Config")}


def render() -> tuple[str, list[str]]:
    """The page, and the fields that have no comment (which the test refuses)."""
    comments = field_comments(SOURCE.read_text())
    values, defaults, missing = default_config(), _group_defaults(), []
    lines = [HEADER, "Groups: " + ", ".join(f"[{g}](#{g})" for g in GROUPS)
             + ", and the [top-level keys](#top-level-keys).", ""]
    for group, cls_name in GROUPS.items():
        cls = getattr(schema, cls_name)
        found = options(group)
        lines += section(group, cls, comments.get(cls_name, {}), values[group], f"{group}.",
                         missing)[:1]
        lines += [f"Options (`{group}=NAME`, files in `conf/{group}/`): "
                  + ", ".join(f"`{o}`" + (" (default)" if o == defaults.get(group) else "")
                              for o in found) + ".", ""]
        lines += section(group, cls, comments.get(cls_name, {}), values[group], f"{group}.",
                         missing)[2:]
    lines += section("Top-level keys", schema.Config, comments.get("Config", {}), values, "",
                     missing)
    lines += ["Presets that set keys of several groups: "
              + ", ".join(f"`experiment={o}`" for o in options("experiment")) + "; "
              + ", ".join(f"`debug={o}`" for o in options("debug")) + "; sweep launchers "
              + ", ".join(f"`hydra/launcher={o}`" for o in options("hydra/launcher"))
              + " (with `-m`).", ""]
    return "\n".join(lines), missing


def _group_defaults() -> dict[str, str]:
    """Each group's option in conf/config.yaml's defaults list."""
    import yaml
    listed = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    return {key: value for entry in listed if isinstance(entry, dict)
            for key, value in entry.items()}


def main() -> int:
    page, missing = render()
    if missing:
        print("fields without a comment in trainer/config.py: " + ", ".join(missing),
              file=sys.stderr)
        return 1
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
