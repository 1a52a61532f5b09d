"""The router's WorkerLink on a real socket in this process, a DEALER as the
worker: what it sends leaves in the order it was queued.  The worker process
over its link: tests/e2e/test_worker_link.py."""

from __future__ import annotations

import zmq

from shared.protocol import (
    Abort,
    Dispatch,
    GenerateRequest,
    Heartbeat,
    Pool,
    Register,
    SamplingParams,
    encoder,
    to_worker_decoder,
)


def req(rid: str, max_tokens: int = 6, prompt_tokens: int = 5, **kw) -> GenerateRequest:
    """A request as the router sends a simulated engine: its prompt's length, no ids."""
    return GenerateRequest(rid, [], prompt_tokens, SamplingParams(max_tokens=max_tokens), **kw)


def test_link_sends_aborts_and_dispatches_in_the_order_queued():
    """The router's WorkerLink on a real socket, a DEALER as the worker.  A job
    moved off a stalled worker onto the same one is Abort(id) + dispatch(id) in
    one batch: the worker must see the Abort first (it used to get the dispatch
    first, ignore it as a duplicate, then abort the job: an empty 200 in CI).
    And dispatch-then-cancel within one turn keeps its order too."""
    import asyncio

    from router.fleet.worker_link import WorkerLink
    from router.observe.metrics import RouterMetrics
    from shared.config import RouterConfig
    from shared.transport import SocketPump

    class Events:  # the lifecycle's side, which this test does not exercise
        def serves(self, model):
            return True

        def worker_joined(self, reg):
            self.joined = reg

        def worker_stats(self, *a, **k):
            pass

        def running_on(self, worker_id):
            return []

        def worker_left(self, *a):
            pass

        def on_outputs(self, *a):
            pass

    async def scenario():
        loop = asyncio.get_running_loop()
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        link = WorkerLink(RouterConfig(backend=f"tcp://127.0.0.1:{port}"), loop, SocketPump(loop), RouterMetrics())
        events = Events()
        link.serve(events)
        ctx = zmq.Context()
        worker = ctx.socket(zmq.DEALER)
        worker.setsockopt(zmq.IDENTITY, b"w-1")
        worker.connect(f"tcp://127.0.0.1:{port}")
        try:
            worker.send(
                encoder.encode(
                    Register(
                        worker_id="w-1",
                        model="m",
                        pool=Pool.ANY,
                        max_model_len=64,
                        kv_capacity_tokens=64,
                        block_size=16,
                        max_num_seqs=2,
                        engine="sim",
                    )
                )
            )
            while not hasattr(events, "joined"):
                await asyncio.sleep(0.01)

            async def received(n):
                got = []
                while len(got) < n:
                    if worker.poll(0):
                        msg = to_worker_decoder.decode(worker.recv())
                        if not isinstance(msg, Heartbeat):
                            got.append(msg)
                    else:
                        await asyncio.sleep(0.01)
                return got

            link.abort("w-1", "moved")
            link.dispatch("w-1", req("moved"))
            link.dispatch("w-1", req("other"))
            link.flush()
            first = await received(2)
            assert isinstance(first[0], Abort) and first[0].request_ids == ["moved"]
            assert isinstance(first[1], Dispatch) and [r.request_id for r in first[1].requests] == ["moved", "other"]
            link.dispatch("w-1", req("cancelled"))
            link.abort("w-1", "cancelled")
            link.flush()
            second = await received(2)
            assert isinstance(second[0], Dispatch) and isinstance(second[1], Abort)
        finally:
            link.close()
            worker.close(0)
            ctx.term()

    asyncio.run(scenario())
