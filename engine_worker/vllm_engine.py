"""The real engine: vLLM's AsyncLLM in this process (its EngineCore runs in a child process).

Imported only by workers that serve a vLLM model: importing vLLM takes seconds.
Set environment (HF_HUB_OFFLINE, VLLM_*) before importing this module.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from vllm import SamplingParams as VllmSamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.renderers.params import ChatParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from shared.protocol import Delta, GenerateRequest, RequestKind, WorkerStats

from .base import Emit, EngineInfo, bad_request, server_error

log = logging.getLogger(__name__)


class _SchedulerStats:
    """Latest scheduler numbers, written by vLLM's stat-logger hook once per engine step."""

    running = 0
    waiting = 0
    kv_usage = 0.0
    preemptions_total = 0


def _stats_sink(into: _SchedulerStats):
    class StatsSink(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                into.running = scheduler_stats.num_running_reqs
                into.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                into.kv_usage = scheduler_stats.kv_cache_usage
            if iteration_stats is not None:
                into.preemptions_total += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self):
            pass

    # A plain callable (not a StatLoggerBase subclass) is a per-engine factory.
    return lambda vllm_config, engine_index: StatsSink(vllm_config, engine_index)


class _Live:
    __slots__ = ("emit", "task", "prompt_tokens", "completion_tokens")

    def __init__(self, emit: Emit):
        self.emit = emit
        self.task: asyncio.Task | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0


class VllmEngine:
    name = "vllm"

    def __init__(self, model_path: str, model_name: str, *, max_model_len: int, max_num_seqs: int,
                 dtype: str, kv_cache_bytes: Optional[int], gpu_memory_utilization: float) -> None:
        self.args = AsyncEngineArgs(
            model=model_path,
            served_model_name=model_name,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            enforce_eager=True,
            scheduling_policy="priority",
            disable_log_stats=True,  # our stats sink still runs; vLLM's periodic logger doesn't
            **({"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes
               else {"gpu_memory_utilization": gpu_memory_utilization}),
        )
        self.engine: AsyncLLM | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._background: set[asyncio.Task] = set()  # keeps abort tasks referenced until done
        self.fatal_error: Optional[BaseException] = None
        self._sched = _SchedulerStats()
        self._live: dict[str, _Live] = {}
        self._aborts_total = 0
        self._finished_total = 0
        # As vLLM's OpenAI server does for chat: end the prompt with the assistant's turn.
        self._chat_params = ChatParams(chat_template_kwargs={"add_generation_prompt": True})

    async def start(self) -> EngineInfo:
        # Blocks the loop while the EngineCore loads (~16 s for the tiny model on
        # CPU); the worker has not connected to the router yet, so nothing waits.
        self._loop = asyncio.get_running_loop()
        self.engine = AsyncLLM.from_engine_args(self.args, stat_loggers=[_stats_sink(self._sched)])
        vc = self.engine.vllm_config
        cache = vc.cache_config
        # vLLM's BlockPool keeps one block as its "null block": usable KV is one block less.
        usable_tokens = (cache.num_gpu_blocks - 1) * cache.block_size
        return EngineInfo(self.name, vc.model_config.max_model_len, usable_tokens,
                          cache.block_size, vc.scheduler_config.max_num_seqs)

    def submit(self, req: GenerateRequest, emit: Emit) -> None:
        rid = req.request_id
        if rid in self._live:
            log.warning("duplicate request id %s ignored", rid)
            return
        live = self._live[rid] = _Live(emit)
        live.task = self._loop.create_task(self._generate(req, live))

    def abort(self, request_ids: list[str]) -> None:
        ids = []
        for rid in request_ids:
            live = self._live.pop(rid, None)
            if live is None:
                continue
            ids.append(rid)
            self._aborts_total += 1
            # Final Delta now: the router learns at once; whatever vLLM still
            # yields for this id is dropped by _generate (it is no longer live).
            live.emit(Delta(rid, finish_reason="abort", prompt_tokens=live.prompt_tokens,
                            completion_tokens=live.completion_tokens))
        if ids and self.engine is not None:
            task = self._loop.create_task(self._abort_in_engine(ids))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def stats(self) -> WorkerStats:
        s = self._sched
        live = len(self._live)
        # vLLM reports stats only on steps with output, so after the last request
        # finishes they would stay stale: when nothing is live, nothing runs.
        if live == 0:
            running = waiting = 0
            kv = 0.0
        else:
            running, waiting, kv = min(s.running, live), min(s.waiting, live), s.kv_usage
        return WorkerStats(running=running, waiting=waiting, kv_usage=kv, preemptions_total=s.preemptions_total,
                           aborts_total=self._aborts_total, finished_total=self._finished_total)

    async def shutdown(self) -> None:
        tasks = [live.task for live in self._live.values() if live.task is not None]
        self._live.clear()
        for t in tasks:
            t.cancel()
        if tasks:  # let them abort inside vLLM while it still runs
            await asyncio.wait(tasks, timeout=5)
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # -- internals ---------------------------------------------------------

    async def _abort_in_engine(self, ids: list[str]) -> None:
        try:
            await self.engine.abort(ids)
        except Exception:
            log.exception("vLLM abort failed")

    async def _render(self, req: GenerateRequest):
        """Prompt -> vLLM engine input (tokenized; validated against max_model_len)."""
        renderer = self.engine.renderer
        if req.kind == RequestKind.CHAT:
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            _, (engine_input,) = await renderer.render_chat_async([messages], self._chat_params)
        else:
            (engine_input,) = await renderer.render_cmpl_async([{"prompt": req.prompt}])
        return engine_input

    async def _generate(self, req: GenerateRequest, live: _Live) -> None:
        rid = req.request_id
        p = req.params
        try:
            engine_input = await self._render(req)
            if self._live.get(rid) is not live:
                return  # aborted while rendering
            params = VllmSamplingParams(
                max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                stop=list(p.stop) or None, ignore_eos=p.ignore_eos, output_kind=RequestOutputKind.DELTA,
                presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            )
            outputs = self.engine.generate(engine_input, params, rid, priority=req.priority)
            try:
                async for out in outputs:
                    if self._live.get(rid) is not live:
                        break  # aborted: closing the generator aborts it inside vLLM too
                    self._on_output(rid, live, out)
                    if out.finished:
                        return
            finally:
                await outputs.aclose()
        except asyncio.CancelledError:
            raise
        except (VLLMClientError, ValueError, TypeError) as e:
            self._fail(rid, live, bad_request(rid, _message(e), getattr(e, "parameter", None)))
        except EngineDeadError as e:
            self.fatal_error = e
            self._fail(rid, live, server_error(rid, "The inference engine stopped; please retry.", 503))
        except Exception as e:
            log.exception("request %s failed", rid)
            self._fail(rid, live, server_error(rid, f"Internal error in the engine: {type(e).__name__}"))
            if self.engine is not None and self.engine.errored:
                self.fatal_error = e
        else:
            # Stream ended without a finished output (should not happen): still end it once.
            if self._live.get(rid) is live:
                self._fail(rid, live, server_error(rid, "The engine ended the request without a result."))

    def _on_output(self, rid: str, live: _Live, out) -> None:
        c = out.outputs[0]
        n = len(c.token_ids)
        first = live.completion_tokens == 0 and live.prompt_tokens == 0
        live.completion_tokens += n
        d = Delta(rid, c.text, n, completion_tokens=live.completion_tokens)
        if first:
            live.prompt_tokens = len(out.prompt_token_ids or ())
            d.prompt_tokens = live.prompt_tokens
        if out.finished:
            del self._live[rid]
            reason = c.finish_reason or "stop"
            if reason == "error":
                d.error = server_error(rid, "The engine failed this request; please retry.", 503).error
            else:
                d.finish_reason = reason if reason in ("stop", "length", "abort") else "stop"
                d.prompt_tokens = live.prompt_tokens
                self._finished_total += 1
        live.emit(d)

    def _fail(self, rid: str, live: _Live, delta: Delta) -> None:
        if self._live.get(rid) is live:
            del self._live[rid]
            live.emit(delta)


def _message(e: BaseException) -> str:
    # VLLMValidationError's str() appends "(parameter=..., value=...)"; the
    # OpenAI-style error carries the parameter separately.
    if isinstance(e, VLLMValidationError):
        return Exception.__str__(e)
    return str(e)
