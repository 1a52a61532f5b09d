"""The one interface the worker process drives, and the live-request table both engines share.

``EngineBase`` owns the worker process's only table of live requests (after
vLLM's ``output_processor``: one table of request state) and is the only
place a Delta leaves an engine, so every request gets exactly one final
Delta -- finished, errored or aborted -- however its end races: an abort
after the last step, an output after an abort, a duplicate dispatch.
Engines implement ``_start`` (begin generating) and ``_stop`` (drop a
request inside the engine) and report through ``_output``.

A request with n > 1 choices reports each choice's tokens with its
``index``; a choice that ends while others go on says so in
``choice_finish``, and the last choice to end carries the request's one
final Delta -- so "exactly one final Delta" holds for any n.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from shared.errors import Code, error
from shared.protocol import Delta, ErrorInfo, GenerateRequest, WorkerStats

from .prefix_feed import PrefixFeed

log = logging.getLogger(__name__)

Emit = Callable[[Delta], None]
_FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class EngineInfo:
    """What the running engine really has (read after start-up, not from config)."""

    engine: str  # "vllm" | "sim"
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    max_num_seqs: int
    step_time_s: float = 0.0  # a full batch's step (0: unknown)
    request_overhead_s: float = 0.0  # per newly admitted request (0: unknown)
    prefix_caching: bool = False  # n sequences share their prompt's KV blocks
    prefix_hash: str = ""  # the engine reports its cache (PrefixFeed) with this block hash scheme
    prefix_hash_seed: str = ""
    kv_events_endpoint: str = ""  # vLLM: its KV event publisher (engine_worker.vllm_events)
    kv_events_replay: str = ""
    embeds: bool = False  # a pooling model: it serves embedding requests (GenerateRequest.embed) only


class Live:
    """One live request: where its Deltas go and what it has produced."""

    __slots__ = (
        "emit",
        "prompt_tokens",
        "completion_tokens",
        "sent",
        "handle",
        "open",
        "engine_id",
        "cached",
        "outputs",
    )

    def __init__(self, emit: Emit, prompt_tokens: int, n: int = 1) -> None:
        self.emit = emit
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0  # all choices together
        self.open = n  # choices not ended yet
        self.sent = False  # a Delta went out (the first carries prompt_tokens)
        self.handle: asyncio.Task[None] | None = None  # the engine's own (vLLM: its task)
        self.engine_id = ""  # the engine's id for this attempt (vLLM: unique per dispatch)
        self.cached = 0  # prompt tokens found in the prefix cache (engine's count)
        self.outputs: object = None  # where the engine puts its outputs (vLLM: the request's collector)


class EngineBase:
    name = "engine"

    def __init__(self) -> None:
        # Set when the engine can no longer serve (e.g. vLLM's EngineCore died);
        # the worker then says Goodbye and exits non-zero so it is restarted --
        # unless the engine died in a way ``_died`` reports (the worker then
        # reports the live requests Lost and starts the engine again).
        self.fatal_error: BaseException | None = None
        self.on_died: Callable[[], None] | None = None  # the worker's, for ``_died``
        self._live: dict[str, Live] = {}
        self.aborts_total = 0
        self.finished_total = 0
        self.tokens_total = 0  # generated, all requests (the heartbeat's WorkerStats.tokens_total)
        # Where the engine reports what its prefix cache holds (set by the worker).
        self.kv_feed: PrefixFeed | None = None

    # -- what the worker calls ---------------------------------------------------

    async def start(self) -> EngineInfo:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError

    def stats(self) -> WorkerStats:
        raise NotImplementedError

    def submit(self, req: GenerateRequest, emit: Emit) -> None:
        """Non-blocking.  ``emit`` gets the request's Deltas as they come, the
        last one ``finished`` -- exactly one such.  A duplicate id is ignored."""
        rid = req.request_id
        if rid in self._live:
            log.warning("duplicate request id %s ignored", rid)
            return
        live = self._live[rid] = Live(emit, req.prompt_tokens, req.params.n)
        self._start(req, live)

    def abort(self, request_ids: list[str], *, tell: bool = True) -> None:
        """Live requests end now with a final Delta ``finish_reason="abort"``
        (``tell=False``: silently, for requests nobody waits for any more)."""
        for rid in request_ids:
            live = self._live.pop(rid, None)
            if live is None:
                continue
            self.aborts_total += 1
            self._stop(rid, live)
            if tell:
                live.emit(
                    Delta(
                        rid,
                        finish_reason="abort",
                        prompt_tokens=live.prompt_tokens,
                        completion_tokens=live.completion_tokens,
                    )
                )

    def live_ids(self) -> list[str]:
        return list(self._live)

    def forget_all(self) -> None:
        """The engine died: its live requests end here with no Delta (the
        worker tells their routers they are lost, and they run elsewhere)."""
        live, self._live = self._live, {}
        for rid, x in live.items():
            self._stop(rid, x)

    def reset_prefix_cache(self) -> None:
        """Empty the engine's prefix cache, if it has one (its events say so)."""

    # -- what engines implement / call ---------------------------------------------

    def _start(self, req: GenerateRequest, live: Live) -> None:
        raise NotImplementedError

    def _stop(self, rid: str, live: Live) -> None:
        """Drop ``rid`` inside the engine (it has left the table already)."""

    def _died(self, e: BaseException) -> bool:
        """The engine itself died under its live requests (vLLM's EngineCore
        exited) and can be started again: the worker is told (``on_died``,
        once) and takes the live requests as lost -- True; without a worker
        to tell, False: the caller ends them with an error."""
        first = self.fatal_error is None
        self.fatal_error = e
        if self.on_died is None:
            return False
        if first:
            self.on_died()
        return True

    def _is_live(self, rid: str, live: Live) -> bool:
        return self._live.get(rid) is live

    def _output(
        self,
        rid: str,
        live: Live,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        prompt_tokens: int = 0,
        index: int = 0,
        logprobs: bytes = b"",
        top_ids: list[int] | None = None,
        cached_tokens: int = 0,
        stop_reason: str | int | None = None,
        prompt_logprobs: tuple[bytes, list[int]] | None = None,
    ) -> None:
        """New tokens of a live request's choice ``index``; ``finish_reason``
        ends that choice (and the request with its last open choice), with
        ``stop_reason`` where a stop string or stop token id ended it."""
        if self._live.get(rid) is not live:
            return  # aborted (or failed) meanwhile: its final Delta went already
        if prompt_tokens:
            live.prompt_tokens = prompt_tokens
        if cached_tokens:
            live.cached = cached_tokens
        n = len(token_ids)
        live.completion_tokens += n
        self.tokens_total += n
        d = Delta(rid, text, n, completion_tokens=live.completion_tokens, token_ids=token_ids)
        if index:
            d.index = index
        if logprobs:
            d.logprobs = logprobs
            if top_ids:
                d.top_ids = top_ids
        if prompt_logprobs is not None:
            d.prompt_logprobs, d.prompt_top_ids = prompt_logprobs
        if finish_reason is not None:
            reason = finish_reason if finish_reason in _FINISH_REASONS else "stop"
            if stop_reason is not None:
                d.stop_reason = stop_reason
            live.open -= 1
            if live.open > 0:  # this choice ended; others go on
                d.choice_finish = reason
                if not live.sent:
                    d.prompt_tokens, d.cached_tokens = live.prompt_tokens, live.cached
                live.sent = True
                live.emit(d)
                return
            del self._live[rid]
            self.finished_total += 1
            d.finish_reason = reason
            d.prompt_tokens, d.cached_tokens = live.prompt_tokens, live.cached
        elif not live.sent:
            d.prompt_tokens, d.cached_tokens = live.prompt_tokens, live.cached
        live.sent = True
        live.emit(d)

    def _embedded(self, rid: str, live: Live, vector: bytes, prompt_tokens: int, cached_tokens: int = 0) -> None:
        """An embedding request's one Delta: its vector (``Delta.embedding``), finished."""
        if self._live.get(rid) is not live:
            return  # aborted (or failed) meanwhile: its final Delta went already
        del self._live[rid]
        self.finished_total += 1
        live.emit(
            Delta(
                rid,
                finish_reason="stop",
                prompt_tokens=prompt_tokens or live.prompt_tokens,
                cached_tokens=cached_tokens,
                embedding=vector,
            )
        )

    def _fail(self, rid: str, live: Live, err: ErrorInfo) -> None:
        """End a live request with an error instead of output."""
        if self._live.get(rid) is live:
            del self._live[rid]
            live.emit(Delta(rid, error=err, prompt_tokens=live.prompt_tokens, completion_tokens=live.completion_tokens))


def bad_request(message: str, param: str | None = None) -> ErrorInfo:
    return error(Code.BAD_REQUEST, message, param=param)


def engine_error(message: str, *, unavailable: bool = False) -> ErrorInfo:
    return error(Code.ENGINE_UNAVAILABLE if unavailable else Code.ENGINE_ERROR, message)
