"""Tenancy: who is asking, what they may spend, and what they may see.

What belongs here: the answers about a tenant that do not depend on how a
request is served --

- ``identity``: API keys to tenant, tier and weight (pure);
- ``ownership``: the one rule for who may see a stored object (pure);
- the budgets: ``buckets`` (the arithmetic, pure), ``store_memory`` and
  ``store_redis`` (where bucket levels live), ``budgets`` (the ledger the
  lifecycle asks: reserve at admission, settle at the one exit).

What it may import: ``router.observe`` (the ledger's metrics) and ``shared``;
nothing else of the router (no lifecycle, policy, fleet, services or
ingress), so the layers above can call it and it never calls back up.
Within the package: ``buckets`` and ``identity`` import none of it; the
stores import ``buckets``; ``budgets`` imports ``buckets``, the stores and
``identity``; ``ownership`` imports ``identity``.
"""
