"""Prompts to tokens, once per request, in the router -- and off its event loop.

For a model with a tokenizer (``tokenizer.json`` in its directory) the
router renders chat messages with the model's chat template, as vLLM's
renderer does, and tokenizes exactly; the worker gets the token ids and
never tokenizes again (tests/e2e/test_engine_vllm.py checks the ids equal
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

The same pass checks what only the model can judge, before anything is
reserved: token ids (``logit_bias``, ``stop_token_ids``) against the
vocabulary, and a structured-output constraint by compiling it with
xgrammar (vLLM's default backend) -- a JSON schema ~0.1 ms when small, 12 ms
for a 35 kB one, so large ones go to the thread; importing xgrammar takes
~2.8 s, so the first one always does.  ``BadInput`` names the field.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from datetime import datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

from router.lifecycle.embedding_model import dimensions_error, read_shape
from router.policy.estimate import estimate_chat, estimate_text
from shared.protocol import ChatMessage, ChatOptions, RequestKind, StructuredOutput, Submit

_DEFAULT_CHAT = ChatOptions()

if TYPE_CHECKING:  # (both imported where first needed: the router starts without them)
    import jinja2
    from tokenizers import Tokenizer

# ~256 tokens, ~0.3 ms of tokenizing inline: below the 1 ms loop-stall budget
# even with a few such requests in one loop turn.
INLINE_MAX_CHARS = 1024

# Longer prompts up to this size (~4k tokens, ~5 ms of a thread) are short:
# they have a lane of their own on the tokenizer threads, ahead of long ones
# (router.lifecycle.tokenizer_queue), so they never wait for a 220 KB prompt's ~150 ms.
SHORT_MAX_CHARS = 16_384


# A constraint up to this size compiles in well under a millisecond (measured
# ~0.1-0.4 ms for small JSON schemas): inline; larger ones on the thread.
INLINE_MAX_GRAMMAR_CHARS = 2048

_xgr: ModuleType | None = None  # xgrammar, imported on the tokenizing thread by the first structured request
_xgr_lock = threading.Lock()


class BadInput(ValueError):
    """A request the model cannot take; ``param`` is the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _grammar_chars(so: StructuredOutput) -> int:
    return (
        len(so.json or "")
        + len(so.regex or "")
        + len(so.grammar or "")
        + len(so.structural_tag or "")
        + sum(len(c) for c in so.choice)
    )


def _xgrammar() -> ModuleType:
    global _xgr
    if _xgr is None:
        with _xgr_lock:
            if _xgr is None:
                import xgrammar

                _xgr = xgrammar
    return _xgr


def check_structured(so: StructuredOutput) -> None:
    """Compile the constraint as vLLM's xgrammar backend would, or BadInput."""
    kinds = so.kinds()
    if len(kinds) != 1:
        raise BadInput(
            "structured output needs exactly one of json, json_object, regex, choice, grammar, structural_tag; "
            f"got {', '.join(kinds) or 'none'}",
            param="structured_outputs",
        )
    kind = kinds[0]
    if kind == "json_object":
        return
    if kind == "choice":
        if any(not c for c in so.choice):
            raise BadInput("structured output choices must be non-empty strings", param="structured_outputs.choice")
        return
    xgr = _xgrammar()
    # exactly one of these is set (its kind)
    if so.json is not None:
        try:
            schema = json.loads(so.json)
        except ValueError as e:
            raise BadInput(f"The JSON schema is not valid JSON: {e}", param="response_format") from None
        if not isinstance(schema, (dict, bool)):
            raise BadInput("The JSON schema must be an object", param="response_format")
        _compile(xgr.Grammar.from_json_schema, so.json, "The JSON schema", "response_format")
    elif so.regex is not None:
        if "\x00" in so.regex:
            raise BadInput("The regex must not contain a NUL character", param="structured_outputs.regex")
        _compile(xgr.Grammar.from_regex, so.regex, "The regex", "structured_outputs.regex")
    elif so.grammar is not None:
        _compile(xgr.Grammar.from_ebnf, so.grammar, "The grammar", "structured_outputs.grammar")
    elif so.structural_tag is not None:
        _compile(
            xgr.Grammar.from_structural_tag,
            so.structural_tag,
            "The structural tag",
            "structured_outputs.structural_tag",
        )


def _compile(build: Callable[[str], object], source: str, what: str, param: str) -> None:
    """xgrammar's compile of ``source``; its failure is the request's 400 naming ``param``."""
    try:
        build(source)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own kinds
        raise BadInput(f"{what} does not compile: {_xgr_message(e)}", param=param) from None


def _xgr_message(e: Exception) -> str:
    # "[08:35:00] /project/cpp/json_schema_converter.cc:4944: Unsupported type ..." -> the reason
    text = str(e).strip()
    head, sep, tail = text.partition(": ")
    if sep and head.startswith("["):
        text = tail.split(": ", 1)[-1] if ".cc:" in tail.split(": ", 1)[0] else tail
    return text.strip()


class TokenText:
    """Token id -> its text as vLLM's logprobs show it: the token decoded
    alone (special tokens included), with a SentencePiece leading space that
    decoding strips restored (vllm.tokenizers.detokenizer_utils).  Cached:
    the vocabulary is finite and rendering logprobs asks for the same ids."""

    __slots__ = ("_tok", "_cache", "_marker")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}
        self._marker: str | None = None
        try:
            pre = json.loads(tokenizer.to_str()).get("pre_tokenizer") or {}
            for step in [pre] + list(pre.get("pretokenizers") or ()):
                if step.get("type") == "Metaspace":
                    self._marker = step.get("replacement", "\u2581")
        except Exception:
            pass

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self._tok.decode([tid], skip_special_tokens=False) or ""
            marker = self._marker
            if marker is not None:
                raw = self._tok.id_to_token(tid) or ""
                lead = len(raw) - len(raw.lstrip(marker))
                missing = lead - (len(s) - len(s.lstrip(" ")))
                if missing > 0:
                    s = " " * missing + s
            self._cache[tid] = s
        return s


class PromptTokens(NamedTuple):
    ids: list[int]  # exact token ids; empty when the model has no tokenizer
    # (a field named like tuple.count, which it hides on instances: mypy flags the clash)
    count: int  # type: ignore[assignment]  # len(ids), or the estimate


def prompt_chars(sub: Submit) -> int:
    if sub.kind == RequestKind.CHAT:
        chat = sub.chat
        extra = len(chat.tools or "") + len(chat.documents or "") if chat is not None else 0
        return sum(len(m.content) for m in sub.messages) + extra  # (tools and documents may be rendered)
    if sub.prompt_token_ids:  # checking an id costs about what tokenizing ~4 characters does
        return 4 * len(sub.prompt_token_ids)
    return len(sub.prompt)


class ModelPrompts:
    """One model's prompt rendering and tokenization (thread-safe)."""

    def __init__(
        self, model_dir: str | None = None, tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False
    ) -> None:
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tokenizer: Tokenizer | None = None
        self._template: jinja2.Template | None = None  # the compiled chat template
        self._template_source = ""
        self._template_vars: frozenset[str] = frozenset()  # the variables it reads (chat_template_kwargs filter)
        self._special: dict[str, str] = {}
        self.vocab_size = 0
        self._token_text: TokenText | None = None
        self.embedding = read_shape(model_dir)  # judged only for embedding requests (``dimensions``)
        if model_dir:
            path = os.path.join(model_dir, "tokenizer.json")
            if os.path.isfile(path):
                from tokenizers import Tokenizer  # only models with a tokenizer need it

                self.tokenizer = Tokenizer.from_file(path)
                self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
                source, self._special = _chat_template(model_dir)
                if source is not None:
                    self._template = _compile_template(source)
                    self._template_source = source
                    self._template_vars = _template_variables(source)

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def token_text(self) -> TokenText | None:
        if self._token_text is None and self.tokenizer is not None:
            self._token_text = TokenText(self.tokenizer)
        return self._token_text

    def inline(self, sub: Submit) -> bool:
        """Cheap enough to tokenize (and check) on the event loop?"""
        so = sub.params.structured if sub.params is not None else None
        if (
            so is not None
            and (so.json is not None or so.regex is not None or so.grammar is not None or so.structural_tag is not None)
            and (_xgr is None or _grammar_chars(so) > INLINE_MAX_GRAMMAR_CHARS)
        ):
            return False  # compiling it imports xgrammar, or takes milliseconds
        chat = sub.chat
        if chat is not None and chat.tools and chat.tool_choice == "auto":
            if _xgr is None or len(chat.tools) > INLINE_MAX_GRAMMAR_CHARS:
                return False  # its tools' schemas are compiled (below)
        if self.tokenizer is None:
            return True  # an estimate is arithmetic
        return prompt_chars(sub) <= INLINE_MAX_CHARS

    def short(self, sub: Submit) -> bool:
        """Short enough for the tokenizer threads' short lane (``SHORT_MAX_CHARS``):
        its prompt and any constraint to compile, with xgrammar already imported
        (its first import takes seconds)."""
        so = sub.params.structured if sub.params is not None else None
        grammar = _grammar_chars(so) if so is not None else 0
        compiles = grammar > 0 or (sub.chat is not None and bool(sub.chat.tools) and sub.chat.tool_choice == "auto")
        if compiles and _xgr is None:
            return False
        return prompt_chars(sub) + grammar <= SHORT_MAX_CHARS

    def check(self, sub: Submit) -> None:
        """What the model decides about a request's parameters (BadInput)."""
        if sub.dimensions is not None:
            refused = dimensions_error(self.embedding, sub.model, sub.dimensions)
            if refused is not None:
                raise BadInput(refused, param="dimensions")
        params = sub.params
        if params is None:
            return
        vocab = self.vocab_size
        if vocab:
            bad = [t for t in params.logit_bias if t >= vocab]
            if bad:
                raise BadInput(
                    f"logit_bias has token ids outside the vocabulary (size {vocab}): "
                    f"{', '.join(map(str, sorted(bad)[:8]))}",
                    param="logit_bias",
                )
            bad = [t for t in params.stop_token_ids if t >= vocab]
            if bad:
                raise BadInput(
                    f"stop_token_ids has token ids outside the vocabulary (size {vocab}): "
                    f"{', '.join(map(str, sorted(bad)[:8]))}",
                    param="stop_token_ids",
                )
        if params.structured is not None:
            try:
                check_structured(params.structured)
            except BadInput as e:
                if sub.chat is not None and sub.chat.tool_choice in ("required", "named"):
                    raise BadInput(f"{e} (the tools' parameters schema)", param="tools") from None
                if (
                    params.structured.structural_tag is not None
                    and sub.chat is not None
                    and sub.chat.tool_choice == "auto"
                ):
                    # the router's tag for auto (router.api.tools.auto_constraint), built from the
                    # tools: an HTTP client cannot send a structural tag
                    raise BadInput(f"{e} (the tag of the tools' call format)", param="tools") from None
                raise

    def check_tools(self, sub: Submit) -> None:
        """Tools the model can serve: its config names a tool-call parser
        where the choice needs one (vLLM's 400s); with ``auto``, every tool's
        parameters schema compiles (as vLLM's strict tool calling compiles them)."""
        chat = sub.chat
        if chat is None:
            return
        _chat_json(chat)  # (ZeroMQ submissions come unchecked)
        if chat.tool_choice not in ("none", "auto", "required", "named"):
            raise BadInput("tool_choice must be none, auto, required or named", param="tool_choice")
        if chat.tool_choice == "none":
            return
        from router.api.tools import unsupported_tool_choice

        message = unsupported_tool_choice(chat.tool_choice, self.tool_call_parser, self.enable_auto_tool_choice)
        if message is not None:
            raise BadInput(message, param="tool_choice")
        if chat.tool_choice == "auto" and chat.tools:
            for i, tool in enumerate(json.loads(chat.tools)):
                function = tool.get("function")
                schema = function.get("parameters") if isinstance(function, dict) else None
                if schema:
                    try:
                        check_structured(StructuredOutput(json=json.dumps(schema)))
                    except BadInput as e:
                        raise BadInput(str(e), param=f"tools[{i}].function.parameters") from None

    def tokenize(self, sub: Submit) -> PromptTokens:
        self.check_tools(sub)
        self.check(sub)
        if sub.prompt_token_ids:  # a completion's prompt or an embedding's input as token ids
            return self._given_ids(sub.prompt_token_ids, "input" if sub.kind == RequestKind.EMBEDDING else "prompt")
        tok = self.tokenizer
        if tok is None:
            if sub.kind == RequestKind.CHAT:
                n = estimate_chat(sub.messages) + (estimate_text(sub.chat.tools) if sub.chat and sub.chat.tools else 0)
            else:
                n = estimate_text(sub.prompt)
            return PromptTokens([], max(1, n))
        if sub.kind == RequestKind.CHAT:
            # vLLM tokenizes a rendered chat without special tokens (the
            # template writes them; add_special_tokens asks for them) and a
            # completion with them (BOS).
            text, special = self.render_chat(sub), sub.chat is not None and sub.chat.add_special_tokens
        else:
            text, special = sub.prompt, True
        ids = tok.encode_batch([text], add_special_tokens=special)[0].ids
        return PromptTokens(ids, len(ids))

    def _given_ids(self, ids: list[int], param: str) -> PromptTokens:
        """A prompt (or embedding input) given as token ids: checked against
        the vocabulary, sent as they are (no tokenizer -- the simulated engine's
        models -- nothing to check them against)."""
        vocab = self.vocab_size
        if vocab:
            top = max(ids)
            if top >= vocab:
                raise BadInput(f"Token id {top} is out of vocabulary (size {vocab})", param=param)
        return PromptTokens(list(ids), len(ids))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (``encode_batch``: releases the GIL on a thread)."""
        assert self.tokenizer is not None
        return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text as vLLM's /detokenize and echo decode them (special tokens kept)."""
        assert self.tokenizer is not None
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def token_strs(self, ids: list[int]) -> list[str]:
        """The vocabulary's strings for ``ids`` (transformers' convert_ids_to_tokens)."""
        assert self.tokenizer is not None
        tok = self.tokenizer
        return [tok.id_to_token(i) or "" for i in ids]

    def render_chat(self, sub: Submit) -> str:
        """The chat as vLLM renders it (vllm/renderers/hf.py, transformers'
        ``apply_chat_template``): tools, documents, the generation prompt or
        the final message continued, and the template kwargs the template reads."""
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        opts = sub.chat or _DEFAULT_CHAT
        messages = [_template_message(m) for m in sub.messages]
        tools, given, documents = _chat_json(opts)
        kwargs: dict[str, Any] = dict(self._special)
        kwargs.update({k: v for k, v in given.items() if k in self._template_vars})
        kwargs["add_generation_prompt"] = opts.add_generation_prompt
        if documents is not None:
            kwargs["documents"] = documents
        kwargs.setdefault("documents", None)
        tag = ""
        if opts.continue_final_message:
            last = messages[-1]
            final = last["content"]
            if "content" not in self._template_source:
                raise BadInput(
                    'continue_final_message is set to "content" but this is not an accepted field in the chat_template',
                    param="continue_final_message",
                )
            last["content"] = final + _CONTINUE_TAG
        try:
            rendered = self._template.render(messages=messages, tools=tools, **kwargs)
        except Exception as e:  # the template refuses the input (raise_exception): a 400, as vLLM
            raise BadInput(f"The chat template refused the request: {e}", param="messages") from None
        if opts.continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in rendered or tag not in rendered:
                raise BadInput(
                    "continue_final_message is set but the final message does not appear in the chat "
                    "after applying the chat template",
                    param="continue_final_message",
                )
            at = rendered.rindex(tag)
            rendered = (
                rendered[:at] if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:at].rstrip()
            )
        return rendered


def _chat_json(opts: ChatOptions) -> tuple[list[dict[str, Any]] | None, dict[str, Any], list[Any] | None]:
    """ChatOptions' JSON fields parsed and type-checked: (tools, template kwargs, documents)."""

    def load(text: str | None, kind: type, param: str) -> Any:
        if text is None:
            return None
        try:
            value = json.loads(text)
        except ValueError:
            raise BadInput(f"{param} is not valid JSON", param=param) from None
        if not isinstance(value, kind) or (isinstance(value, list) and not all(isinstance(v, dict) for v in value)):
            raise BadInput(f"{param} must be a JSON {'array of objects' if kind is list else 'object'}", param=param)
        return value

    tools = load(opts.tools, list, "tools") if opts.tools else None
    return (
        tools,
        load(opts.template_kwargs, dict, "chat_template_kwargs") or {},
        load(opts.documents, list, "documents"),
    )


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as vLLM hands it to the template (vllm/renderers/chat_utils.py):
    tool calls' arguments parsed to objects (bad JSON: ``{}``), ids and names kept."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            args: Any = {}
            if c.arguments:
                try:
                    args = json.loads(c.arguments)
                except ValueError:
                    args = {}
                if not isinstance(args, dict):
                    args = {}
            calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads: vLLM passes only those of
    ``chat_template_kwargs`` (vllm/renderers/hf.py resolve_chat_template_kwargs)."""
    import jinja2.meta

    env = _compile_template("").environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def _chat_template(model_dir: str) -> tuple[str | None, dict[str, str]]:
    """The chat template and special tokens HF tokenizers hand to it."""
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    cfg: dict[str, Any] = {}  # tokenizer_config.json
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


def _compile_template(source: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it (see the module docstring)."""
    import jinja2
    from jinja2 import ext, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant
        tokens with it): renders its body; nothing here needs the marks."""

        tags = {"generation"}  # noqa: RUF012 -- jinja2's Extension declares it a plain set

        def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> NoReturn:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: object,
        ensure_ascii: bool = False,
        indent: int | str | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
