"""Services: what the router keeps and runs beside the request lifecycle, on its behalf.

A service is a body of state with its own storage and its own tasks that
uses the lifecycle the way an HTTP client would -- a batch line goes
through ``RouterCore.submit`` as a live request does -- and that the
ingress answers API calls from:

- ``batch``: the Batch API's files and batches on disk, and the runs that
  feed each batch's lines into the core in the lowest class;
- ``response_store``: the stored responses of ``/v1/responses`` (memory or
  Redis), per tenant, bounded.

Layer: below ``router.ingress`` (its handlers call into services; a service
never imports the ingress) and above ``router.lifecycle``.  A service may
import ``router.lifecycle``, ``router.policy``, ``router.fleet``,
``router.tenancy``, ``router.observe``, ``router.api`` and ``shared``.
What a service needs from a layer above it is declared here as a Protocol
and wired by the composition root (``router.__main__``).
"""
