"""vLLM serving a pooling (embedding) model: ``AsyncLLM.encode`` instead of ``generate``.

The same engine as engine_worker.vllm_engine -- started with
``runner="pooling"``, so vLLM loads the model as an embedding model (a
decoder such as a bare ``LlamaModel``: last-token pooling, normalized) --
and the same lifecycle: token-id prompts from the router, one live-table
entry per request, aborts batched per loop turn.  Each request is prefill
only; its one Delta carries the vector as float32 little-endian
(``Delta.embedding``), ``dimensions`` values long where the router asked
for a Matryoshka prefix (vLLM's ``PoolingParams.dimensions``, which it
checks again).  A generation request here is refused (400): the router never
sends one (its model's ``task`` says "embed").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from vllm import PoolingParams

from shared.protocol import GenerateRequest

from .base import EngineInfo, Live, bad_request, engine_error
from .vllm_engine import VllmEngine

log = logging.getLogger(__name__)


class VllmPoolingEngine(VllmEngine):
    def __init__(self, model_path: str, model_name: str, **kwargs: Any) -> None:
        super().__init__(model_path, model_name, **kwargs)
        self.args.runner = "pooling"

    async def start(self) -> EngineInfo:
        return dataclasses.replace(await super().start(), embeds=True)

    def _start(self, req: GenerateRequest, live: Live) -> None:
        if not req.embed:
            self._fail(
                req.request_id, live, bad_request("This worker serves an embedding model; it generates nothing.")
            )
            return
        self._attempts += 1
        live.engine_id = f"{req.request_id}#{self._attempts}"  # (as VllmEngine._start: unique per attempt)
        live.handle = self._loop.create_task(self._embed(req, live))

    async def _embed(self, req: GenerateRequest, live: Live) -> None:
        rid = req.request_id
        try:
            engine, engine_input = await self._render(req)
            if not self._is_live(rid, live):
                return  # aborted meanwhile
            params = PoolingParams(task="embed", dimensions=req.dimensions or None)
            outputs = engine.encode(engine_input, params, live.engine_id, priority=req.priority)
            try:
                async for out in outputs:
                    if not self._is_live(rid, live):
                        break  # aborted: closing the generator aborts it inside vLLM too
                    if out.finished:
                        vector = out.outputs.data.float().numpy().astype("<f4").tobytes()
                        cached = getattr(out, "num_cached_tokens", 0) or 0
                        self._embedded(rid, live, vector, len(out.prompt_token_ids or ()), cached)
                        return
            finally:
                await outputs.aclose()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._failed(rid, live, e)  # (VllmEngine's mapping: 400, engine dead, internal)
        else:
            self._fail(rid, live, engine_error("The engine ended the request without a result."))
