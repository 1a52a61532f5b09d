"""SIMULATED engine: SimCore (engine_worker/sim_model.py) driven in real time.

No model runs: every token's text is the placeholder " tok" (id
``SIM_TOKEN_ID``), and a prompt is as long as the router counted it
(``GenerateRequest.prompt_tokens``: the same estimate admission priced, so
nothing is corrected).  It exists to load-test the dataplane without an
accelerator; it registers as engine "sim" and serves only "sim-..." models.

It refuses (400) what it cannot honour rather than fake it: structured
output, logprobs, logit_bias, stop_token_ids and n > 1 (``refusal``).
Parameters that only choose *which* token comes (temperature, top_p,
top_k, min_p, penalties, seed) do not change its output's length or cost
and are accepted, as temperature always was; min_tokens holds trivially
(it always generates max_tokens).

A sim model with ``task = "embed"`` answers embedding requests instead:
each costs its prefill and one step (the calibrated cost of a prompt
through the engine), and its vector is a placeholder -- SIM_EMBEDDING_SIZE
values, deterministic per prompt (seeded by its length and block hashes),
unit length, truncated to ``dimensions`` and normalized again as vLLM
does for Matryoshka models.  It means nothing; its size and cost are real.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import struct

from shared.config import SimEngineConfig
from shared.protocol import SIM_EMBEDDING_SIZE, ErrorInfo, GenerateRequest, SamplingParams, WorkerStats

from .base import EngineBase, EngineInfo, Live, bad_request
from .sim_model import SimCore, StepResult

log = logging.getLogger(__name__)

SIM_TOKEN_TEXT = " tok"
SIM_TOKEN_ID = 0


def sim_vector(prompt_tokens: int, block_hashes: list[int], dimensions: int = 0) -> bytes:
    """The placeholder embedding of a prompt: float32 little-endian, unit length."""
    seed = hashlib.sha256(struct.pack("<q", prompt_tokens) + b"".join(h.to_bytes(8, "little") for h in block_hashes))
    raw = (seed.digest() * (SIM_EMBEDDING_SIZE // 32 + 1))[:SIM_EMBEDDING_SIZE]
    values = [b / 127.5 - 1.0 for b in raw][: dimensions or SIM_EMBEDDING_SIZE]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return struct.pack(f"<{len(values)}f", *(v / norm for v in values))


_MAX_LAG_S = 0.02


def refusal(p: SamplingParams) -> ErrorInfo | None:
    """The 400 for a parameter the simulated engine cannot honour, or None."""
    what = None
    if p.structured is not None:
        what, param = "structured output (response_format / structured_outputs)", "response_format"
    elif p.logprobs is not None or p.prompt_logprobs is not None:
        what, param = "logprobs", "logprobs"
    elif p.logit_bias:
        what, param = "logit_bias", "logit_bias"
    elif p.stop_token_ids:
        what, param = "stop_token_ids", "stop_token_ids"
    elif p.n > 1:
        what, param = "n > 1", "n"
    if what is None:
        return None
    return bad_request(
        f"The simulated engine cannot honour {what}: it generates placeholder tokens, "
        f"not a model's. Use a real model for this request.",
        param,
    )


class SimEngine(EngineBase):
    name = "sim"

    def __init__(self, cfg: SimEngineConfig, max_num_seqs: int, max_model_len: int, *, embeds: bool = False) -> None:
        super().__init__()
        self.embeds = embeds  # an embedding model: embedding requests only
        self._vectors: dict[str, bytes] = {}  # embedding requests running: their vector, sent when the step ends
        self.cfg = cfg
        self.core = SimCore(cfg, max_num_seqs, max_model_len)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self._loop: asyncio.AbstractEventLoop | None = None
        # The next step's start or end, scheduled on the loop; None when idle.
        # Callbacks rather than a task awaiting an Event: a few microseconds
        # less per step, which is the whole cost of a zero-cost engine.
        self._handle: asyncio.Handle | None = None
        self._deadline = 0.0  # when the step in flight ends (loop clock)

    async def start(self) -> EngineInfo:
        self._loop = asyncio.get_running_loop()
        c = self.cfg
        if c.zero_cost:  # only the dataplane's own cost is left (~10 us a step, bench/README.md)
            step_s, request_s = 1e-5, 1e-6
        else:
            step_s = (c.step_fixed_ms * 1e3 + c.decode_token_us * self.max_num_seqs) / 1e6
            request_s = c.admit_request_us / 1e6
        caching = c.prefix_caching
        return EngineInfo(
            self.name,
            self.max_model_len,
            self.core.kv_capacity_tokens,
            self.core.block_size,
            self.max_num_seqs,
            step_time_s=step_s,
            request_overhead_s=request_s,
            prefix_caching=caching,
            prefix_hash="sim" if caching else "",
            embeds=self.embeds,
        )

    def _start(self, req: GenerateRequest, live: Live) -> None:
        rid = req.request_id
        refused = refusal(req.params)
        if refused is None and req.embed != self.embeds:
            refused = bad_request(
                "This simulated model serves embeddings only."
                if self.embeds
                else "This simulated model embeds nothing."
            )
        if refused is not None:
            self._fail(rid, live, refused)
            return
        prompt, max_tokens = max(1, req.prompt_tokens), req.params.max_tokens
        if req.embed:  # its prefill and one step (a prompt of the whole context is priced one token short)
            self._vectors[rid] = sim_vector(req.prompt_tokens, req.block_hashes, req.dimensions)
            prompt, max_tokens = min(prompt, self.max_model_len - 1), 1
        try:
            self.core.add(rid, prompt, max_tokens, req.priority, req.block_hashes)
        except ValueError as e:
            self._vectors.pop(rid, None)
            self._fail(rid, live, bad_request(str(e)))
            return
        if self._handle is None and self.fatal_error is None and self._loop is not None:
            self._handle = self._loop.call_soon(self._begin)  # an idle engine starts next turn

    def _stop(self, rid: str, live: Live) -> None:
        self.core.abort(rid)
        self._vectors.pop(rid, None)

    def stats(self) -> WorkerStats:
        c = self.core
        return WorkerStats(
            running=c.num_running,
            waiting=c.num_waiting,
            kv_usage=c.kv_usage,
            preemptions_total=c.preemptions_total,
            aborts_total=self.aborts_total,
            finished_total=self.finished_total,
        )

    async def shutdown(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    # -- the step loop, as callbacks --------------------------------------------

    def _begin(self) -> None:
        loop = self._loop
        assert loop is not None  # scheduled on it by _start
        self._deadline = loop.time()  # an idle engine starts its next step now
        self._next_step()

    def _next_step(self) -> None:
        core = self.core
        if not core.has_work:
            self._handle = None
            return
        try:
            result = core.step()
        except Exception as e:  # a bug, not a request's fault: let the worker exit and be restarted
            self._engine_failed(e)
            return
        # Steps end on an absolute schedule so that timer rounding (uvloop
        # rounds to 1 ms) averages out instead of accumulating; if the loop
        # fell far behind, restart the schedule rather than burst to catch up.
        loop = self._loop
        assert loop is not None  # set by start(), before any step
        now = loop.time()
        if now - self._deadline > _MAX_LAG_S:
            self._deadline = now
        self._deadline += result.duration_s
        # Outputs appear at the end of the step, as with a real engine; always
        # yield so the worker's outbox flushes one Outputs message per step.
        if self._deadline > now:
            self._handle = loop.call_at(self._deadline, self._end_step, result)
        else:
            self._handle = loop.call_soon(self._end_step, result)

    def _end_step(self, result: StepResult) -> None:
        live_map = self._live
        try:
            feed = self.kv_feed
            if feed is not None and (result.stored or result.removed):  # as vLLM's KV events, per step
                if result.removed:
                    feed.removed(result.removed)
                if result.stored:
                    feed.stored(result.stored)
            cached = result.cached
            for rid, n, finish in result.outputs:
                live = live_map.get(rid)
                if live is not None and rid in self._vectors:  # an embedding: its one step is done
                    if finish is not None:
                        self._embedded(
                            rid, live, self._vectors.pop(rid), live.prompt_tokens, cached.get(rid, 0) if cached else 0
                        )
                elif live is not None:  # else: aborted while the step "ran"
                    self._output(
                        rid,
                        live,
                        SIM_TOKEN_TEXT * n,
                        [SIM_TOKEN_ID] * n,
                        finish,
                        cached_tokens=cached.get(rid, 0) if cached else 0,
                    )
        except Exception as e:
            self._engine_failed(e)
            return
        self._next_step()

    def _engine_failed(self, e: BaseException) -> None:
        log.exception("simulated engine failed")
        self.fatal_error = e
        self._handle = None
