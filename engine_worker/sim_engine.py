"""SIMULATED engine: SimCore (engine_worker/sim_core.py) driven in real time.

No model runs: every token's text is the placeholder " tok" and prompt sizes
are estimated from characters.  It exists to load-test the dataplane without
an accelerator; it registers as engine "sim" and serves only "sim-..." models.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from shared.config import SimEngineConfig
from shared.protocol import Delta, GenerateRequest, RequestKind, WorkerStats

from .base import Emit, EngineInfo, bad_request
from .sim_core import SimCore

log = logging.getLogger(__name__)

SIM_TOKEN_TEXT = " tok"
_MAX_LAG_S = 0.02


def estimate_prompt_tokens(req: GenerateRequest) -> int:
    """~4 characters per token, plus a few template tokens per chat message."""
    if req.kind == RequestKind.CHAT:
        n = sum(len(m.content) // 4 + 4 for m in req.messages) + 2
    else:
        n = len(req.prompt) // 4
    return max(1, n)


class _Live:
    __slots__ = ("emit", "prompt_tokens", "completion_tokens")

    def __init__(self, emit: Emit, prompt_tokens: int):
        self.emit = emit
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0


class SimEngine:
    name = "sim"

    def __init__(self, cfg: SimEngineConfig, max_num_seqs: int, max_model_len: int) -> None:
        self.core = SimCore(cfg, max_num_seqs, max_model_len)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.fatal_error: Optional[BaseException] = None
        self._live: dict[str, _Live] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # The next step's start or end, scheduled on the loop; None when idle.
        # Callbacks rather than a task awaiting an Event: a few microseconds
        # less per step, which is the whole cost of a zero-cost engine.
        self._handle: asyncio.Handle | None = None
        self._deadline = 0.0  # when the step in flight ends (loop clock)
        self._aborts_total = 0
        self._finished_total = 0

    async def start(self) -> EngineInfo:
        self._loop = asyncio.get_running_loop()
        return EngineInfo(self.name, self.max_model_len, self.core.kv_capacity_tokens,
                          self.core.block_size, self.max_num_seqs)

    def submit(self, req: GenerateRequest, emit: Emit) -> None:
        rid = req.request_id
        if rid in self._live:
            log.warning("duplicate request id %s ignored", rid)
            return
        prompt_tokens = estimate_prompt_tokens(req)
        try:
            self.core.add(rid, prompt_tokens, req.params.max_tokens, req.priority)
        except ValueError as e:
            emit(bad_request(rid, str(e)))
            return
        self._live[rid] = _Live(emit, prompt_tokens)
        if self._handle is None and self.fatal_error is None and self._loop is not None:
            self._handle = self._loop.call_soon(self._begin)  # an idle engine starts next turn

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            live = self._live.pop(rid, None)
            if live is None:
                continue
            self.core.abort(rid)
            self._aborts_total += 1
            live.emit(Delta(rid, finish_reason="abort", prompt_tokens=live.prompt_tokens,
                            completion_tokens=live.completion_tokens))

    def stats(self) -> WorkerStats:
        c = self.core
        return WorkerStats(running=c.num_running, waiting=c.num_waiting, kv_usage=c.kv_usage,
                           preemptions_total=c.preemptions_total, aborts_total=self._aborts_total,
                           finished_total=self._finished_total)

    async def shutdown(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    # -- the step loop, as callbacks --------------------------------------------

    def _begin(self) -> None:
        self._deadline = self._loop.time()  # an idle engine starts its next step now
        self._next_step()

    def _next_step(self) -> None:
        core = self.core
        if not core.has_work:
            self._handle = None
            return
        try:
            result = core.step()
        except Exception as e:  # a bug, not a request's fault: let the worker exit and be restarted
            self._fail(e)
            return
        # Steps end on an absolute schedule so that timer rounding (uvloop
        # rounds to 1 ms) averages out instead of accumulating; if the loop
        # fell far behind, restart the schedule rather than burst to catch up.
        loop = self._loop
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

    def _end_step(self, result) -> None:
        live_map = self._live
        try:
            for rid, n, finish in result.outputs:
                live = live_map.get(rid)
                if live is None:  # aborted while the step "ran"
                    continue
                first = live.completion_tokens == 0
                live.completion_tokens += n
                d = Delta(rid, SIM_TOKEN_TEXT * n, n, finish, completion_tokens=live.completion_tokens)
                if first or finish:
                    d.prompt_tokens = live.prompt_tokens
                if finish:
                    del live_map[rid]
                    self._finished_total += 1
                live.emit(d)
        except Exception as e:
            self._fail(e)
            return
        self._next_step()

    def _fail(self, e: BaseException) -> None:
        log.exception("simulated engine failed")
        self.fatal_error = e
        self._handle = None
