"""The real engine: vLLM's AsyncLLM in this process (its EngineCore runs in a child process).

Prompts arrive as token ids (the router rendered and tokenized them once)
and go in through vLLM's own token-prompt path, which still checks them
against the context; output ids come back in every Delta.

weir's SamplingParams map 1:1 onto vLLM's (n, logprobs, top_k, min_p,
repetition_penalty, min_tokens, stop_token_ids, logit_bias, structured
outputs with vLLM's default backend).  n > 1 is vLLM's own fan-out (one
parent request, n children): each child's output goes out with its index.
Logprobs leave as ``Delta.logprobs`` / ``top_ids`` (shared.protocol).

Imported only by workers that serve a vLLM model: importing vLLM takes seconds.
Set environment (HF_HUB_OFFLINE, VLLM_*) before importing this module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

from vllm import SamplingParams as VllmSamplingParams
from vllm.config.kv_events import KVEventsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.envs import enable_envs_cache
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import PrometheusStatLogger

from shared.config import LoraConfig, TracingConfig
from shared.otlp import traceparent
from shared.protocol import ErrorInfo, GenerateRequest, SamplingParams, WorkerStats, pack_logprobs

from .base import EngineBase, EngineInfo, Live, bad_request, engine_error
from .lora import engine_args as lora_args
from .lora import lora_request, refuse_prompt_logprobs
from .lora_cache import LoraCache
from .vllm_direct import DirectAsyncLLM, Hooks

log = logging.getLogger(__name__)

# A prefix-cache reset (after lost KV events) waits for a moment when no block
# is in use: asked again every RESET_RETRY_S, for up to ~10 minutes.
RESET_RETRY_S = 0.5
RESET_ATTEMPTS = 1200


class _SchedulerStats(Hooks):
    """Latest scheduler numbers, from vLLM's per-step SchedulerStats (DirectAsyncLLM's hooks)."""

    running = 0
    waiting = 0
    kv_usage = 0.0
    preemptions_total = 0

    def __init__(self, on_error: Callable[[BaseException], None]) -> None:
        self._on_error = on_error

    def on_error(self, e: BaseException) -> None:
        self._on_error(e)

    def on_step(self, scheduler_stats: Any, preempted: int) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.kv_usage = scheduler_stats.kv_cache_usage
        self.preemptions_total += preempted


class _StatsOn(PrometheusStatLogger):  # type: ignore[misc]  # vLLM is read as Any (pyproject: follow_imports)
    """A stat logger that records nothing, handed to AsyncLLM so that vLLM's
    EngineCore sends its per-step scheduler stats (the heartbeat's running,
    waiting and KV use) and AsyncLLM adds no Prometheus logger of its own.

    A ``PrometheusStatLogger`` subclass because AsyncLLM adds vLLM's Prometheus
    logger unless one of the loggers it is given is one: its per-step updates
    were ~4 %% of the worker's CPU samples (py-spy, 20 req/s on the tiny model),
    and the worker serves no vLLM metrics.  Its ``__init__`` is not called: it
    would register every vLLM series.  DirectAsyncLLM's handler reads the
    stats itself and never calls a logger."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = engine_indexes or [0]

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass


class VllmEngine(EngineBase):
    name = "vllm"

    def __init__(
        self,
        model_path: str,
        model_name: str,
        *,
        max_model_len: int,
        max_num_seqs: int,
        dtype: str,
        kv_cache_bytes: int | None,
        gpu_memory_utilization: float,
        tracing: TracingConfig | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        super().__init__()
        self.lora = lora
        self.lora_cache = LoraCache(lora.max_loras, lora.max_cpu_loras) if lora is not None else None
        self._lora_on_cpu = lora is not None and current_platform.is_cpu()
        # Prefix caching on, and its KV events on per-worker ipc sockets that
        # this worker consumes (engine_worker.vllm_events): nothing to open
        # beyond the host, no port to pick per engine.
        self._kv_dir = tempfile.mkdtemp(prefix="weir-kv-")
        self._kv_pub = "ipc://" + os.path.join(self._kv_dir, "pub")
        self._kv_replay = "ipc://" + os.path.join(self._kv_dir, "replay")
        self.args = AsyncEngineArgs(
            model=model_path,
            served_model_name=model_name,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            enforce_eager=True,
            scheduling_policy="priority",
            disable_log_stats=True,  # our stats sink still runs; vLLM's periodic logger doesn't
            enable_prefix_caching=True,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self._kv_pub,
                replay_endpoint=self._kv_replay,
                topic="kv",
            ),
            **lora_args(lora),
            **(
                {"kv_cache_memory_bytes": kv_cache_bytes}
                if kv_cache_bytes
                else {"gpu_memory_utilization": gpu_memory_utilization}
            ),
        )
        # [tracing]: vLLM's own request span (``llm_request``) under the worker's
        # (engine_worker.tracing), from each traced request's trace_headers.
        self._traced = tracing is not None
        if tracing is not None:
            self.args.otlp_traces_endpoint = (
                tracing.endpoint if tracing.protocol == "grpc" else f"http://{tracing.endpoint}/v1/traces"
            )
            os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "grpc" if tracing.protocol == "grpc" else "http/protobuf"
            os.environ["OTEL_SERVICE_NAME"] = tracing.engine_service
        self.engine: DirectAsyncLLM | None = None
        self._loop: asyncio.AbstractEventLoop  # the worker's, from start() on
        self._background: set[asyncio.Task[None]] = set()  # keeps abort tasks referenced until done
        self._resetting: asyncio.Task[None] | None = None  # a prefix-cache reset waiting for an idle cache
        self._sched = _SchedulerStats(self._engine_failed)
        self._aborted: list[str] = []  # engine ids to abort inside vLLM, batched per loop turn
        self._attempts = 0  # numbers each dispatch's engine id

    async def start(self) -> EngineInfo:
        # Blocks the loop while the EngineCore loads (~16 s for the tiny model on
        # CPU); the worker has not connected to the router yet, or (a restart
        # after the EngineCore died) has told its routers to send it nothing.
        self._loop = asyncio.get_running_loop()
        os.makedirs(self._kv_dir, exist_ok=True)  # (a restart: shutdown removed it)
        if self.lora is not None:  # (a restarted engine holds no adapter)
            self.lora_cache = LoraCache(self.lora.max_loras, self.lora.max_cpu_loras)
        self._aborted = []
        self.engine = DirectAsyncLLM.from_engine_args(self.args, stat_loggers=[_StatsOn])
        self.engine.set_hooks(self._sched)
        # vLLM reads its settings from the environment on every access (~5 %% of
        # the worker's CPU samples under load, most per token); its EngineCore
        # caches them once started, and so does this process from here on.
        enable_envs_cache()
        vc = self.engine.vllm_config
        cache = vc.cache_config
        # vLLM's BlockPool keeps one block as its "null block": usable KV is one block less.
        usable_tokens = (cache.num_gpu_blocks - 1) * cache.block_size
        from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

        caching = bool(cache.enable_prefix_caching)
        return EngineInfo(
            self.name,
            vc.model_config.max_model_len,
            usable_tokens,
            cache.block_size,
            vc.scheduler_config.max_num_seqs,
            prefix_caching=caching,
            prefix_hash=cache.prefix_caching_hash_algo if caching else "",
            # (as the EngineCore resolves it: vLLM's resolve_none_hash_seed)
            # (set but empty is a seed too: vLLM tests ``is not None``)
            prefix_hash_seed=(
                DEFAULT_NONE_HASH_SEED if os.environ.get("PYTHONHASHSEED") is None else os.environ["PYTHONHASHSEED"]
            ),
            kv_events_endpoint=self._kv_pub if caching else "",
            kv_events_replay=self._kv_replay if caching else "",
        )

    def reset_prefix_cache(self) -> None:
        """Empty the engine's prefix cache (its AllBlocksCleared follows at
        the next step): how a worker that lost its events knows them again."""
        if self.engine is not None and (self._resetting is None or self._resetting.done()):
            # (one at a time: a second gap while one waits for an idle cache needs no second)
            task = self._resetting = self._loop.create_task(self._reset_prefix_cache())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _reset_prefix_cache(self) -> None:
        # vLLM refuses (False) while any block is in use, i.e. while anything
        # runs -- and gaps come under load: ask again until it takes.
        for attempt in range(RESET_ATTEMPTS):
            if self.engine is None:
                return
            try:
                if await self.engine.reset_prefix_cache():
                    return
            except Exception as e:  # noqa: BLE001 -- an engine shutting down; try again or stop
                log.warning("vLLM prefix cache reset failed: %r", e)
            if attempt == 0:
                log.info("vLLM prefix cache in use; resetting it once nothing runs")
            await asyncio.sleep(RESET_RETRY_S)
        log.warning("vLLM prefix cache never idle for a reset: this worker stays routed cache-blind")

    def _start(self, req: GenerateRequest, live: Live) -> None:
        # The router may send a request id again to this worker right after
        # aborting it (a stalled job moved, and this is the only worker of its
        # model): vLLM aborts by id, so the earlier attempt's abort (batched)
        # must not hit the new attempt.
        self._attempts += 1
        live.engine_id = f"{req.request_id}#{self._attempts}"
        live.handle = self._loop.create_task(self._add(req, live))

    def _stop(self, rid: str, live: Live) -> None:
        # Its final Delta goes out now (EngineBase.abort); whatever vLLM still
        # has for it goes nowhere: its sink leaves with it.
        self._drop_sink(live)
        self._abort_later(live.engine_id)

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
        return WorkerStats(
            running=running,
            waiting=waiting,
            kv_usage=kv,
            preemptions_total=s.preemptions_total,
            aborts_total=self.aborts_total,
            finished_total=self.finished_total,
            loras=self.lora_cache.held() if self.lora_cache is not None else None,
        )

    async def shutdown(self) -> None:
        live = list(self._live.values())
        self._live.clear()
        adding = [x.handle for x in live if x.handle is not None and not x.handle.done()]
        for t in adding:
            t.cancel()
        if self.engine is not None:
            self.engine.sinks.clear()
            ids = [x.engine_id for x in live if x.engine_id]
            if ids:  # abort them inside vLLM while it still runs
                try:
                    await asyncio.wait_for(self.engine.abort(ids), timeout=5)
                except Exception:  # noqa: BLE001 -- shutting down: the engine goes next anyway
                    log.warning("aborting %d requests at shutdown failed", len(ids))
            self.engine.shutdown()
            self.engine = None
        shutil.rmtree(self._kv_dir, ignore_errors=True)

    # -- internals ---------------------------------------------------------

    def _abort_later(self, engine_id: str) -> None:
        """Abort inside vLLM, batched with the other aborts of this loop turn."""
        if self.fatal_error is not None:
            return  # nothing runs inside a dead engine
        self._aborted.append(engine_id)
        if len(self._aborted) == 1 and self.engine is not None:
            self._loop.call_soon(self._abort_in_engine)

    def _engine_failed(self, e: BaseException) -> None:
        """DirectAsyncLLM's handler stopped: no output comes any more, and the
        worker exits to be restarted (its next heartbeat tick sees
        ``fatal_error``).  If the EngineCore died, the generating requests stay
        live and the worker is told (``_died``): it reports them lost to their
        routers, which resume them elsewhere as a lost worker's (bounded by
        ``router.max_resumes``), and starts the engine again.  Any other
        failure is vLLM's own, which a resumed request could meet again:
        those end now with an internal error, and the worker exits."""
        if isinstance(e, EngineDeadError) and self._died(e):
            if self.engine is not None:
                self.engine.sinks.clear()
            return
        self.fatal_error = e
        if not isinstance(e, EngineDeadError):
            err = _engine_stopped(e)
            for rid, live in list(self._live.items()):
                if live.outputs is not None:
                    self._fail(rid, live, err)
        if self.engine is not None:
            self.engine.sinks.clear()

    def _abort_in_engine(self) -> None:
        ids, self._aborted = self._aborted, []
        if ids and self.engine is not None:
            task = self._loop.create_task(self._abort_ids(ids))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _abort_ids(self, ids: list[str]) -> None:
        engine = self.engine
        if engine is None:
            return  # shut down meanwhile: nothing runs to abort
        try:
            await engine.abort(ids)
        except Exception:
            log.exception("vLLM abort failed")

    async def _render(self, req: GenerateRequest) -> tuple[Any, Any]:
        """The engine and the request's prompt as vLLM's token-prompt path
        renders it (checks the ids against the context, no tokenizing)."""
        engine = self.engine
        assert engine is not None, "requests run between start() and shutdown()"
        if not req.prompt_token_ids:
            raise ValueError("the request carries no prompt token ids (the router has no tokenizer for this model)")
        (engine_input,) = await engine.renderer.render_cmpl_async([{"prompt_token_ids": req.prompt_token_ids}])
        return engine, engine_input

    async def _add(self, req: GenerateRequest, live: Live) -> None:
        """Hand the request to vLLM; its outputs then come to ``_deliver``
        from DirectAsyncLLM's handler, once per engine step."""
        rid = req.request_id
        try:
            refuse_prompt_logprobs(req.params.prompt_logprobs, self._lora_on_cpu)
            engine, engine_input = await self._render(req)
            if not self._is_live(rid, live):
                return  # aborted meanwhile
            ctx = req.trace_context if self._traced else None
            if req.lora is not None and self.lora_cache is not None:
                self.lora_cache.touch(req.lora.lora_id)
            outputs = await engine.add_request(
                live.engine_id,
                engine_input,
                vllm_params(req.params),
                priority=req.priority,
                trace_headers=None if ctx is None else {"traceparent": traceparent(ctx)},
                lora_request=lora_request(req.lora, self.lora is not None),
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._failed(rid, live, e)
            return
        finally:
            live.handle = None
        if not self._is_live(rid, live):
            # Aborted while vLLM took it: that abort found nothing to abort.
            self._abort_later(live.engine_id)
            return
        live.outputs = outputs
        p = req.params
        engine.sinks[outputs] = partial(self._deliver, rid, live, p.logprobs, p.n, p.prompt_logprobs)
        early = outputs.get_nowait()  # a step that ran before the sink was in place
        if early is not None:
            self._deliver(rid, live, p.logprobs, p.n, p.prompt_logprobs, early)

    def _deliver(self, rid: str, live: Live, k: int | None, n: int, pk: int | None, out: Any) -> None:
        """One engine step's output of a request (all of its choices that moved)."""
        if not self._is_live(rid, live):
            return  # aborted: its sink is on its way out
        prompt_tokens = len(out.prompt_token_ids or ())
        cached = out.num_cached_tokens or 0
        prompt_lps = _prompt_logprobs(out, pk)  # with the attempt's first output only (vLLM's DELTA mode)
        for c in out.outputs:
            if c.finish_reason in ("error", "abort"):
                # Not our abort (that one left the live table): vLLM gave up
                # on it -- an error, never an empty "stop".
                self._drop_sink(live)
                self._fail(
                    rid,
                    live,
                    engine_error(
                        f"The engine {_GAVE_UP[c.finish_reason]} this request; please retry.", unavailable=True
                    ),
                )
                return
            finish = c.finish_reason
            if finish is None and out.finished and n == 1:
                finish = "stop"
            ids = list(c.token_ids)
            stop_reason = c.stop_reason if finish is not None else None
            values, top = (b"", None) if k is None or not ids else _pack(c.logprobs, ids, k)
            self._output(
                rid,
                live,
                c.text,
                ids,
                finish,
                prompt_tokens,
                c.index,
                values,
                top,
                cached_tokens=cached,
                stop_reason=stop_reason,
                prompt_logprobs=prompt_lps,
            )
            prompt_lps = None
        if out.finished:
            self._drop_sink(live)
            if self._is_live(rid, live):  # a choice vLLM never ended (should not happen)
                self._fail(rid, live, engine_error("The engine ended the request without ending all of its choices."))

    def _drop_sink(self, live: Live) -> None:
        if self.engine is not None and live.outputs is not None:
            self.engine.sinks.pop(live.outputs, None)

    def _failed(self, rid: str, live: Live, e: Exception) -> None:
        """A request's end when vLLM raised: a 400 for what it refused, lost
        if the engine died (``_died``: it runs again elsewhere), else an
        internal error."""
        if isinstance(e, (VLLMClientError, ValueError, TypeError)):
            self._fail(rid, live, bad_request(_message(e), getattr(e, "parameter", None)))
        elif isinstance(e, EngineDeadError):
            if not self._died(e):  # else the worker reports it lost with the rest
                self._fail(rid, live, _engine_stopped(e))
        else:
            log.exception("request %s failed", rid, exc_info=e)
            self._fail(rid, live, _engine_stopped(e))
            if self.engine is not None and self.engine.errored:
                self.fatal_error = e


_GAVE_UP = {"error": "failed", "abort": "aborted"}


def _engine_stopped(e: BaseException) -> ErrorInfo:
    """What a request gets when the engine failed under it: 503 (retry) if
    its EngineCore died, else an internal error naming the exception."""
    if isinstance(e, EngineDeadError):
        return engine_error("The inference engine stopped; please retry.", unavailable=True)
    return engine_error(f"Internal error in the engine: {type(e).__name__}")


@lru_cache(maxsize=256)
def compact_json_grammar(schema: str) -> str:
    """A JSON schema as an xgrammar EBNF grammar with no free whitespace:
    vLLM 0.32 takes ``disable_any_whitespace`` only server-wide
    (``--structured-outputs-config``), so a request that asks for it gets
    the equivalent grammar (~0.2 ms, cached).  (xgrammar 0.2.8 still writes
    ", " inside free-form values such as ``additionalProperties``: a fixed
    space, never a choice.)"""
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":")))


def vllm_params(p: SamplingParams) -> VllmSamplingParams:
    so = p.structured
    structured = None
    if so is not None:
        json_schema, grammar = so.json, so.grammar
        if so.disable_any_whitespace and (json_schema is not None or so.json_object):
            grammar = compact_json_grammar(json_schema if json_schema is not None else '{"type": "object"}')
            json_schema = None
        structured = StructuredOutputsParams(
            json=json_schema,
            regex=so.regex,
            choice=list(so.choice) or None,
            grammar=grammar,
            json_object=True if so.json_object and grammar is None else None,
            structural_tag=so.structural_tag,
        )
    return VllmSamplingParams(
        n=p.n,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        seed=p.seed,
        stop=list(p.stop) or None,
        ignore_eos=p.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        min_tokens=p.min_tokens,
        stop_token_ids=list(p.stop_token_ids) or None,
        logit_bias=dict(p.logit_bias) or None,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        structured_outputs=structured,
    )


def _prompt_logprobs(out: Any, k: int | None) -> tuple[bytes, list[int]] | None:
    """vLLM's prompt logprobs (None for the first token, then {id: Logprob}
    per position) -> Delta.prompt_logprobs and prompt_top_ids."""
    rows = out.prompt_logprobs
    ids = list(out.prompt_token_ids or ())
    if k is None or not rows or len(rows) != len(ids):
        return None
    values, top = _pack(rows[1:], ids[1:], k)
    return values, ids + top


def _pack(logprobs: Any, ids: list[int], k: int) -> tuple[bytes, list[int]]:
    """vLLM's per-token {id: Logprob} (the sampled token plus the top k, by
    rank) -> Delta.logprobs ([sampled, top-1..top-k] per token) and top_ids."""
    values: list[float] = []
    top: list[int] = []
    for tid, pos in zip(ids, logprobs or ()):
        chosen = pos.get(tid)
        values.append(chosen.logprob if chosen is not None else float("-inf"))
        if k:
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in pos.items() if lp.rank is not None and lp.rank <= k)
            ranked = ranked[:k]
            while len(ranked) < k:  # never seen: vLLM returns exactly k; keep rows aligned anyway
                ranked.append((k, tid, values[-1]))
            for _, t, lp in ranked:
                top.append(t)
                values.append(lp)
    return pack_logprobs(values), top


def _message(e: BaseException) -> str:
    # VLLMValidationError's str() appends "(parameter=..., value=...)"; the
    # OpenAI-style error carries the parameter separately.
    if isinstance(e, VLLMValidationError):
        return Exception.__str__(e)
    return str(e)
