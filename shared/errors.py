"""weir's one error vocabulary: every refusal any component makes.

A closed set of codes, each with its HTTP status and OpenAI error ``type``;
``error()`` is the one constructor of the wire's ``ErrorInfo`` and
``retry_after_header()`` the one rendering of Retry-After.  The router, the
policy (which returns a code and facts, not prose: ``Refusal``), the workers
and Envoy's local replies (deploy/envoy_config.py) all speak it, and metric
labels are the codes' ``label`` -- so a dashboard can list every reason.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from shared.protocol import ErrorInfo, RateLimit

_INVALID = "invalid_request_error"
_SERVER = "server_error"
_UNAVAILABLE = "service_unavailable_error"
_RATE = "rate_limit_error"


class Code(enum.Enum):
    """(HTTP status, OpenAI ``type``, OpenAI ``code`` on the wire)."""

    # 4xx: the request, or its client's standing
    BAD_REQUEST = (400, _INVALID, None)  # OpenAI sends code null for plain validation errors
    UNSUPPORTED_VALUE = (400, _INVALID, "unsupported_value")
    CONTEXT_LENGTH = (400, _INVALID, "context_length_exceeded")
    INVALID_API_KEY = (401, "authentication_error", "invalid_api_key")
    INVALID_ADMIN_TOKEN = (401, "authentication_error", "invalid_admin_token")
    MODEL_NOT_FOUND = (404, _INVALID, "model_not_found")
    NOT_FOUND = (404, _INVALID, "not_found")
    METHOD_NOT_ALLOWED = (405, _INVALID, "method_not_allowed")
    REQUEST_TOO_LARGE = (413, _INVALID, "request_too_large")
    RATE_LIMITED = (429, _RATE, "rate_limit_exceeded")  # Envoy's request buckets
    QUEUE_FULL = (429, _RATE, "queue_full")  # memory protection: a count bound
    TENANT_QUEUE_FULL = (429, _RATE, "tenant_queue_full")
    QUEUE_WAIT_EXCEEDED = (429, _RATE, "queue_wait_exceeded")  # predicted wait over the class's bound
    TENANT_SHARE_EXCEEDED = (429, _RATE, "tenant_share_exceeded")  # ... and the tenant over its share
    TARGET_UNATTAINABLE = (429, _RATE, "latency_target_unattainable")  # sheddable, TTFT/TPOT target predicted missed
    # Budgets (router/tenancy/budgets.py): OpenAI's own shape, code rate_limit_exceeded
    # and ``type`` naming the budget ("requests" or "tokens").
    REQUESTS_BUDGET = (429, "requests", "rate_limit_exceeded")
    TOKENS_BUDGET = (429, "tokens", "rate_limit_exceeded")
    BUDGET_TOO_SMALL = (400, _INVALID, "request_exceeds_budget")  # could never fit: no Retry-After
    # Per-tenant storage of the Batch API (router/services/batch/storage.py): ``param`` names the limit
    FILES_LIMIT = (429, _RATE, "file_count_limit_exceeded")
    FILE_BYTES_LIMIT = (413, _INVALID, "file_storage_limit_exceeded")
    ACTIVE_BATCHES_LIMIT = (429, _RATE, "active_batch_limit_exceeded")
    UPLOADS_IN_PROGRESS = (429, _RATE, "uploads_in_progress_limit_exceeded")  # memory: each holds a buffer
    # 5xx: the service
    INTERNAL = (500, _SERVER, "internal_error")
    ENGINE_ERROR = (500, _SERVER, "engine_error")
    ENGINE_UNAVAILABLE = (503, _SERVER, "engine_unavailable")
    NO_WORKER = (503, _UNAVAILABLE, "no_worker")
    MODEL_UNLOADING = (503, _UNAVAILABLE, "model_unloading")  # being removed at run time (router/lifecycle/core.py)
    QUEUE_DEADLINE = (503, _UNAVAILABLE, "queue_deadline")
    WORKER_LOST = (503, _SERVER, "worker_lost")
    SERVICE_UNAVAILABLE = (503, _SERVER, "service_unavailable")  # Envoy: no healthy router
    QUOTA_UNAVAILABLE = (503, _UNAVAILABLE, "quota_unavailable")  # budget store down, fail closed
    TOKENIZER_BUSY = (
        503,
        _UNAVAILABLE,
        "tokenizer_busy",
    )  # /tokenize calls queued (router/lifecycle/tokenizer_queue.py)
    ROUTER_DRAINING = (
        503,
        _UNAVAILABLE,
        "router_draining",
    )  # shutting down: retry elsewhere (router/lifecycle/drain.py)
    GENERATION_DEADLINE = (504, "timeout_error", "generation_deadline")
    STORAGE_FULL = (507, _SERVER, "insufficient_storage")  # an upload met a full disk: nothing kept

    def __init__(self, status: int, type_: str, wire: str | None) -> None:
        self.status = status
        self.type = type_
        self.wire = wire

    @property
    def label(self) -> str:
        """Metric label: always a string, one per code."""
        return self.name.lower()


_BY_WIRE: dict[str, Code] = {}
for _c in Code:  # a wire code shared by several (rate_limit_exceeded): the first, unless the type says
    if _c.wire is not None:
        _BY_WIRE.setdefault(_c.wire, _c)
_BY_WIRE_TYPE = {(c.wire, c.type): c for c in Code if c.wire is not None}


def error(
    code: Code,
    message: str,
    *,
    param: str | None = None,
    retry_after: float | None = None,
    ratelimit: RateLimit | None = None,
) -> ErrorInfo:
    """The wire error for ``code`` (the only place an ErrorInfo is made)."""
    return ErrorInfo(code.status, message, code.type, code.wire, param, retry_after, ratelimit)


def code_of(info: ErrorInfo) -> Code:
    """The catalogue code of a wire error (a peer's unknown code: by status)."""
    c = (_BY_WIRE_TYPE.get((info.code, info.type)) or _BY_WIRE.get(info.code)) if info.code else None
    if c is not None:
        return c
    if info.status < 500:
        return Code.BAD_REQUEST
    return Code.INTERNAL


def label(info: ErrorInfo) -> str:
    return code_of(info).label


def retry_after_header(info: ErrorInfo) -> int | None:
    """Whole seconds for a Retry-After header (at least 1), or None."""
    if info.retry_after is None:
        return None
    return max(1, math.ceil(info.retry_after))


def context_length(max_len: int, prompt: int, completion: int, param: str = "max_tokens") -> ErrorInfo:
    """The one wording of "prompt + completion does not fit the context"."""
    return error(
        Code.CONTEXT_LENGTH,
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the prompt, {completion} in the "
        f"completion). Please reduce the length of the prompt or completion.",
        param=param,
    )


# ----------------------------------------------------------------- refusals by the policy


_NO_FACTS: Mapping[str, Any] = MappingProxyType({})  # one default shared by every Refusal, so read-only


class Refusal(NamedTuple):
    """A decision of the (pure) policy: a code and the facts that explain it.
    Words are made once, at the edge (``render``); ``status``, ``code`` and
    ``message`` read like an ErrorInfo's."""

    kind: Code
    retry_after: float | None = None
    facts: Mapping[str, Any] = _NO_FACTS
    param: str | None = None

    @property
    def status(self) -> int:
        return self.kind.status

    @property
    def code(self) -> str | None:
        return self.kind.wire

    @property
    def label(self) -> str:
        return self.kind.label

    @property
    def message(self) -> str:
        return self.render().message

    def render(self) -> ErrorInfo:
        f = self.facts
        c = self.kind
        if c is Code.NO_WORKER:
            pool = f" of the {f['pool']}-request pool" if f.get("pool") else ""
            msg = f"No worker{pool} is currently serving model `{f['model']}`; try again shortly."
        elif c is Code.CONTEXT_LENGTH and "kv_tokens" in f:
            n = f.get("n", 1)
            seqs = f" for each of {n} choices" if n > 1 else ""
            msg = (
                f"This request needs {f['prompt'] + f['completion']} tokens of KV cache{seqs} "
                f"({f['prompt']} in the prompt, {f['completion']} in the completion), more than "
                f"any worker of this model can hold ({f['kv_tokens']} tokens). Please reduce the "
                f"length of the prompt or completion{' or n' if n > 1 else ''}."
            )
        elif c is Code.CONTEXT_LENGTH:
            return context_length(f["max_len"], f["prompt"], f["completion"], self.param or "messages")
        elif c is Code.QUEUE_FULL:
            msg = f"Too many requests queued in class `{f['klass']}`; retry later."
        elif c is Code.TENANT_QUEUE_FULL:
            msg = f"Too many requests queued for tenant `{f['tenant']}`; retry later."
        elif c is Code.TENANT_SHARE_EXCEEDED:
            msg = (
                f"Tenant `{f['tenant']}` has more than its share of the `{f['klass']}` queue waiting "
                f"(predicted wait {f['wait']:.1f} s, bound {f['bound']:g} s); retry later."
            )
        elif c is Code.QUEUE_WAIT_EXCEEDED:
            msg = (
                f"The `{f['klass']}` queue is full: this request's predicted wait is {f['wait']:.1f} s, "
                f"over the bound of {f['bound']:g} s; retry later."
            )
        elif c is Code.QUEUE_DEADLINE:
            msg = (
                f"Request waited {f['waited']:.1f} s in the `{f['klass']}` queue, past its "
                f"deadline of {f['deadline']:g} s; the service is overloaded, retry later."
            )
        elif c is Code.GENERATION_DEADLINE:
            msg = f"Request ran past the generation deadline of {f['deadline']:g} s and was aborted."
        else:
            msg = f.get("message") or c.name.replace("_", " ").capitalize()
        return error(c, msg, param=self.param, retry_after=self.retry_after)


# ----------------------------------------------------------------- the catalogue as a table (docs/api.md)

# When each code is given: the words of the docs' error table, kept beside
# the catalogue so a new code cannot be added without them.
WHEN: dict[Code, str] = {
    Code.BAD_REQUEST: "a field is malformed or out of range, or the body is not JSON (`param` names the field)",
    Code.UNSUPPORTED_VALUE: "a known field weir cannot honour (`suffix`, vLLM extensions such as `echo` in chat, "
    "...; structured output or `logprobs` on a simulated engine)",
    Code.CONTEXT_LENGTH: "prompt + `max_tokens` exceeds the model's context, or the KV any worker can hold",
    Code.INVALID_API_KEY: "the key is malformed (not printable ASCII without spaces), or keys are configured "
    "and this one is unknown",
    Code.INVALID_ADMIN_TOKEN: "`/admin/*` from other than loopback without the admin token, or with a wrong one",
    Code.MODEL_NOT_FOUND: "no such model is served (or it was removed at run time)",
    Code.NOT_FOUND: "no such path, or no such worker on an admin path",
    Code.METHOD_NOT_ALLOWED: "a known path with the wrong method",
    Code.REQUEST_TOO_LARGE: "the body is over `max_request_bytes` (Envoy or the router)",
    Code.RATE_LIMITED: "an Envoy request bucket (route-wide or per key) is empty",
    Code.QUEUE_FULL: "the class's queue holds `max_queue` requests (memory bound)",
    Code.TENANT_QUEUE_FULL: "the tenant has `max_queue_per_tenant` requests queued (memory bound)",
    Code.QUEUE_WAIT_EXCEEDED: "the predicted queue wait is over the class's bound",
    Code.TENANT_SHARE_EXCEEDED: "the predicted wait is over the bound and this tenant alone is over its share",
    Code.TARGET_UNATTAINABLE: "a sheddable request's TTFT or TPOT target (`x-llm-d-slo-ttft-ms`, "
    "`x-llm-d-slo-tpot-ms`, or its class's `ttft_target_ms`, `tpot_target_ms`) is predicted to be missed on "
    "every worker",
    Code.REQUESTS_BUDGET: "a `requests_per_minute` budget is empty",
    Code.TOKENS_BUDGET: "a token budget cannot hold prompt + n × `max_tokens` now",
    Code.BUDGET_TOO_SMALL: "the request is larger than a token budget, or has more prompts or inputs than a "
    "`requests_per_minute` budget, could ever hold",
    Code.FILES_LIMIT: "the tenant keeps `max_stored_files` files (`[batch]`, or its key's or tenant's own)",
    Code.FILE_BYTES_LIMIT: "the upload would take the tenant's files over `max_stored_file_bytes`",
    Code.ACTIVE_BATCHES_LIMIT: "the tenant has `max_active_batches` batches not yet ended",
    Code.UPLOADS_IN_PROGRESS: "the tenant has 32 uploads in progress (each holds up to 256 KiB of router memory)",
    Code.INTERNAL: "a fault inside weir (or a request the worker link could not encode)",
    Code.ENGINE_ERROR: "the engine failed or ended the request without a result",
    Code.ENGINE_UNAVAILABLE: "the engine stopped",
    Code.NO_WORKER: "no worker of the model (or of its pool) takes new work",
    Code.MODEL_UNLOADING: "the model is being removed at run time",
    Code.QUEUE_DEADLINE: "the request waited past its class's `queue_deadline_s`",
    Code.WORKER_LOST: "its worker was lost and it could not be resumed (resumes used up, "
    "structured output or n > 1 after output)",
    Code.SERVICE_UNAVAILABLE: "Envoy has no healthy router",
    Code.QUOTA_UNAVAILABLE: 'the Redis budget store is unreachable and `on_store_error = "closed"`',
    Code.TOKENIZER_BUSY: "too many long `/tokenize` or `/detokenize` calls of this tenant (or in all) are waiting "
    "for the tokenizer (`router.tokenize_queue_per_tenant`, `tokenize_queue_max`)",
    Code.ROUTER_DRAINING: "the router is draining (SIGTERM, `POST /admin/drain`): a new request, one that could "
    "not finish before `router.drain_timeout_s`, or one still running at it (an SSE error event once streaming)",
    Code.GENERATION_DEADLINE: "the request ran past `generation_deadline_s`",
    Code.STORAGE_FULL: "an upload or a batch create met a full disk (or another write error): nothing of it is kept; "
    "retry after `Retry-After`",
}


def markdown_table() -> str:
    """The catalogue as the Markdown table of docs/api.md (a test keeps them equal)."""
    rows = ["| status | `code` | `type` | label (metrics) | when |", "|---|---|---|---|---|"]
    for c in Code:
        wire = f"`{c.wire}`" if c.wire else "null"
        rows.append(f"| {c.status} | {wire} | `{c.type}` | `{c.label}` | {WHEN[c]} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m shared.errors > table (paste into docs/api.md)
    print(markdown_table(), end="")
