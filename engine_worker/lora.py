"""LoRA on a vLLM worker: the engine arguments that enable it, and a
request's adapter (``GenerateRequest.lora``) as vLLM's LoRARequest.

vLLM loads an adapter the first time a request names it (from the path the
router sends), keeps ``max_loras`` of them in the engine's slots and
``max_cpu_loras`` in host memory, least recently used out first.

Imported only by vLLM workers (it imports vLLM).
"""

from __future__ import annotations

from typing import Any

from vllm.lora.request import LoRARequest

from shared.config import LoraConfig
from shared.protocol import LoraRef


def engine_args(lora: LoraConfig | None) -> dict[str, Any]:
    """AsyncEngineArgs' LoRA fields ({}: LoRA off)."""
    if lora is None:
        return {}
    return {
        "enable_lora": True,
        "max_loras": lora.max_loras,
        "max_lora_rank": lora.max_lora_rank,
        "max_cpu_loras": lora.max_cpu_loras,
    }


class PromptLogprobsRefused(ValueError):
    # the request's 400 names the field that asked for them (SamplingParams'); an HTTP completion
    # asks with echo and logprobs, and the router names echo there (router.api.echo_param)
    parameter = "prompt_logprobs"


def refuse_prompt_logprobs(prompt_logprobs: object, lora_on_cpu: bool) -> None:
    """A PromptLogprobsRefused (the request's 400) for prompt logprobs on a CPU engine with LoRA on:
    vLLM's CPU LoRA kernels (punica_cpu's add_lora_logits) index the logits rows by the sampled
    tokens, not the prompt's, so that engine step raises and the whole engine dies (vLLM 0.32,
    as ``vllm serve --enable-lora`` on CPU does)."""
    if prompt_logprobs is not None and lora_on_cpu:
        raise PromptLogprobsRefused(
            "prompt logprobs (prompt_logprobs, or echo with logprobs) are not served by this model's workers: "
            "vLLM's CPU LoRA kernels cannot compute them"
        )


def lora_request(ref: LoraRef | None, enabled: bool) -> LoRARequest | None:
    """vLLM's request for ``ref``; a ValueError (the request's 400) when this worker runs no LoRA."""
    if ref is None:
        return None
    if not enabled:
        raise ValueError(f"this worker's model runs without LoRA: adapter {ref.name!r} cannot be applied")
    return LoRARequest(ref.name, ref.lora_id, ref.path)
