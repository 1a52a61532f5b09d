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

It also reads the EngineCore's output socket itself (``EngineOutputs``)
instead of through vLLM's reader task: that task awaits pyzmq's asyncio
``recv_multipart`` (a Future, its bookkeeping and a reader callback per
message) and hands every step over through an ``asyncio.Queue`` to this
handler, another task switch.  py-spy of the worker at 5 req/s on the tiny
model had ~20 % of the process's samples in that receive path.

Written against vLLM 0.32's ``AsyncLLM._run_output_handler`` and
``AsyncMPClient._ensure_output_queue_task``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import vllm.envs as envs
import zmq
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutputs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import AsyncMPClient, _process_utility_output
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.output_processor import RequestOutputCollector
from vllm.v1.metrics.stats import IterationStats

log = logging.getLogger(__name__)

Sink = Callable[[Any], None]  # gets a request's RequestOutput of one step

_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class EngineOutputs:
    """The EngineCore's output socket read on the loop: a non-blocking
    ``recv`` while ``ZMQ_EVENTS`` says a message waits, else one Future woken
    by the socket's FD.  What vLLM's reader task does with a message is done
    here too: the engine's death sentinel, utility results to their callers,
    and steps without outputs or stats dropped.

    The socket stays vLLM's: it is closed by vLLM's shutdown, which also
    cancels ``resources.output_queue_task`` -- set to the handler that reads
    here, so a dead engine (vLLM's monitor thread shuts the client down)
    ends that handler as it ended vLLM's reader."""

    def __init__(self, client: AsyncMPClient, loop: asyncio.AbstractEventLoop) -> None:
        resources = client.resources
        self._owner = resources.output_socket  # the zmq.asyncio socket vLLM closes
        assert self._owner is not None
        self._sock: zmq.Socket[bytes] = zmq.Socket.shadow(self._owner.underlying)
        self._fd = self._sock.FD
        self._resources = resources
        self._decoder = client.decoder
        self._utility_results = client.utility_results
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None
        loop.add_reader(self._fd, self._wake)

    def _wake(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self) -> EngineCoreOutputs:
        sock = self._sock
        events = cast("Callable[[int], int]", sock.get)  # an int option (pyzmq types it int | bytes)
        yielded = False
        while True:
            if self._owner.closed:  # shut down under us (the shadow must not be touched then)
                raise EngineDeadError()
            if not events(_EVENTS) & _POLLIN:
                self._waiter = waiter = self._loop.create_future()
                await waiter
                yielded = True
                continue
            if not yielded:
                # A step waits already: still give the loop its turn first (the
                # outbox flushes the last step, the routers' messages are read).
                # Without it an engine that keeps one step ahead starved the
                # loop: the worker heard no heartbeat for 3 s.
                await asyncio.sleep(0)
                yielded = True
                continue
            frames = sock.recv_multipart(_NOBLOCK, copy=False)
            self._resources.validate_alive(frames)  # raises EngineDeadError on the sentinel
            outputs: EngineCoreOutputs = self._decoder.decode(frames)
            if outputs.utility_output:
                _process_utility_output(outputs.utility_output, self._utility_results)
            elif outputs.outputs or outputs.scheduler_stats:
                return outputs

    def close(self) -> None:
        self._wake()
        self._loop.remove_reader(self._fd)


def _take_over_reader(engine_core: Any, loop: asyncio.AbstractEventLoop) -> EngineOutputs | None:
    """An ``EngineOutputs`` in place of vLLM's reader task, if that task has
    not run yet (so no message is in its queue) and the client is the plain
    single-engine one (no data-parallel or fault-tolerance messages to route)."""
    if type(engine_core) is not AsyncMPClient:
        return None
    if engine_core.vllm_config.parallel_config.enable_fault_tolerance:
        return None
    task = engine_core.resources.output_queue_task
    if task is None or inspect.getcoroutinestate(task.get_coro()) != inspect.CORO_CREATED:
        return None
    task.cancel()  # cancelled before its first step: its body never runs
    return EngineOutputs(engine_core, loop)


class Hooks:
    """What the handler reports beyond outputs (set by the engine once started)."""

    def on_step(self, scheduler_stats: Any, preempted: int) -> None:
        """Once per engine step: vLLM's SchedulerStats (or None) and the
        number of requests it preempted in that step."""

    def on_error(self, e: BaseException) -> None:
        """The handler stopped (the EngineCore died or vLLM failed): every
        registered request is over."""


class DirectAsyncLLM(AsyncLLM):  # type: ignore[misc]  # vLLM is read as Any (pyproject: follow_imports)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set before AsyncLLM's __init__: it starts the handler when a loop runs.
        self.sinks: dict[RequestOutputCollector, Sink] = {}
        self._hooks = [Hooks()]  # a cell: the running handler sees set_hooks()
        super().__init__(*args, **kwargs)
        # No per-request RequestStateStats either: nothing reads them -- but
        # vLLM's request spans ([tracing]: engine_worker.tracing), built from them.
        self.output_processor.log_stats = self.output_processor.tracing_enabled

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
        tracing = output_processor.tracing_enabled
        preempted_event = EngineCoreEventType.PREEMPTED
        reader = _take_over_reader(engine_core, asyncio.get_running_loop())
        next_outputs: Callable[[], Awaitable[EngineCoreOutputs]] = (
            engine_core.get_output_async if reader is None else reader.next
        )

        async def output_handler() -> None:
            try:
                while True:
                    outputs = await next_outputs()
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
                            part,
                            outputs.timestamp,
                            IterationStats() if tracing else None,  # (vLLM's spans read it)
                            weight_version=outputs.weight_version,
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
            except asyncio.CancelledError:
                if reader is None:
                    raise  # AsyncLLM.shutdown: vLLM's reader told the rest
                # vLLM's shutdown (its own, or its monitor's on the engine's
                # death) cancels what reads its socket: tell as vLLM's reader would.
                e = EngineDeadError()
                output_processor.propagate_error(e)
                hooks[0].on_error(e)
            except Exception as e:
                log.exception("vLLM output handler failed")
                output_processor.propagate_error(e)  # encode() tasks raise it
                hooks[0].on_error(e)
            finally:
                if reader is not None:
                    reader.close()

        self.output_handler = task = asyncio.create_task(output_handler())
        if reader is not None:
            engine_core.resources.output_queue_task = task
