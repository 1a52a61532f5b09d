"""A fairness id (``Routing.fairness_id``, what x-llm-d-inference-fairness-id
and the like carry) orders requests inside their tenant, through the real
lifecycle and policy: an end user flooding its platform tenant's queue does
not hold back another user of the same tenant beyond one round."""

from __future__ import annotations

from test_lifecycle import Harness, config

from shared import protocol as p

TOKENS = 400  # ~400 tokens a request: two of them per round of the 1,024-token quantum


def test_a_flooding_user_does_not_hold_back_another_user_of_its_tenant() -> None:
    h = Harness(config())
    try:
        h.join("w0", seqs=1)  # one job at a time: the rest waits in the router's queue
        handles = []
        for i, user in enumerate(["hog"] * 12 + ["quiet"]):
            sub = p.Submit(f"r{i}", "sim-m", prompt="hi", max_tokens=TOKENS, routing=p.Routing(fairness_id=user))
            handle, sink = h.ask(sub)
            assert isinstance(handle, int), handle
            handles.append(handle)
        quiet = "%x" % handles[-1]
        for _ in handles:
            running = h.workers.dispatched["w0"][-1].request_id
            h.tokens(int(running, 16), 1, "stop")
            h.settle()
        order = [r.request_id for r in h.workers.dispatched["w0"]]
        assert sorted(order) == sorted("%x" % x for x in handles)  # each once
        # the first hog request was running already; then at most one round of the hog's before the quiet user's
        assert order.index(quiet) <= 1 + 3, order
        assert h.reserved() == 0
    finally:
        h.close()


def test_without_fairness_ids_one_tenant_is_served_in_arrival_order() -> None:
    h = Harness(config())
    try:
        h.join("w0", seqs=1)
        handles = []
        for i in range(8):
            handle, _ = h.ask(p.Submit(f"r{i}", "sim-m", prompt="hi", max_tokens=TOKENS))
            assert isinstance(handle, int), handle
            handles.append(handle)
        for _ in handles:
            h.tokens(int(h.workers.dispatched["w0"][-1].request_id, 16), 1, "stop")
            h.settle()
        assert [r.request_id for r in h.workers.dispatched["w0"]] == ["%x" % x for x in handles]
    finally:
        h.close()
