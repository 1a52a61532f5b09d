"""OpenAI-compatible request decoding and response rendering (pure, no I/O).

The HTTP ingress (``router.ingress``) feeds request bodies and a few headers
in and gets a ``Submit`` plus a ``ResponseContext`` back; it feeds ``Delta``
batches to a ``StreamRenderer`` (SSE) or accumulates them and calls
``render_completion`` once.  Every refusal is a ``RequestError`` carrying an
``ErrorInfo`` whose ``status`` is the HTTP status.

One module per concern, one per endpoint:

- ``request``: headers (``RequestMeta``), body decoding with OpenAI-style 400s,
  the shape check of a finished ``Submit`` (its rules: ``checks``, which the
  lifecycle applies to direct ZeroMQ clients' requests too);
- ``sampling``: the body fields every generation endpoint shares, mapped to
  ``SamplingParams``, task type and priority (structured outputs included);
- ``completions`` (with ``prompt_forms``), ``chat``, ``embeddings``,
  ``responses`` (with ``responses_stream``), ``tokenize``: each endpoint's
  request body, its parser and its response shapes -- a new endpoint is a
  new module beside them;
- ``tools`` (with ``tool_parsers``): tool calling; ``metadata``: its limits;
- ``context``: request ids and the ``ResponseContext`` rendering needs;
- ``render``: non-streamed bodies; ``streaming``: SSE events (the per-token
  hot path); ``logprobs``, ``usage``: their shared parts;
- ``errors``: ``RequestError`` and the error body; ``encoding``: the encoder.

Belongs here: what the wire says and how an answer is spelled -- functions
of their arguments (and of the clock and random ids), so they are unit
tested without a server.  Not here: sockets, files, asyncio, threads, a
tokenizer or any state of the router (what needs one stays in the caller:
router.ingress.tokenize runs the tokenizer; router.lifecycle.prompts checks
a prompt against the model).

May import: itself and ``shared`` only -- nothing else of the router -- so
every layer may use it.

This package re-exports the names callers use (``from router import api``;
``api.parse_chat``, ``api.StreamRenderer``, ...).
"""

from __future__ import annotations

from router.api.chat import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatRequest,
    ChatTokenLogprob,
    Message,
    TextPart,
    TopLogprob,
    parse_chat,
)
from router.api.completions import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    CompletionChoice,
    CompletionJobs,
    CompletionLogprobs,
    CompletionRequest,
    TextCompletion,
    echo_param,
    parse_completion,
    parse_completions,
)
from router.api.context import ResponseContext, new_request_id
from router.api.embeddings import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingContext,
    EmbeddingList,
    EmbeddingRequest,
    parse_embeddings,
    render_embeddings,
)
from router.api.encoding import encode
from router.api.errors import ErrorBody, ErrorEnvelope, RequestError, error_body, invalid
from router.api.logprobs import MIN_LOGPROB, chat_logprobs, completion_logprobs, token_id_text
from router.api.render import Accumulator, render_completion, render_models
from router.api.request import RequestMeta, meta_from_headers
from router.api.sampling import JsonSchemaFormat, ResponseFormat, StreamOptions, StructuredOutputsBody
from router.api.streaming import SSE_DONE, StreamRenderer
from router.api.tools import constrain_auto, read_with_model
from router.api.usage import PromptTokensDetails, TokenCounts, Usage

__all__ = [
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "MAX_EMBEDDING_INPUTS",
    "EmbeddingContext",
    "EmbeddingList",
    "EmbeddingRequest",
    "parse_embeddings",
    "render_embeddings",
    "MIN_LOGPROB",
    "SSE_DONE",
    "Accumulator",
    "AssistantMessage",
    "ChatChoice",
    "ChatCompletion",
    "ChatLogprobs",
    "ChatRequest",
    "ChatTokenLogprob",
    "TextCompletion",
    "CompletionChoice",
    "CompletionJobs",
    "CompletionLogprobs",
    "CompletionRequest",
    "ErrorBody",
    "ErrorEnvelope",
    "JsonSchemaFormat",
    "Message",
    "PromptTokensDetails",
    "RequestError",
    "RequestMeta",
    "ResponseContext",
    "ResponseFormat",
    "StreamOptions",
    "StreamRenderer",
    "StructuredOutputsBody",
    "TextPart",
    "TokenCounts",
    "TopLogprob",
    "Usage",
    "chat_logprobs",
    "completion_logprobs",
    "constrain_auto",
    "read_with_model",
    "echo_param",
    "encode",
    "error_body",
    "invalid",
    "meta_from_headers",
    "new_request_id",
    "parse_chat",
    "parse_completion",
    "parse_completions",
    "render_completion",
    "render_models",
    "token_id_text",
]
