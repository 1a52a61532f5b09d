"""The forms a completion's ``prompt`` takes, as vLLM accepts them: a string,
a list of strings, a list of token ids, a list of token-id lists.  Each
prompt becomes its own job (router.lifecycle.fanout); this module only splits
and checks the shape (pure).  Token ids are checked against the model's
vocabulary later, with the tokenizer (router.lifecycle.prompts)."""

from __future__ import annotations

from typing import Any

from router.api.errors import invalid

# router.max_prompts_per_request's default (shared.config)
DEFAULT_MAX_PROMPTS = 128

_SHAPE = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"


def _token_ids(items: list[Any], param: str) -> list[int]:
    for j, t in enumerate(items):
        # (bool is an int in Python; JSON's true is not a token id)
        if type(t) is not int:
            raise invalid(_SHAPE, param=param)
        if t < 0:
            raise invalid(f"Token ids must be non-negative; got {t} at {param}[{j}]", param=param)
    return items


def split_prompt(prompt: str | list[Any], max_prompts: int) -> list[str | list[int]]:
    """One entry per prompt: its text or its token ids (non-empty lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt must not be an empty list", param="prompt")
    first = prompt[0]
    prompts: list[str | list[int]]
    if type(first) is int:  # one prompt as token ids
        prompts = [_token_ids(prompt, "prompt")]
    elif isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise invalid(_SHAPE, param="prompt")
        prompts = list(prompt)
    elif isinstance(first, list):
        prompts = []
        for i, p in enumerate(prompt):
            if not isinstance(p, list):
                raise invalid(_SHAPE, param="prompt")
            if not p:
                raise invalid(f"prompt[{i}] must not be an empty list of token ids", param="prompt")
            prompts.append(_token_ids(p, "prompt"))
    else:
        raise invalid(_SHAPE, param="prompt")
    if len(prompts) > max_prompts:
        raise invalid(
            f"prompt has {len(prompts)} prompts; at most {max_prompts} per request are served "
            "(router.max_prompts_per_request)",
            param="prompt",
        )
    return prompts
