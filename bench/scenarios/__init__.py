"""Benchmark scenarios: one command each (``python -m bench.scenarios.NAME``),
each starting the stack it measures on free loopback ports."""
