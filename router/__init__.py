"""The router process: one asyncio (uvloop) process between Envoy and the engine workers.

Its packages are its layers, top to bottom; each imports only those below it
(tests/unit/test_layers.py holds the rule, docs/architecture.md draws it):
``ingress`` (the HTTP and ZeroMQ-client edges) > ``services`` (batches, stored
responses) > ``lifecycle`` (a request from intake to its one exit) > ``policy``
(pure scheduling) > ``fleet`` (the worker link, the prefix index) > ``tenancy``
(keys, budgets, ownership) > ``observe`` (metrics, views, operator actions) >
``api`` (pure OpenAI decoding and rendering).  ``__main__`` wires them.
"""
