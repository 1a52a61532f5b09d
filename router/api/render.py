"""Non-streamed response bodies: one choice's text (``render_completion``),
any shape -- several choices, logprobs, echo (``Accumulator``) -- and the
model list."""

from __future__ import annotations

from router.api.chat import AssistantMessage, ChatChoice, ChatCompletion
from router.api.completions import CompletionChoice, TextCompletion
from router.api.context import ResponseContext
from router.api.encoding import encode
from router.api.logprobs import ChoiceState, add_logprobs, add_prompt_logprobs, chat_logprobs, completion_logprobs
from router.api.tools import extract_calls, tool_finish_reason
from router.api.usage import TokenCounts, usage_of
from shared.protocol import Delta, RequestKind


def render_completion(
    ctx: ResponseContext,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    stop_reason: str | int | None = None,
) -> bytes:
    usage = usage_of(prompt_tokens, completion_tokens, cached_tokens)
    if ctx.kind == RequestKind.COMPLETION:
        return encode(
            TextCompletion(
                ctx.id,
                "text_completion",
                ctx.created,
                ctx.model,
                [CompletionChoice(0, text, None, finish_reason, stop_reason)],
                usage,
                ctx.fingerprint,
            )
        )
    return encode(
        ChatCompletion(
            ctx.id,
            "chat.completion",
            ctx.created,
            ctx.model,
            [ChatChoice(0, AssistantMessage("assistant", text), None, finish_reason, stop_reason)],
            usage,
            ctx.fingerprint,
        )
    )


class Accumulator:
    """A non-streamed response of any shape: choices by index, logprobs, echo."""

    __slots__ = ("ctx", "counts", "choices", "prompt_ids")

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.counts = TokenCounts()
        self.choices = [ChoiceState() for _ in range(max(1, ctx.n))]
        self.prompt_ids: list[int] | None = [] if ctx.return_token_ids else None

    def add(self, deltas: list[Delta]) -> None:
        lp = self.ctx.logprobs is not None
        ids = self.ctx.return_token_ids
        choices = self.choices
        for d in deltas:
            self.counts.add(d)
            if d.prompt_token_ids and ids:
                self.prompt_ids = d.prompt_token_ids
            if d.index >= len(choices):
                continue  # an engine bug; never index past the request's n
            c = choices[d.index]
            if d.text:
                c.texts.append(d.text)
            if lp:
                add_logprobs(c, d)
                add_prompt_logprobs(self.ctx, choices, d)
            if ids and d.token_ids:
                c.ids.extend(d.token_ids)
            if d.choice_finish is not None:
                c.finish, c.stop_reason = d.choice_finish, d.stop_reason
            if d.finish_reason is not None:
                if c.finish is None:
                    c.stop_reason = d.stop_reason  # (its own choice's; the others' came with choice_finish)
                for other in choices:  # the last choice's reason; an abort ends every open one
                    if other.finish is None:
                        other.finish = d.finish_reason

    def render(self) -> bytes:
        ctx = self.ctx
        usage = self.counts.usage()
        lp = ctx.logprobs is not None
        ids = ctx.return_token_ids
        if ctx.kind == RequestKind.COMPLETION:
            return encode(
                TextCompletion(
                    ctx.id,
                    "text_completion",
                    ctx.created,
                    ctx.model,
                    [
                        CompletionChoice(
                            i,
                            ctx.echo + "".join(ch.texts),
                            completion_logprobs(ctx, ch, 0, ctx.echo_logprobs > 0) if lp else None,
                            ch.finish,
                            ch.stop_reason,
                            self.prompt_ids,
                            ch.ids if ids else None,
                        )
                        for i, ch in enumerate(self.choices)
                    ],
                    usage,
                    ctx.fingerprint,
                )
            )
        spec = ctx.tools
        choices = []
        for i, ch in enumerate(self.choices):
            text = "".join(ch.texts)
            if spec is not None and spec.parses:
                content, calls = extract_calls(spec, text)
                message = AssistantMessage("assistant", content, calls)
                finish = tool_finish_reason(spec, bool(calls), ch.finish)
            else:
                message, finish = AssistantMessage("assistant", text), ch.finish
            choices.append(
                ChatChoice(
                    i, message, chat_logprobs(ctx, ch) if lp else None, finish, ch.stop_reason, ch.ids if ids else None
                )
            )
        return encode(
            ChatCompletion(
                ctx.id, "chat.completion", ctx.created, ctx.model, choices, usage, ctx.fingerprint, self.prompt_ids
            )
        )


def render_models(models: list[tuple[str, int, int, str]], created: int) -> bytes:
    """OpenAI's model list; weir adds each model's context, its workers ready
    now and its state (loading / ready / unloading: models at run time)."""
    return encode(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "weir",
                    "root": name,
                    "parent": None,
                    "max_model_len": max_len,
                    "ready_workers": ready,
                    "state": state,
                }
                for name, max_len, ready, state in models
            ],
        }
    )
