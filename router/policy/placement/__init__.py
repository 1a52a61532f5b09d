"""Where a job runs: a pipeline of small functions, one concern each.

    candidates -> filters -> scorers -> picker

* ``candidates``: the workers looked at -- every worker of a small fleet, a
  sample from the free sets of a large one.
* ``filters``: each drops the workers the job may not use now, for one
  reason (takes work, GPU floor, pools, context length, KV budget, class
  headroom), then keeps the most preferred pool.
* ``scorers``: rank what is left -- load scorers (KV, slots, GPU memory
  left), affinity scorers (the cached prompt prefix) counted within a load
  margin of the least loaded.  A new scorer is one function in
  ``scorers.py``, named in ``ScoredPlacement``'s list.
* ``picker``: the best, ties to the lowest worker id.

``ask`` holds what one placement asks (``Ask``) and a worker that can give
it (``Candidate``); ``strategy`` runs the pipeline (``ScoredPlacement``,
``RoundRobin``) and answers the policy's other placement questions (class
cap, the worker reserved for a due head).  Imports: the policy's records,
model and queues below it, ``router.fleet.prefix_index``, ``shared``."""

from __future__ import annotations

from router.policy.placement.strategy import Placed, RoundRobin, ScoredPlacement, placement

__all__ = ["Placed", "RoundRobin", "ScoredPlacement", "placement"]
