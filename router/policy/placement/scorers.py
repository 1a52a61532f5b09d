"""Scorers: how good a home each candidate is for the job (higher is better).

A scorer maps the candidates to one number each.  Load scorers rank every
candidate; their sum is its load score (``LOAD``: ``least_loaded``).
Affinity scorers add to the load score only among the candidates within
``prefix_load_margin`` of the least loaded (``picker.pick``), so affinity
never trades away more load than that; one that has nothing to say for a
job returns None.  A new scorer is one function here, named in the
strategy's list (``strategy.ScoredPlacement``)."""

from __future__ import annotations

from collections.abc import Callable

from router.policy.placement.ask import Ask, Candidate
from shared.config import SchedulerConfig

Scorer = Callable[[Ask, list[Candidate]], list[float]]
AffinityScorer = Callable[[Ask, list[Candidate]], list[float] | None]


def least_loaded(ask: Ask, cands: list[Candidate]) -> list[float]:
    """KV budget left once the job is placed, seq slots left and GPU memory
    free (0 without a GPU), each 0..1: least loaded first, which keeps
    batches (and so step times) even.  (One scorer, three terms: one pass.)"""
    return [
        (w.budget - after) / w.budget
        + (w.slots - n - 1) / w.slots
        + (
            max(0, w.spec.gpu_total_bytes - w.gpu_used) / w.spec.gpu_total_bytes
            if w.spec.gpu_total_bytes > 0 and w.gpu_used is not None
            else 0.0
        )
        for w, _, after, n in cands
    ]


LOAD: tuple[Scorer, ...] = (least_loaded,)


def prefix_cached(cfg: SchedulerConfig) -> AffinityScorer:
    """``prefix_affinity_weight`` x the fraction of the prompt the worker's
    cache holds (router/fleet/prefix_index.py), where any worker holds some."""
    weight = cfg.prefix_affinity_weight

    def prefix_cached_share(ask: Ask, cands: list[Candidate]) -> list[float] | None:
        hits = ask.hits
        if not hits:
            return None
        prompt = ask.prompt
        return [weight * min(1.0, hits.get(w.spec.worker_id, 0) * w.spec.block_size / prompt) for w, _, _, _ in cands]

    return prefix_cached_share
