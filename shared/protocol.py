"""weir's wire protocol: every message that crosses a ZeroMQ socket.

One ZeroMQ message = one frame of payload (after the ROUTER identity frame,
where there is one) = one msgpack-encoded tagged Struct from this module.

Two links:
  client (DEALER)  <->  router frontend (ROUTER)
      client -> router:  Submit, Cancel
      router -> client:  Outputs              (one message per client per flush)
  worker (DEALER)  <->  router backend (ROUTER)
      worker -> router:  Register, Heartbeat, Outputs, Drain, Goodbye, Refuse,
                         PrefixEvents, PrefixSnapshot, Lost
      router -> worker:  Dispatch, Abort, Heartbeat, Goodbye, PrefixResync
  A worker may link to several routers (one DEALER each): its own ledger
  (engine_worker.ledger) arbitrates their dispatches, and each router hears
  in Heartbeat/Refuse what the others hold there (README: Scaling out).

Conventions (after vLLM's engine boundary):
  * Structs are ``array_like`` (positional, no field names on the wire),
    ``omit_defaults`` and ``gc=False`` (they hold no reference cycles).
  * Tags are small ints; never reuse or renumber one.  New fields go at the
    end with a default so older peers still decode.
  * Batching: a Dispatch/Abort/Outputs message carries *lists* so that one
    message per destination per event-loop turn (or per engine step) is
    enough.  Per-message cost (~5 us) dwarfs encoding (~0.1 us).
  * Ranges are declared here, once (``Temperature``, ``TopP``...): decoding
    a message enforces them, and the HTTP decoder uses the same types.
  * Tokens are computed once, in the router: a worker gets the prompt's token
    ids (models with a tokenizer) or its token count (the simulated engine),
    never text to tokenize again; its Deltas carry the generated token ids,
    so prompt + output ids of any request are known outside the engine.
  * Errors are ``ErrorInfo`` made by ``shared.errors.error`` (one catalogue).
"""

from __future__ import annotations

import array
import enum
import sys
from typing import Annotated

import msgspec
from msgspec import Meta


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag_field="t"):
    pass


class RequestKind(enum.IntEnum):
    COMPLETION = 0  # prompt is a string
    CHAT = 1  # messages are rendered with the model's chat template
    EMBEDDING = 2  # prompt (or prompt_token_ids) -> one vector; a pooling model, nothing generated


class TaskType(enum.IntEnum):
    AUTO = 0  # classified by estimated tokens
    SHORT = 1
    LONG = 2


class Pool(enum.IntEnum):
    ANY = 0
    SHORT = 1
    LONG = 2


POOL_NAMES = {Pool.ANY: "any", Pool.SHORT: "short", Pool.LONG: "long"}  # as views and metric labels show a pool


class ToolCallRef(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tool call an earlier assistant message made (chat history), as the
    chat template sees it; ``arguments`` is the client's JSON text."""

    id: str
    name: str
    arguments: str = ""


class ChatMessage(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    role: str
    content: str
    tool_calls: list[ToolCallRef] = []  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message's answer to which call
    name: str | None = None


class ChatOptions(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How a chat is rendered into its prompt, as vLLM's chat endpoint does
    (router.lifecycle.prompts): the tools shown to the template, its options, and the
    tool choice (the model's tool-call parser decides if it may be served).
    JSON fields are JSON text: the router parses them where it renders."""

    tools: str | None = None  # the tool dicts for the template (a JSON array)
    tool_choice: str = "none"  # "none" | "auto" | "required" | "named"
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: str | None = None  # chat_template_kwargs (a JSON object)
    documents: str | None = None  # a JSON array of objects
    add_special_tokens: bool = False


# OpenAI's ranges, declared once for the HTTP decoder and ZeroMQ submissions alike.
MAX_STOP_SEQUENCES = 4
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# Every integer fits msgpack's 64 bits (and vLLM's int64): a larger one in a
# request is a 400, never a message that cannot be encoded on its way on.
INT64_MAX = 2**63 - 1
PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Seed = Annotated[int, Meta(ge=-(2**63), le=INT64_MAX)]
StopList = Annotated[list[str], Meta(max_length=MAX_STOP_SEQUENCES)]
# n, logprobs and vLLM's sampling extras (vLLM's names and ranges; OpenAI's where it has one).
MAX_N = 128  # OpenAI's bound on n
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound (and vLLM's default max_logprobs)
MAX_STOP_TOKEN_IDS = 64
SIM_EMBEDDING_SIZE = 64  # the simulated engine's embedding width (its vectors; the router checks dimensions on it)
MAX_LOGIT_BIAS = 300  # entries; each id is checked against the model's vocabulary by the router
N = Annotated[int, Meta(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
TopK = Annotated[int, Meta(ge=-1, le=INT64_MAX)]  # 0 or -1: off
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
LogitBias = Annotated[dict[TokenId, Bias], Meta(max_length=MAX_LOGIT_BIAS)]  # JSON: string keys
User = Annotated[str, Meta(max_length=256)]
# A request id for logs and error bodies (HTTP: x-request-id); printable, no spaces.
MAX_TRACE_ID = 128
TraceId = Annotated[str, Meta(max_length=MAX_TRACE_ID, pattern=r"^[\x21-\x7e]+$")]
BlockHashInt = Annotated[int, Meta(ge=0)]  # vLLM's 64-bit KV block hash (msgpack: up to 2**64 - 1)


class StructuredOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A constraint for the engine's structured-output backend (vLLM's
    ``StructuredOutputsParams``): exactly one of ``json`` (a JSON schema, as
    JSON text), ``json_object``, ``regex``, ``choice``, ``grammar`` (EBNF),
    ``structural_tag`` (xgrammar's structural tag, as JSON text).
    The router compiles it before anything is reserved (router.lifecycle.prompts)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] = []
    grammar: str | None = None
    # vLLM's name: json / json_object with no free whitespace (the worker
    # compiles the schema to a grammar that has none; vLLM 0.32 honours it
    # only server-wide)
    disable_any_whitespace: bool = False
    # vLLM's: free text with tagged sections constrained (tool_choice "auto" with a strict tool)
    structural_tag: str | None = None

    def kinds(self) -> list[str]:
        return [
            k
            for k, v in (
                ("json", self.json is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", bool(self.choice)),
                ("grammar", self.grammar is not None),
                ("structural_tag", self.structural_tag is not None),
            )
            if v
        ]


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Subset of OpenAI sampling parameters that every engine honours.

    ``max_tokens``: ignored in a Submit (``Submit.max_tokens`` says it); in a
    GenerateRequest always the router's resolution (``router.tenancy.identity``),
    so workers never guess it.
    """

    max_tokens: NonNegativeInt = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: Seed | None = None
    stop: StopList = []
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    n: N = 1  # choices; Deltas carry their ``index``
    logprobs: TopLogprobs | None = None  # k: each token's logprob and the top k (Delta.logprobs)
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_tokens: NonNegativeInt = 0  # at most max_tokens (router.tenancy.identity)
    stop_token_ids: StopTokenIds = []
    logit_bias: LogitBias = {}
    structured: StructuredOutput | None = None
    # vLLM's prompt_logprobs: k -> each prompt token's logprob and the top k
    # (Delta.prompt_logprobs); completions' echo with logprobs asks for them
    prompt_logprobs: TopLogprobs | None = None


class RateLimit(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Where a request's API key stands against its budgets (router/tenancy/budgets.py):
    the figures of OpenAI's ``x-ratelimit-*`` headers.  A limit of 0: no such
    budget.  ``reset_*_s``: seconds until that budget is whole again."""

    limit_requests: int = 0
    remaining_requests: int = 0
    reset_requests_s: float = 0.0
    limit_tokens: int = 0
    remaining_tokens: int = 0
    reset_tokens_s: float = 0.0


class ErrorInfo(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An OpenAI-style error; ``status`` is the HTTP status it maps to."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    retry_after: float | None = None  # seconds; set on 429/503
    ratelimit: RateLimit | None = None  # the key's budgets, where it has any


class Timing(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Where one request's time went in the router, in seconds (router ->
    client: the first news with tokens carries the phases so far, the last
    Delta all of them; HTTP renders it as the ``server-timing`` header).
    ``tokenize``: arrival -> tokenized; ``queue``: tokenized -> the dispatch
    that produced its first token (budget reservation and queue wait);
    ``prefill``: that dispatch -> the first token (the engine's part of TTFT);
    ``decode``: first token -> end; ``total``: arrival -> end (0: not ended yet)."""

    tokenize: float = 0.0
    queue: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    total: float = 0.0


TraceId16 = Annotated[bytes, Meta(min_length=16, max_length=16)]
SpanId8 = Annotated[bytes, Meta(min_length=8, max_length=8)]
TraceState = Annotated[str, Meta(max_length=512)]


class TraceContext(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """W3C trace context (``traceparent`` / ``tracestate``) in binary, ~30
    bytes: the trace, the sender's span the receiver's spans hang under, and
    whether the trace is sampled.  A direct client's Submit may carry its own;
    the router sends its dispatch span's on a sampled GenerateRequest."""

    trace_id: TraceId16
    span_id: SpanId8
    sampled: bool = False
    state: TraceState = ""


class Delta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New output of one request since the previous Delta for it.

    Invariants: a request's last Delta has ``finish_reason`` or ``error`` set
    and no Delta for that id follows it.  ``prompt_tokens`` is the engine's
    exact count, set on the first Delta (and repeated on the last);
    ``completion_tokens`` is cumulative.
    """

    request_id: str
    text: str = ""
    num_tokens: int = 0  # new tokens in this delta (== len(token_ids) where ids are known)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: ErrorInfo | None = None
    token_ids: list[int] = []  # the new tokens' ids (the simulated engine's are placeholders)
    # n > 1: the choice these tokens belong to; a choice that ends before the
    # request does says so in ``choice_finish`` (the request's last Delta uses
    # ``finish_reason``, for its own index, as for n = 1).
    index: int = 0
    choice_finish: str | None = None
    # SamplingParams.logprobs = k: per new token, [its logprob, top-1 .. top-k
    # logprobs] as float32 little-endian (``pack_logprobs``; vLLM computes them
    # in float32, so nothing is lost), and the top-k token ids, k per token.
    # Token strings are not sent: the router has the tokenizer.
    logprobs: bytes = b""
    top_ids: list[int] = []
    model: str = ""  # set on a request's first Delta when a fallback model answers it
    ratelimit: RateLimit | None = None  # router -> client, on a request's first Delta: its key's budgets
    # Prompt tokens the engine found in its prefix cache (vLLM's
    # ``num_cached_tokens``: whole blocks), set with ``prompt_tokens``.
    cached_tokens: int = 0
    # An embedding request's vector, on its final Delta: float32 little-endian
    # (``pack_floats``), as the engine computed it (vLLM pools in float32).
    embedding: bytes = b""
    # vLLM's ``stop_reason``: the stop string or stop token id that ended the
    # choice (with ``finish_reason`` or ``choice_finish``); None for any other end.
    stop_reason: str | int | None = None
    # router -> client, on a request's first Delta when its Submit asked for
    # ``return_token_ids``: the prompt's token ids as the router tokenized them.
    prompt_token_ids: list[int] = []
    # SamplingParams.prompt_logprobs = k, on the first Delta of the attempt:
    # per prompt token from the second on, [its logprob, top-1 .. top-k] as in
    # ``logprobs``; ``prompt_top_ids`` is the prompt's token ids, then the
    # top-k ids of each of those positions (the first token has no logprob).
    prompt_logprobs: bytes = b""
    prompt_top_ids: list[int] = []
    # router -> client: where the request's time went (partial on its first
    # news with tokens, whole on its last Delta).
    timing: Timing | None = None

    @property
    def finished(self) -> bool:
        """The request's last Delta (as vLLM's ``EngineCoreOutput.finished``)."""
        return self.finish_reason is not None or self.error is not None


_SWAP = sys.byteorder != "little"


def pack_logprobs(values: list[float]) -> bytes:
    """``Delta.logprobs`` from floats (4 bytes each instead of msgpack's 9)."""
    a = array.array("f", values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def unpack_logprobs(data: bytes) -> array.array[float]:
    a = array.array("f")
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a


# Embedding vectors travel the same way (Delta.embedding).
pack_floats = pack_logprobs
unpack_floats = unpack_logprobs


# ---------------------------------------------------------------- client link


# Agent and gateway routing hints (router/api/agent_headers.py reads them from
# HTTP headers; a direct client sets them itself).
MAX_SESSION_ID = 256
SessionId = Annotated[str, Meta(max_length=MAX_SESSION_ID, pattern=r"^[\x20-\x7e]*$")]
TargetMs = Annotated[float, Meta(ge=0.0, le=86_400_000.0)]


class PriorityHint(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A gateway's priority in weir's terms: ``offset`` classes below the
    ``anchor`` class (0: the first class, 1: the default class, 2: the last);
    resolved against the configured classes by router.tenancy.priority_hints."""

    anchor: Annotated[int, Meta(ge=0, le=2)]
    offset: Annotated[int, Meta(ge=-64, le=64)]


class Routing(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What agents and gateways say about a request beyond OpenAI's fields.
    ``session``/``parent_session``: opaque ids (a sub-agent names its
    parent's), per tenant; ``session_final``: the session's last turn.
    ``hints``/``objective``: priorities that may only lower the key's class.
    Targets in milliseconds (0: none); ``sheddable``: refused at once when no
    worker is predicted to meet its TTFT target."""

    session: SessionId = ""
    parent_session: SessionId = ""
    session_final: bool = False
    hints: Annotated[list[PriorityHint], Meta(max_length=8)] = []
    objective: SessionId = ""
    fairness_id: SessionId = ""
    ttft_target_ms: TargetMs = 0.0
    tpot_target_ms: TargetMs = 0.0
    sheddable: bool = False


class Submit(_Msg, tag=1):
    """Client asks for a generation.  ``request_id`` is the client's own id,
    unique among that client's live requests; replies carry it back."""

    request_id: str
    model: str
    kind: RequestKind = RequestKind.COMPLETION
    prompt: str = ""
    messages: list[ChatMessage] = []
    params: SamplingParams | None = None  # None: all defaults
    max_tokens: PositiveInt | None = None  # None: rest of the context
    priority: str | None = None  # may only lower the key's class
    task_type: TaskType = TaskType.AUTO
    api_key: str | None = None
    user: User | None = None  # OpenAI's end-user id: recorded per tenant, never an identity
    allow_fallback: bool = False  # another model (the config's fallbacks) may answer instead
    # The id its log lines (router and worker) carry; HTTP: Envoy's or the
    # client's x-request-id.  None: the router uses its own job id.
    trace_id: TraceId | None = None
    # The prompt (a completion's) or input (an embedding's) as token ids
    # instead of ``prompt``: checked against the model's vocabulary and sent as
    # they are.  ``dimensions``: an embedding's length where the model is
    # Matryoshka (None: its full width).
    prompt_token_ids: list[TokenId] = []
    dimensions: PositiveInt | None = None
    chat: ChatOptions | None = None  # chat only; None: the defaults (no tools, a generation prompt)
    # The prompt's token ids on the first Delta (``Delta.prompt_token_ids``):
    # vLLM's ``return_token_ids`` (the generated ids are in every Delta's ``token_ids``).
    return_token_ids: bool = False
    routing: Routing | None = None  # sessions, gateway priorities, latency targets
    # The client's trace (W3C trace context): the router's spans of this
    # request are its children.  None: a new trace, sampled at [tracing]'s ratio.
    trace_context: TraceContext | None = None


class Cancel(_Msg, tag=2):
    request_ids: list[str]


class Outputs(_Msg, tag=3):
    """Deltas for one destination (a client, or the router from a worker),
    batched: every request's news from one engine step / one router turn.
    An empty one to a client is the router checking that it is still there."""

    deltas: list[Delta]


# ---------------------------------------------------------------- worker link


class GpuInfo(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """NVML view of the worker's GPU; ``present=False`` on CPU-only hosts (or
    when NVML fails): "no GPU" is a state, not an error.  A reading the GPU
    does not support (power on some boards) is None."""

    present: bool = False
    name: str = ""
    index: int = 0
    total_bytes: int = 0
    used_bytes: int = 0
    utilization_percent: float | None = None  # NVML's GPU utilisation over its last sample period
    temperature_c: float | None = None
    power_w: float | None = None


class Register(_Msg, tag=10):
    """Worker -> router, first message after connecting (Majordomo READY).

    ``kv_capacity_tokens`` and ``block_size`` are read from the running
    engine, not from config, so admission uses what the engine really has.
    """

    worker_id: str
    model: str
    pool: Pool
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    max_num_seqs: int
    engine: str  # "vllm" | "sim"
    gpu: GpuInfo = msgspec.field(default_factory=GpuInfo)
    # The engine's own timing, for the router's wait prediction before it has
    # measured anything (0: unknown, the router assumes its default).
    step_time_s: float = 0.0  # one step with a full batch
    request_overhead_s: float = 0.0  # engine work per newly admitted request
    # The engine shares the KV blocks of a common prompt prefix (vLLM's prefix
    # caching): the n sequences of one request then hold its prompt once.
    prefix_caching: bool = False
    # The engine reports what its prefix cache holds (PrefixEvents) and hashes
    # blocks with this function ("sha256", "sha256_cbor": vLLM's
    # ``prefix_caching_hash_algo``; "sim": the simulated engine's) seeded with
    # ``prefix_hash_seed`` (vLLM's NONE_HASH seed).  "": no events, the router
    # routes it cache-blind.
    prefix_hash: str = ""
    prefix_hash_seed: str = ""
    # This registration's number: a random non-zero 63-bit value, new with
    # every Register (on a reconnect, after a Goodbye, in a new process).  The
    # router stamps it on each Dispatch; the worker drops a Dispatch stamped
    # with another link's number -- one sent before the router read this
    # Register, whose jobs the router counts lost when it reads it -- so a job
    # never runs there as well as where the router runs it again.  0: none.
    epoch: int = 0


class LoraHeld(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The LoRA adapters a worker's engine holds (engine_worker.lora_cache), by id
    (LoraRef.lora_id): in its slots (``max_loras`` of them: used at no cost)
    and in its host-memory cache beyond those."""

    slot: list[int] = []
    cache: list[int] = []
    slots: int = 0  # max_loras


class WorkerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    preemptions_total: int = 0
    aborts_total: int = 0
    finished_total: int = 0
    gpu_used_bytes: int = 0
    gpu_total_bytes: int = 0
    gpu: GpuInfo | None = None  # this heartbeat's NVML reading (None: a peer that sends none)
    tokens_total: int = 0  # tokens generated since the engine started (rates: weir stats)
    # Held on this worker for *other* routers (its ledger, engine_worker.ledger):
    # KV tokens and sequences the receiving router must count as taken.
    other_tokens: int = 0
    other_seqs: int = 0
    loras: LoraHeld | None = None  # a LoRA worker's adapters (router.policy.adapter_placement); left out if none


class Heartbeat(_Msg, tag=11):
    """Both directions (Paranoid Pirate): liveness plus, from workers, stats."""

    stats: WorkerStats | None = None
    # Worker -> router: the seq of the last PrefixEvents/PrefixSnapshot sent
    # (-1: none).  Messages on the link are ordered, so a router that applied
    # less has lost one (a dropped malformed message) and asks for a resync.
    prefix_seq: int = -1


class Goodbye(_Msg, tag=12):
    """Orderly disconnect, either direction; the peer forgets the sender."""

    reason: str = ""


class LoraRef(msgspec.Struct, array_like=True, gc=False):
    """A LoRA adapter a request runs under (vLLM's LoRARequest): its name, an
    id every router derives alike from name and path (router.lifecycle.adapters),
    and the directory the worker loads it from when it does not hold it."""

    name: str
    lora_id: int
    path: str


class GenerateRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request for an engine, already tokenized by the router (chat
    template applied): ``prompt_token_ids`` for a model with a tokenizer,
    else empty and ``prompt_tokens`` is the router's count (simulated engine)."""

    request_id: str  # router-assigned, unique per router lifetime
    prompt_token_ids: list[int]
    prompt_tokens: int
    params: SamplingParams
    priority: int = 0  # lower runs first (vLLM's convention)
    trace_id: str = ""  # Submit.trace_id (or the router's job id): for the worker's log lines
    # KV tokens the router reserved for it on this worker (router.policy.estimate.kv_cost
    # at the worker's block size); the worker's ledger admits it on this figure.
    # 0: not stated (an older router): the worker prices it itself.
    kv_tokens: int = 0
    # The simulated engine only (it has no token ids): the prompt's block
    # hashes as the router computed them (router.fleet.block_hash), the identities
    # of the blocks its modelled prefix cache holds.
    block_hashes: list[BlockHashInt] = []
    # An embedding (pooling) request: prefill only (``params.max_tokens`` 0);
    # its final Delta carries the vector (``Delta.embedding``) of
    # ``dimensions`` values (0: the model's full width).
    embed: bool = False
    dimensions: int = 0
    # A sampled trace: the router's dispatch span, parent of the worker's spans
    # (and of vLLM's own).  None: not traced.
    trace_context: TraceContext | None = None
    lora: LoraRef | None = None  # run under this adapter of the model (None: the base model)


class Dispatch(_Msg, tag=13):
    requests: list[GenerateRequest]
    epoch: int = 0  # the Register.epoch of the link it was sent on (0: not stated, taken as current)


class Abort(_Msg, tag=14):
    request_ids: list[str]


class Drain(_Msg, tag=15):
    """Worker -> router: stopping (SIGTERM).  Send nothing new; the requests
    it runs finish there, or move elsewhere at the drain timeout; a Goodbye
    follows once it has nothing left."""

    reason: str = ""


class Refuse(_Msg, tag=16):
    """Worker -> router: these dispatched requests were not started -- with
    what other routers hold here they would exceed the worker's KV budget or
    sequence slots.  The router releases and queues them again (a placement
    miss, never a lost request), and counts ``other_*`` as taken from now on."""

    request_ids: list[str]
    other_tokens: int = 0
    other_seqs: int = 0


class PrefixEvents(_Msg, tag=17):
    """Worker -> router: what entered and left its engine's prefix cache since
    the previous PrefixEvents -- the net effect of the engine's KV events
    (vLLM's BlockStored / BlockRemoved / AllBlocksCleared) of one loop turn,
    i.e. about one engine step.  ``cleared``: the cache was emptied first
    (``stored`` then holds all it has since).  ``seq`` counts up by one per
    message (a snapshot included); a gap makes the router distrust the
    worker's entries and ask for a PrefixSnapshot.  ``ts``: the engine's
    wall-clock time of its newest batch (event lag)."""

    seq: int
    stored: list[BlockHashInt] = []
    removed: list[BlockHashInt] = []
    cleared: bool = False
    ts: float = 0.0


class PrefixSnapshot(_Msg, tag=18):
    """Worker -> router: every block its engine's prefix cache holds, after
    Register and when asked (PrefixResync).  ``trusted`` False: the worker does
    not know (its engine's events were lost beyond replay); the router routes
    it cache-blind until a trusted snapshot comes."""

    seq: int
    hashes: list[BlockHashInt] = []
    trusted: bool = True


class PrefixResync(_Msg, tag=19):
    """Router -> worker: send a PrefixSnapshot (the router lost track)."""

    reason: str = ""


class Lost(_Msg, tag=20):
    """Worker -> router: these dispatched requests stopped here and no
    Delta of them will follow (the engine died under them: vLLM's EngineCore
    exited).  The router takes them as a lost worker's (router.lifecycle.recovery):
    queued again, or resumed elsewhere from the tokens it streamed."""

    request_ids: list[str]
    reason: str = ""


ClientToRouter = Submit | Cancel
RouterToClient = Outputs
WorkerToRouter = Register | Heartbeat | Outputs | Drain | Goodbye | Refuse | PrefixEvents | PrefixSnapshot | Lost
RouterToWorker = Dispatch | Abort | Heartbeat | Goodbye | PrefixResync

encoder = msgspec.msgpack.Encoder()
client_decoder = msgspec.msgpack.Decoder(ClientToRouter)
to_client_decoder = msgspec.msgpack.Decoder(RouterToClient)
worker_decoder = msgspec.msgpack.Decoder(WorkerToRouter)
to_worker_decoder = msgspec.msgpack.Decoder(RouterToWorker)
