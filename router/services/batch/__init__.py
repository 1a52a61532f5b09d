"""The batch tier: OpenAI's Batch API run in the lowest scheduler class (docs/batch.md).

From the bottom up (a module imports only those listed before it, and
none of them ``router.ingress``):

- ``rules`` (pure: statuses and their moves, windows, the feeder's
  decision, the daily token budget), ``retention`` (pure: when files and
  batches go), ``disk`` (new ids, atomic writes), ``lease`` (which router
  runs a batch, with fencing tokens);
- ``lines`` (a line in flight: its jobs, its one result, and the
  ``LineOwner`` it reports to);
- ``store`` (a batch's state, its fence and its result files on disk),
  ``files`` (``/v1/files`` on disk, uploads and the room each reserves),
  ``validate`` (the input file; each line as a live request);
- ``storage`` (what each tenant keeps, against its limits: ``StorageIndex``);
- ``host`` (``BatchHost``: what a run needs of its router; ``BatchStats``);
- ``results`` (one run's writes, under its fence: ``ResultWriter``),
  ``feeder`` (one run's lines into the core: ``LineFeeder``);
- ``run`` (one batch's life on this router, its steps and its ends:
  ``BatchRun``, over its feeder and its writer);
- ``service`` (all of it in one router: scans, leases, the API's calls,
  preemption, metrics: ``BatchService``, the ``BatchHost`` of its runs).

May import: ``router.lifecycle``, ``router.tenancy``, ``router.api`` and
``shared`` (services' rule: nothing of ``router.ingress``).  Its HTTP
handlers are ``router.ingress.files_batches`` and ``router.ingress.file_upload``.
"""
