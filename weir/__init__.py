"""The ``weir`` command: the top of the package graph.

It starts the stack (``deploy``), runs the load generator (``bench``) and
passes through to single components; nothing below imports it.
"""
