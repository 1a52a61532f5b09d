"""router.lifecycle.prompts: prompts to token ids once, in the router (exactness against
vLLM's own rendering is in tests/e2e/test_engine_vllm.py)."""

from __future__ import annotations

from pathlib import Path

from router.lifecycle.prompts import INLINE_MAX_CHARS, ModelPrompts
from shared.protocol import ChatMessage, RequestKind, Submit

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"


def test_completion_is_counted_by_the_models_tokenizer():
    from tokenizers import Tokenizer

    prompts = ModelPrompts(str(TINY))
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    text = "The quick brown fox jumps over the lazy dog. " * 5
    got = prompts.tokenize(Submit(request_id="r", model="m", prompt=text))
    assert prompts.exact and got.ids == tok.encode(text).ids and got.count == len(got.ids)


def test_chat_is_rendered_with_the_models_template():
    prompts = ModelPrompts(str(TINY))
    sub = Submit("r", "m", RequestKind.CHAT, messages=[ChatMessage("user", "hi")])
    assert prompts.render_chat(sub) == "<|user|>\nhi</s>\n<|assistant|>\n"  # models/tiny-llama's template
    assert prompts.tokenize(sub).count > 3


def test_without_a_tokenizer_bytes_over_4_and_chat_adds_overhead():
    est = ModelPrompts(None)
    assert not est.exact
    assert est.tokenize(Submit(request_id="r", model="m", prompt="x" * 40)) == ([], 10)
    assert est.tokenize(Submit(request_id="r", model="m", prompt="")).count == 1
    msgs = [ChatMessage(role="user", content="x" * 40), ChatMessage(role="assistant", content="y" * 8)]
    n = est.tokenize(Submit(request_id="r", model="m", kind=RequestKind.CHAT, messages=msgs)).count
    assert 10 + 2 < n < 10 + 2 + 20  # contents plus per-message and reply-primer overhead


def test_only_short_prompts_are_tokenized_on_the_loop():
    prompts = ModelPrompts(str(TINY))
    short = Submit("r", "m", prompt="x" * INLINE_MAX_CHARS)
    long = Submit("r", "m", prompt="x" * (INLINE_MAX_CHARS + 1))
    assert prompts.inline(short) and not prompts.inline(long)
    chat = Submit("r", "m", RequestKind.CHAT, messages=[ChatMessage("user", "hi")])
    assert prompts.inline(chat)
    assert ModelPrompts(None).inline(long)  # an estimate is arithmetic: always inline
