"""Discrete-event simulations of the scheduler, in virtual time -- never a stand-in for vLLM.

They drive the router's pure policy (router.policy) against the simulated
engine model (``engine_worker.sim_model.SimCore``, a calibrated model of
vLLM's continuous batching that the simulated engine worker drives in real
time) and, for N routers, the workers' own ledgers (engine_worker.ledger).
This package sits above router and engine_worker: nothing there imports it.
"""
