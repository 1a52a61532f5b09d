"""A draining router's lifecycle (router.lifecycle.core + router.lifecycle.drain) in-process:
new requests refused before anything starts, admitted ones ended cleanly
at the deadline, and the KV ledger back to zero."""

from __future__ import annotations

from test_lifecycle import Harness

from router.lifecycle.drain import RouterDrain
from shared import protocol as p


def test_a_draining_core_refuses_new_work_and_ends_the_rest_with_one_error_each() -> None:
    h = Harness()
    try:
        h.join("w0", seqs=1)
        running, queued = h.submit(max_tokens=50), h.submit(max_tokens=50)
        h.settle()
        h.tokens(running, 3)
        drain = RouterDrain(h.core, h.loop, timeout_s=5.0, clock=h.clock)
        drain.start("test")
        refused = h.core.submit(p.Submit("c", "sim-m", prompt="hi", max_tokens=4), h.sinks[running])
        assert isinstance(refused, p.ErrorInfo) and (refused.status, refused.code) == (503, "router_draining")
        assert refused.retry_after and not drain.done.is_set()
        h.clock.t += 5.0
        drain._tick()
        assert drain.done.is_set() and not h.core.jobs and h.reserved() == 0
        for handle in (running, queued):
            (final,) = h.sinks[handle].finals
            assert final.error is not None and final.error.code == "router_draining"
        assert ("w0", "%x" % running) in h.workers.aborted  # the engine stops generating it
        drain.close()
    finally:
        h.close()
