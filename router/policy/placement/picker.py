"""The picker: the one candidate a job goes to.

The highest load score (the sum of the load scorers), ties to the first in
candidate order (the lowest worker id where every worker was scored).  With
affinity scorers that have something to say: among the candidates within
``margin`` of that best load score, the highest load score + affinity,
again ties to the first."""

from __future__ import annotations

from operator import add

from router.policy.placement.ask import Ask, Candidate
from router.policy.placement.scorers import AffinityScorer, Scorer


def pick(
    ask: Ask, cands: list[Candidate], load: tuple[Scorer, ...], affinity: tuple[AffinityScorer, ...], margin: float
) -> Candidate:
    """``cands`` is not empty.  (One candidate is picked unscored: scorers are pure.)"""
    if len(cands) == 1:
        return cands[0]
    scores = load[0](ask, cands)
    if len(load) > 1:
        for scorer in load[1:]:
            scores = list(map(add, scores, scorer(ask, cands)))
    best_score = max(scores)
    best = scores.index(best_score)  # the first of the best
    bonus = None
    for affine in affinity:
        b = affine(ask, cands)
        if b is not None:
            bonus = b if bonus is None else [x + y for x, y in zip(bonus, b)]
    if bonus is not None:
        floor = best_score - margin
        best_total = 0.0
        best = -1
        for i, s in enumerate(scores):
            if s < floor:
                continue
            total = s + bonus[i]
            if best < 0 or total > best_total:
                best, best_total = i, total
    return cands[best]
