"""Prompts to tokens, once per request, in the router -- and off its event loop.

For a model with a tokenizer (``tokenizer.json`` in its directory) the
router renders chat messages with the model's chat template, as vLLM's
renderer does, and tokenizes exactly; the worker gets the token ids and
never tokenizes again (tests/test_engine_vllm.py checks the ids equal
vLLM's own rendering).  For a model without one (the simulated engine) it
counts UTF-8 bytes / 4 plus a per-message template overhead, and the worker
uses that count as the prompt's length.

Chat templates are compiled with jinja2 exactly as transformers compiles
them (``_compile_jinja_template`` in transformers/utils/chat_template_utils.py:
a sandboxed environment with trim_blocks, lstrip_blocks, loop controls, its
``tojson``, ``raise_exception`` and ``strftime_now``) rather than through
transformers itself, whose import costs the router ~1.2 s of CPU holding
the GIL (measured; jinja2's: 85 ms).

Cost, measured on this VM (tokenizers 0.23, tiny-llama's BPE): ~60 us for a
short prompt, ~1.2 us per token beyond that -- 76 ms for 64k tokens, time
in which every stream on the loop would stall.  So prompts longer than
``INLINE_MAX_CHARS`` are tokenized on a worker thread: ``encode_batch``
releases the GIL (a spinning thread kept 95 % of its speed beside it;
``encode`` keeps the GIL and left it 7 %).  Short ones stay inline: a
thread hop costs more than they do.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import NamedTuple, Optional

from router.estimate import estimate_chat, estimate_text
from shared.protocol import ChatMessage, RequestKind, Submit

# ~256 tokens, ~0.3 ms of tokenizing inline: below the 1 ms loop-stall budget
# even with a few such requests in one loop turn.
INLINE_MAX_CHARS = 1024


class PromptTokens(NamedTuple):
    ids: list[int]  # exact token ids; empty when the model has no tokenizer
    count: int  # len(ids), or the estimate


def prompt_chars(sub: Submit) -> int:
    if sub.kind == RequestKind.CHAT:
        return sum(len(m.content) for m in sub.messages)
    return len(sub.prompt)


class ModelPrompts:
    """One model's prompt rendering and tokenization (thread-safe)."""

    def __init__(self, model_dir: Optional[str] = None) -> None:
        self.tokenizer = None
        self._template = None  # the compiled chat template
        self._special: dict[str, str] = {}
        if model_dir:
            path = os.path.join(model_dir, "tokenizer.json")
            if os.path.isfile(path):
                from tokenizers import Tokenizer  # only models with a tokenizer need it

                self.tokenizer = Tokenizer.from_file(path)
                source, self._special = _chat_template(model_dir)
                if source is not None:
                    self._template = _compile_template(source)

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def inline(self, sub: Submit) -> bool:
        """Cheap enough to tokenize on the event loop?"""
        if self.tokenizer is None:
            return True  # an estimate is arithmetic
        return prompt_chars(sub) <= INLINE_MAX_CHARS

    def tokenize(self, sub: Submit) -> PromptTokens:
        tok = self.tokenizer
        if tok is None:
            n = estimate_chat(sub.messages) if sub.kind == RequestKind.CHAT else estimate_text(sub.prompt)
            return PromptTokens([], max(1, n))
        if sub.kind == RequestKind.CHAT:
            # vLLM tokenizes a rendered chat without special tokens (the
            # template writes them) and a completion with them (BOS).
            text, special = self.render_chat(sub), False
        else:
            text, special = sub.prompt, True
        ids = tok.encode_batch([text], add_special_tokens=special)[0].ids
        return PromptTokens(ids, len(ids))

    def render_chat(self, sub: Submit) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": m.content} for m in sub.messages]
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=True, **self._special)


def _chat_template(model_dir: str) -> tuple[Optional[str], dict[str, str]]:
    """The chat template and special tokens HF tokenizers hand to it."""
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    cfg = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja) as f:
            template = f.read()
    special = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = cfg.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            special[name] = v
    return template, special


def _compile_template(source: str):
    """A chat template compiled as transformers compiles it (see the module docstring)."""
    import jinja2
    from jinja2 import ext, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant
        tokens with it): renders its body; nothing here needs the marks."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
