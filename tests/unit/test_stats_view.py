"""`weir stats`' worker view from several routers' readings (pure).
The command against a running stack: tests/e2e/test_stats.py."""

from __future__ import annotations


def test_with_several_routers_a_worker_is_lost_only_where_it_was_seen():
    """Each router may have only some workers (one per router pod in
    Kubernetes): a worker is "lost" at a router that had it, not at the others."""
    from weir.stats import _registered, _workers_view

    def reading(workers):
        return {
            "workers": [
                {"id": w, "model": "m", "pool": "any", "reserved_tokens": 0, "capacity_tokens": 1, "running": 0}
                for w in workers
            ]
        }

    expected: dict[str, set[str]] = {}
    _registered(expected, {"routers": {"A": reading(["w1"]), "B": reading(["w2"])}})
    now = {"A": reading([]), "B": reading(["w2"])}  # w1 left A
    states = {
        (u, x["id"]): x["state"] for u in now for x in _workers_view(u, now[u], None, 1.0, expected.get(u, set()))
    }
    assert states == {("A", "w1"): "lost", ("B", "w2"): "ready"}
