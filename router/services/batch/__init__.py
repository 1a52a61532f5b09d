"""The batch tier: OpenAI's Batch API run in the lowest scheduler class (docs/batch.md).

``model`` (pure: statuses, windows, the feeder's decision), ``files`` and
``store`` (on disk, atomic), ``validate`` (the input file; each line as a
live request), ``feeder`` (one batch's lines into RouterCore.submit),
``lease`` (which router runs a batch), ``service`` (all of it in one router).
"""
