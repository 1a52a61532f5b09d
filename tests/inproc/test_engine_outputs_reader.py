"""The worker's reader of vLLM's EngineCore output socket (engine_worker.vllm_direct.EngineOutputs),
over a real ZeroMQ PUSH/PULL pair with vLLM's own encoder and decoder: steps come in order, the
loop gets a turn between steps even when the engine is ahead, utility results reach their
callers, and the engine's death (its sentinel, or vLLM closing the socket) ends the reading."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

pytest.importorskip("vllm")

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, UtilityOutput
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.engine.core_client import BackgroundResources
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

from engine_worker.vllm_direct import EngineOutputs


def _step(i: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=f"r{i}", new_token_ids=[i])])


async def _pair():
    """A PULL socket as vLLM's client holds it (zmq.asyncio) and a PUSH as the EngineCore's."""
    actx, ctx = zmq.asyncio.Context(), zmq.Context()
    pull = actx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    resources = BackgroundResources(ctx=actx)
    resources.output_socket = pull
    client = SimpleNamespace(resources=resources, decoder=MsgpackDecoder(EngineCoreOutputs), utility_results={})
    reader = EngineOutputs(client, asyncio.get_running_loop())  # type: ignore[arg-type]
    return reader, client, pull, push, (actx, ctx)


def _close(pull, push, ctxs):
    push.close(0)
    if not pull.closed:
        pull.close(0)
    for c in ctxs:
        c.term()


def test_steps_arrive_in_order_and_the_loop_runs_between_them():
    async def main():
        reader, _, pull, push, ctxs = await _pair()
        enc = MsgpackEncoder()
        n = 200
        for i in range(n):  # the engine far ahead: every step already waiting
            push.send_multipart(enc.encode(_step(i)))
        turns = 0

        def tick():
            nonlocal turns
            turns += 1
            loop.call_soon(tick)

        loop = asyncio.get_running_loop()
        loop.call_soon(tick)
        seen, turns_at = [], []
        await asyncio.sleep(0.2)  # let ZeroMQ deliver them all
        for _ in range(n):
            out = await reader.next()  # awaited directly, as the output handler does
            seen.append(out.outputs[0].request_id)
            turns_at.append(turns)
        assert seen == [f"r{i}" for i in range(n)]
        # Another callback ran between every two steps: the outbox flushes per step,
        # the routers' heartbeats are read.
        assert all(b > a for a, b in zip(turns_at, turns_at[1:], strict=False))
        reader.close()
        _close(pull, push, ctxs)

    asyncio.run(main())


def test_a_utility_result_reaches_its_caller_and_empty_steps_are_skipped():
    async def main():
        reader, client, pull, push, ctxs = await _pair()
        loop = asyncio.get_running_loop()
        called = client.utility_results[7] = loop.create_future()
        enc = MsgpackEncoder()
        push.send_multipart(enc.encode(EngineCoreOutputs(utility_output=UtilityOutput(7, result=UtilityResult(True)))))
        push.send_multipart(enc.encode(EngineCoreOutputs()))  # nothing in it: vLLM drops it too
        push.send_multipart(enc.encode(_step(1)))
        out = await asyncio.wait_for(reader.next(), 5)
        assert out.outputs[0].request_id == "r1"
        assert called.done() and called.result() is True
        reader.close()
        _close(pull, push, ctxs)

    asyncio.run(main())


def test_the_engines_death_sentinel_and_a_closed_socket_end_the_reading():
    async def main():
        reader, client, pull, push, ctxs = await _pair()
        push.send(EngineCoreProc.ENGINE_CORE_DEAD)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(reader.next(), 5)
        assert client.resources.engine_dead

        waiting = asyncio.ensure_future(reader.next())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        pull.close(0)  # what vLLM's shutdown does, then it cancels the reading task
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(EngineDeadError):  # and a read after the close never touches the socket
            await reader.next()
        reader.close()
        _close(pull, push, ctxs)

    asyncio.run(main())
