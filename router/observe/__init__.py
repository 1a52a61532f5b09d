"""What operators see of a router and what they may do to it.

``metrics`` (the Prometheus families, label-bound children updated on the loop) and
``exposition`` (the /metrics page rendered over loop turns), ``ops_metrics`` and
``worker_series`` (scrape-time gauges and per-worker series), ``views`` (read-only
health, models, workers, queues), ``operator_actions`` (drain, models at run time,
reload), ``worker_report`` (one linked worker as operators see it).

Imports: ``shared`` and ``router.api`` only -- every layer above counts into these
metrics, so this package reads the lifecycle and the worker link through the
Protocols it declares (``views.CoreReads``, ``views.LinkReads``,
``operator_actions.ModelControl``, ...), never by importing them.
"""
