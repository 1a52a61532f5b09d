"""Models of an inference engine for benchmarks and fast tests -- never a stand-in for vLLM.

``simulation.core.SimCore`` is a calibrated model of vLLM's continuous
batching (the simulated engine worker drives it in real time); the
discrete-event simulation drives the router's pure policy against it in
virtual time.
"""
