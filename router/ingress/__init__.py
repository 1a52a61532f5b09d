"""The router's edges: where clients' requests come in and their answers go out.

HTTP (behind Envoy): ``http_server`` is the asyncio protocol on httptools --
parsing, keep-alive, pipelining, streamed bodies, the route table, writing.
Its handlers see their request and connection through the Protocols of
``connection`` and never import the server:

- ``exchange``: one generation request in flight, its response whole or as SSE;
- ``embeddings``, ``tokenize``: ``/v1/embeddings``, ``/tokenize`` and ``/detokenize``;
- ``responses``: ``/v1/responses`` over the stored-responses service;
- ``files_batches`` (with ``file_upload``, a multipart body streamed to a file):
  ``/v1/files`` and ``/v1/batches`` over the batch service;
- ``routes``: the route table's types and the routes besides generation
  (models, health, metrics, admin); ``headers``: response heads.

ZeroMQ: ``zmq_clients`` is the frontend ROUTER socket of direct clients
(``shared.client``).

Belongs here: turning bytes on a socket into calls on the layers below, and
their answers back into bytes.  Not here: decoding and rendering the OpenAI
shapes (router.api, pure), the request's lifecycle, decisions, stored state.

May import: router.api, router.services, router.lifecycle, router.policy,
router.fleet, router.tenancy, router.observe and ``shared``; only the
composition root (router.__main__) imports this package.
"""
