"""The request lifecycle: one request from ``submit`` to its one end, and the router's state of it.

What belongs here: the core (``core``: the job table, policy passes,
dispatch, job news, the one exit), the pieces it drives through the parts it
shares with them (``parts``: ``intake`` -- key, shape, model, tokenizing,
budget, queueing, fallbacks -- and ``recovery`` -- lost, stalled and moved
jobs), the one job state (``jobs``), the models served now and their
prompts (``models``, ``prompts``, ``embedding_model``, ``tokenizer_queue``),
a completion of several prompts as one job each (``fanout``), the router's drain
(``drain``), what the views read (``reads``) and the ports it calls out
through (``ports``: ``WorkerPort``, ``RequestSink``).  It owns no socket.
Its only I/O besides the tokenizing threads (``tokenizer_queue``) is reading
a model's files when the model is loaded -- ``tokenizer.json``, its chat
template (``tokenizer_config.json`` or ``chat_template.jinja``) and
``config.json`` (``prompts``, ``embedding_model``) -- at start, and on the
loop when an operator adds a model (``POST /admin/models``).

What it may import: ``router.policy``, ``router.fleet``, ``router.tenancy``,
``router.observe`` (the layers below it), ``router.api`` (pure request
rules), ``shared``, and itself.  Never ``router.ingress``,
``router.services`` or ``router.__main__``: what it needs of those it
declares as a Protocol in ``ports`` and the composition root wires it.
"""
