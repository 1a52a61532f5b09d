"""weir engine worker: one process per engine (GPU), linked to the router over ZeroMQ.

``python -m engine_worker --config PATH --worker-id ID``; engines: ``vllm_engine``
(real vLLM AsyncLLM) and ``sim_engine`` (SIMULATED, for dataplane benchmarks).
"""
