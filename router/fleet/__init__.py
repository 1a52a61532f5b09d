"""The engine workers as the router sees them: the link to each, and what their caches hold.

``worker_link`` is the backend ROUTER socket (Majordomo / Paranoid Pirate: register,
heartbeats, liveness, one removal path) over ``router_socket``, the ROUTER-socket base it
shares with the direct-client frontend; ``prefix_index`` (block hash -> workers),
``block_hash`` (vLLM's block hashes, bit for bit), ``prefix_relay`` (workers' cache
news into the index) and ``prefix_metrics``.

Imports: ``router.tenancy``, ``router.observe``, ``router.api`` and ``shared``; never the
lifecycle above it: the link tells the lifecycle of worker events through the
``WorkerEvents`` Protocol it declares, wired in ``router.__main__``.
"""
