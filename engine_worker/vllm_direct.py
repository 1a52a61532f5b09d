"""vLLM's AsyncLLM with weir's output handler: each engine step's outputs go
straight to their requests' sinks, with no task per request and no per-token
latency statistics.

AsyncLLM's own handler puts every request's output of a step into that
request's collector and wakes the request's ``generate()`` task, which then
yields it to its caller; it also builds vLLM's IterationStats (per-token TTFT
and inter-token latencies for vLLM's metrics).  In the worker that was ~1/3 of
its CPU under load (py-spy, 20 req/s on the tiny model: the task wake-ups,
``AsyncLLM.generate`` and ``IterationStats.update_from_output``), and weir
reads neither: the worker forwards each step's tokens in one message to the
router, which measures latency itself.

So this handler runs vLLM's own steps -- ``process_outputs`` (detokenizing,
stop strings, n > 1 merging), aborts for stop strings, scheduler stats --
and then hands each collector registered in ``sinks`` its merged output
directly.  Collectors not registered (``encode()``, a pooling worker's path)
are served as vLLM serves them: their task waits on the collector.

Written against vLLM 0.32's ``AsyncLLM._run_output_handler``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import vllm.envs as envs
from vllm.v1.engine import EngineCoreEventType
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.output_processor import RequestOutputCollector

log = logging.getLogger(__name__)

Sink = Callable[[Any], None]  # gets a request's RequestOutput of one step


class Hooks:
    """What the handler reports beyond outputs (set by the engine once started)."""

    def on_step(self, scheduler_stats: Any, preempted: int) -> None:
        """Once per engine step: vLLM's SchedulerStats (or None) and the
        number of requests it preempted in that step."""

    def on_error(self, e: BaseException) -> None:
        """The handler stopped (the EngineCore died or vLLM failed): every
        registered request is over."""


class DirectAsyncLLM(AsyncLLM):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set before AsyncLLM's __init__: it starts the handler when a loop runs.
        self.sinks: dict[RequestOutputCollector, Sink] = {}
        self._hooks = [Hooks()]  # a cell: the running handler sees set_hooks()
        super().__init__(*args, **kwargs)
        # No per-request RequestStateStats either: nothing reads them.
        self.output_processor.log_stats = False

    def set_hooks(self, hooks: Hooks) -> None:
        self._hooks[0] = hooks

    def _run_output_handler(self) -> None:
        if getattr(self, "output_handler", None) is not None:
            return
        # Locals only, as in AsyncLLM: the task must not hold the engine alive.
        engine_core = self.engine_core
        output_processor = self.output_processor
        states = output_processor.request_states
        sinks = self.sinks
        hooks = self._hooks
        mm_cache = self.renderer.mm_processor_cache
        chunk_size = envs.VLLM_V1_OUTPUT_PROC_CHUNK_SIZE
        preempted_event = EngineCoreEventType.PREEMPTED

        async def output_handler() -> None:
            try:
                while True:
                    outputs = await engine_core.get_output_async()
                    step = outputs.outputs
                    preempted = 0
                    for start in range(0, len(step), chunk_size):
                        end = start + chunk_size
                        part = step[start:end]
                        # The collectors to serve, looked up before processing:
                        # a finished request leaves ``states`` in it.
                        touched: dict[RequestOutputCollector, Sink] = {}
                        for eco in part:
                            state = states.get(eco.request_id)
                            if state is not None and (sink := sinks.get(state.queue)) is not None:
                                touched[state.queue] = sink
                            if eco.events:
                                preempted += sum(1 for ev in eco.events if ev.type == preempted_event)
                        processed = output_processor.process_outputs(
                            part, outputs.timestamp, None, weight_version=outputs.weight_version
                        )
                        if mm_cache is not None:
                            for eco in part:
                                for mm_hash in eco.mm_cache_miss_hashes or ():
                                    mm_cache.invalidate(mm_hash)
                        for queue, sink in touched.items():
                            try:
                                out = queue.get_nowait()
                                if out is not None:
                                    sink(out)
                            except Exception:  # one request's fault must not stop every stream
                                log.exception("delivering a vLLM output failed")
                        if end < len(step):
                            await asyncio.sleep(0)  # other tasks run between chunks
                        if processed.reqs_to_abort:  # ended by a stop string
                            await engine_core.abort_requests_async(processed.reqs_to_abort)
                    output_processor.update_scheduler_stats(outputs.scheduler_stats)
                    hooks[0].on_step(outputs.scheduler_stats, preempted)
            except Exception as e:
                log.exception("vLLM output handler failed")
                output_processor.propagate_error(e)  # encode() tasks raise it
                hooks[0].on_error(e)

        self.output_handler = asyncio.create_task(output_handler())
