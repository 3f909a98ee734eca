"""config.json's fields as their type: a Hugging Face config read field by field, a value of the
wrong type one line naming the file, the field, the value and the fix (trainer.checkpoint
.hf_families and hf_deepseek read through it)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What a config.json field must hold: a name for the message, and the test.
INT = ("an integer", _is_int)
NUMBER = ("a number", lambda v: _is_int(v) or isinstance(v, float))
BOOL = ("true or false", lambda v: isinstance(v, bool))
TEXT = ("a string", lambda v: isinstance(v, str))
MAPPING = ("a mapping", lambda v: isinstance(v, dict))
INTS = ("a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v)))
TEXTS = ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str)
                                                                       for x in v))
REQUIRED = object()  # a field get() must find


class Fields:
    """A config.json's fields, each read as the type it must hold: a string where a number
    belongs ("8") is one line naming the file, the field, the value and the fix."""

    def __init__(self, values: dict, source: Path, within: str = ""):
        self.values, self.source, self.within = values, source, within

    def get(self, key: str, kind: tuple[str, Any], default: Any = None) -> Any:
        """The field's value; absent or null: `default` (REQUIRED: refused)."""
        value = self.values.get(key)
        if value is None:
            if default is REQUIRED:
                what = kind[0].split(" ", 1)[1]  # "an integer": "has no integer vocab_size"
                raise ValueError(f"{self.source} has no {what} {self.within}{key}. Fix: use the "
                                 f"config.json save_pretrained wrote for the model.")
            return default
        if not kind[1](value):
            raise ValueError(f"{self.source}: {self.within}{key}={json.dumps(value)} is not "
                             f"{kind[0]}. "
                             f"Fix: write it as {kind[0]}{_as_number(value, kind)}, as "
                             f"save_pretrained does.")
        return value

    def inner(self, key: str) -> Fields:
        """A mapping field's own fields (rope_parameters)."""
        return Fields(self.get(key, MAPPING, {}), self.source, f"{self.within}{key}.")


def _as_number(value: Any, kind: tuple[str, Any]) -> str:
    """' (8)' for the string "8" where a number belongs."""
    try:
        number = (int if kind is INT else float)(value) if isinstance(value, str) else None
    except ValueError:
        return ""
    return f" ({number})" if number is not None and kind in (INT, NUMBER) else ""
