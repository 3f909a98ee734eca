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

A template is the user's code: one that Jinja cannot read (a syntax error, an unknown filter),
that is empty, that fails on a conversation or loops without end (MAX_LOOP_STEPS) is one line
naming it, for trainer.prepare --chat and trainer.generate --chat alike.
"""
from __future__ import annotations

import json
import time
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
        fix = ("Fix: pass --tokenizer with the folder of a chat model's tokenizer "
               "(tokenizer.json + tokenizer_config.json)")
        if not isinstance(template, str):
            raise ValueError(f"--chat: the tokenizer {tok.name} has no chat_template in its "
                             f"tokenizer_config.json. {fix}")
        if not template.strip():
            raise ValueError(f"--chat: the chat_template in the tokenizer_config.json of "
                             f"{tok.name} is empty: it would render every conversation as "
                             f"nothing. {fix}")
        import jinja2

        self.tok, self.loss_on, self.source = tok, loss_on, tok.name
        try:
            self.template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as error:  # unknown filters and tests too
            said = (error.message or "").rstrip(".")
            raise ValueError(f"--chat: the chat_template in the tokenizer_config.json of "
                             f"{tok.name} is not a template Jinja reads ({said}, line "
                             f"{error.lineno}). Fix: correct it there, or pass --tokenizer with "
                             f"another chat model's tokenizer folder") from None
        self.special = {key: _content(value) for key, value in tok.config.items()
                        if key.endswith("_token") and _content(value) is not None}

    def render(self, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
        import jinja2

        self.template.environment.start_render()
        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=generation_prompt, **self.special)
        except Exception as error:  # noqa: BLE001  (the template is code: anything it raises)
            what = str(error) if isinstance(error, jinja2.TemplateError) else \
                f"{type(error).__name__}: {error}"
            raise ValueError(f"{where}: the chat template of {self.source} fails to render this "
                             f"conversation ({what}). Fix: correct the conversation or the "
                             f"template, or pass --tokenizer with another") from None

    def encode(self, messages: list[dict], where: str, from_message: int = 0
               ) -> tuple[np.ndarray, np.ndarray]:
        """(ids with the end-of-document id, loss mask: 1 where the token is a target).
        from_message: the assistant turns before it are no targets (a preference pair's
        prompt: trainer.data.preference)."""
        text = self.render(messages, where)
        encoding = self.tok.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids + [self.tok.eod_id], dtype=np.int64)
        if self.loss_on == "all":
            return ids, np.ones(ids.size, dtype=np.uint8)
        starts = np.asarray([start for start, _ in encoding.offsets] + [len(text)])
        mask = np.zeros(ids.size, dtype=np.uint8)
        for begin, end in self._assistant_spans(messages, text, where, from_message):
            mask[(starts >= begin) & (starts < end)] = 1
        mask[-1] = 0  # the end-of-document id: a separator, not the assistant's
        return ids, mask

    def _assistant_spans(self, messages: list[dict], text: str, where: str,
                         from_message: int = 0) -> list[tuple[int, int]]:
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < from_message:
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


# Jinja's sandbox caps one range() at 100,000 numbers but not the loops a template nests, so
# two nested loops over range(100000) run 10^10 steps: hours. A template loops over the messages
# (a few times: Qwen3's walks them backwards too) and their tool calls, so a million steps in
# one render is far beyond any real one and stops a runaway one in a few seconds. Steps are
# counted rather than seconds so that a conversation passes or fails alike on every machine;
# the time limit, checked at each step too, is the backstop for a loop of few steps whose body
# is slow (a filter over a long sequence each time), at a bound no real template comes near
# (they render in milliseconds).
MAX_LOOP_STEPS = 1_000_000
MAX_RENDER_SECONDS = 20.0


def _environment():
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import TemplateRuntimeError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class CountedLoops(CodeGenerator):
        """Every {% for %} body, and its `if` filter (which skips items without entering the
        body), counts a step first (environment.loop_step)."""

        def visit_For(self, node, frame):
            def step():
                return nodes.Call(nodes.EnvironmentAttribute("loop_step"), [], [], None, None)

            node.body = [nodes.ExprStmt(step()), *node.body]
            if node.test is not None:
                node.test = nodes.And(step(), node.test)
            super().visit_For(node, frame)

    class Sandbox(ImmutableSandboxedEnvironment):
        code_generator_class = CountedLoops

        def start_render(self):
            self.loop_steps, self.deadline = 0, time.monotonic() + MAX_RENDER_SECONDS

        def loop_step(self) -> bool:
            self.loop_steps += 1
            if self.loop_steps > MAX_LOOP_STEPS:
                raise TemplateRuntimeError(f"it runs more than {MAX_LOOP_STEPS:,} loop steps, "
                                           f"a loop that would not end in reasonable time")
            if time.monotonic() > self.deadline:
                raise TemplateRuntimeError(f"it loops for more than {MAX_RENDER_SECONDS:.0f} s")
            return True

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

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
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
