"""Services: what the router keeps and runs beside the request lifecycle, on its behalf.

A service is a body of state with its own storage (and, for batches, its
own tasks) that the ingress answers API calls from.  Where a service runs
requests it uses the lifecycle the way an HTTP client would:

- ``batch``: the Batch API's files and batches on disk, and the runs that
  feed each batch's lines into the core in the lowest class -- a batch line
  goes through ``RouterCore.submit`` as a live request does;
- ``response_store``: the stored responses of ``/v1/responses`` (memory or
  Redis), per tenant, bounded.  It does not touch the lifecycle: the
  ingress's handlers (router.ingress.responses) run a turn through the core
  and store what it answered.

Layer: below ``router.ingress`` (its handlers call into services; a service
never imports the ingress) and above ``router.lifecycle``.  A service may
import ``router.lifecycle``, ``router.policy``, ``router.fleet``,
``router.tenancy``, ``router.observe``, ``router.api`` and ``shared``.
A service that needs something of a layer above it declares a small Protocol
of it beside its use, and the composition root (``router.__main__``) wires
it; inside a service the same rule breaks circles (router.services.batch.host,
router.services.batch.lines ``LineOwner``).
"""
