"""docs/reference.md, generated: every key of every config group with its type, its default (the
composed default config's value) and its meaning (the field's own comment in trainer/config.py).
No torch. `python -m trainer.compose.reference` rewrites the page; tests hold it equal.
"""
from __future__ import annotations

import ast
import dataclasses
import io
import sys
import textwrap
import tokenize
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
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


# group -> its schema's class name (a group that is null by default, peft, too)
GROUPS = {spec.name: spec.type.removeprefix("Optional[").removesuffix("]")
          for spec in dataclasses.fields(schema.Config)
          if spec.type.removeprefix("Optional[").removesuffix("]").endswith("Config")}


def section(title: str, cls: type, comments: dict[str, str], values: dict[str, Any],
            prefix: str, intro: list[str], missing: list[str]) -> list[str]:
    """One group's table; fields without a comment are added to `missing`."""
    lines = [f"## {title}", ""]
    doc = cls.__doc__ or ""
    if not doc.startswith(f"{cls.__name__}("):  # a dataclass without a docstring gets its signature
        lines += [" ".join(doc.split()), ""]
    lines += [*intro, "| key | type | default | meaning |", "|---|---|---|---|"]
    for spec in dataclasses.fields(cls):
        if spec.name in GROUPS and cls is schema.Config:
            continue
        meaning = comments.get(spec.name, "")
        if not meaning:
            missing.append(f"{cls.__name__}.{spec.name}")
        derived = spec.name == "layout"  # a node the resolver fills, not a value to set
        shown = "derived" if derived else f"`{value_text(values.get(spec.name))}`"
        kind = "read-only node" if derived else type_name(spec.type)
        lines.append(f"| `{prefix}{spec.name}` | {kind} | {shown} | "
                     f"{meaning.replace('|', '/')} |")
    return [*lines, ""]


def render() -> tuple[str, list[str]]:
    """The page, and the fields that have no comment (which the test refuses)."""
    comments = field_comments(SOURCE.read_text())
    values, missing = default_config(), []
    chosen = {key: value for entry in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
              if isinstance(entry, dict) for key, value in entry.items()}
    lines = [HEADER, "Groups: " + ", ".join(f"[{g}](#{g})" for g in GROUPS)
             + ", and the [top-level keys](#top-level-keys).", ""]
    for group, cls_name in GROUPS.items():
        listed = ", ".join(f"`{o}`" + (" (default)" if o == chosen.get(group) else "")
                           for o in options(group))
        intro = [f"Options (`{group}=NAME`, files in `conf/{group}/`): {listed}.", ""]
        shown = values[group]
        if shown is None:  # null by default: the keys as its first option sets them
            first = options(group)[0]
            shown = yaml.safe_load((CONF / group / f"{first}.yaml").read_text())
            intro[0] = intro[0][:-1] + f"; null by default, the values shown are `{first}`'s."
        lines += section(group, getattr(schema, cls_name), comments.get(cls_name, {}),
                         shown, f"{group}.", intro, missing)
    lines += section("Top-level keys", schema.Config, comments.get("Config", {}), values, "",
                     [], missing)
    lines += ["Presets that set keys of several groups: "
              + ", ".join(f"`experiment={o}`" for o in options("experiment")) + "; "
              + ", ".join(f"`debug={o}`" for o in options("debug")) + "; sweep launchers "
              + ", ".join(f"`hydra/launcher={o}`" for o in options("hydra/launcher"))
              + " (with `-m`)."]
    # Prose wrapped at 100 columns like the other pages; a table row stays one line.
    text = "\n".join(line if line.startswith("|") else textwrap.fill(line, 100,
                                                                      break_on_hyphens=False)
                     for line in "\n".join(lines).split("\n"))
    return text + "\n", missing


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
