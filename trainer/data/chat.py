"""Chat data for supervised fine-tuning: a conversation's messages rendered with the tokenizer's
own chat template (its tokenizer_config.json "chat_template", Jinja), tokenized, and a loss mask
that counts the assistant's turns only (or, with loss_on="all", every token).

The template is rendered as Hugging Face renders it (transformers' apply_chat_template): a
sandboxed Jinja environment with trim_blocks and lstrip_blocks, loop controls, its tojson
filter and raise_exception/strftime_now globals, the tokenizer's special tokens as variables;
the text is tokenized without adding special tokens (the template writes them), so the ids are
transformers' own (tests/unit/test_chat.py checks them against it). The end-of-document id
follows, as for any document.

Which characters an assistant turn wrote is found by rendering prefixes of the conversation:
turn i spans from the end of messages[:i] rendered with the generation prompt to the end of
messages[:i + 1]. Each must extend the one before; a template that renders earlier turns
differently once later ones follow (some drop earlier reasoning) is one line naming the
conversation, and --loss-on all trains on it as it is. A token counts when it starts inside an
assistant span (its end-of-turn marker included, so the model learns to stop).
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import numpy as np

LOSS_ON = ("assistant", "all")


class ChatEncoder:
    def __init__(self, tok, loss_on: str = "assistant"):
        """tok: a trainer.data.tokenizer.HFTokenizer whose folder has a chat template."""
        if loss_on not in LOSS_ON:
            raise ValueError(f"--loss-on {loss_on}: expected one of {', '.join(LOSS_ON)}")
        template = tok.config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            None)
        if not isinstance(template, str):
            raise ValueError(f"--chat: the tokenizer {tok.name} has no chat_template in its "
                             f"tokenizer_config.json. Fix: pass --tokenizer with the folder of a "
                             f"chat model's tokenizer (tokenizer.json + tokenizer_config.json)")
        self.tok, self.loss_on, self.source = tok, loss_on, tok.name
        self.template = _environment().from_string(template)
        self.special = {key: _content(value) for key, value in tok.config.items()
                        if key.endswith("_token") and _content(value) is not None}

    def render(self, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=generation_prompt, **self.special)
        except jinja2.TemplateError as error:
            raise ValueError(f"{where}: the chat template of {self.source} fails to render this "
                             f"conversation ({error})") from None

    def encode(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids with the end-of-document id, loss mask: 1 where the token is a target)."""
        text = self.render(messages, where)
        encoding = self.tok.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids + [self.tok.eod_id], dtype=np.int64)
        if self.loss_on == "all":
            return ids, np.ones(ids.size, dtype=np.uint8)
        starts = np.asarray([start for start, _ in encoding.offsets] + [len(text)])
        mask = np.zeros(ids.size, dtype=np.uint8)
        for begin, end in self._assistant_spans(messages, text, where):
            mask[(starts >= begin) & (starts < end)] = 1
        mask[-1] = 0  # the end-of-document id: a separator, not the assistant's
        return ids, mask

    def _assistant_spans(self, messages: list[dict], text: str, where: str
                         ) -> list[tuple[int, int]]:
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], where, generation_prompt=True) if i else ""
            through = self.render(messages[:i + 1], where)
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    f"{where}: the chat template of {self.source} renders the turns before "
                    f"assistant message {i} differently once later ones follow, so its tokens "
                    f"cannot be told apart. Fix: --loss-on all")
            spans.append((len(before), len(through)))
        return spans


def _environment():
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}, which some templates wrap the assistant's
        text in for transformers' assistant mask: rendered as its body (the spans here come
        from rendering prefixes, for every template)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str):
    import jinja2

    raise jinja2.TemplateError(message)


def _content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
