"""weir's one config file (TOML), as typed msgspec Structs.

Every component reads its settings from here -- the router, each worker, the
launcher, and the Envoy YAML that ``deploy.envoy_config`` renders.  Unknown
keys are errors (``forbid_unknown_fields``) so a typo cannot silently fall
back to a default.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "weir.toml"


class _Cfg(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


def split_hostport(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def client_host(host: str) -> str:
    """Where a local client connects for a server bound to ``host``."""
    if host in ("0.0.0.0", "*", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def zmq_connect_addr(bind_addr: str) -> str:
    """The address a local peer dials for a ZeroMQ socket bound at ``bind_addr``."""
    scheme, _, rest = bind_addr.partition("://")
    if scheme != "tcp":
        return bind_addr
    host, port = split_hostport(rest)
    host = client_host(host)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class EnvoyConfig(_Cfg):
    listen: str = "127.0.0.1:8080"
    # TLS on the listener (both or neither; relative to the config file): PEM files.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    admin: str = "127.0.0.1:9901"
    concurrency: int = 1  # leaves the other core to router + workers
    max_request_bytes: int = 1 << 20  # larger bodies get 413
    stream_idle_timeout_s: float = 300.0  # bounds SSE streams instead of a route timeout
    health_check_interval_s: float = 1.0
    # Envoy's thread watchdogs count a thread stalled this long in
    # server.watchdog_miss (its megamiss: 1 s, or this if longer), and check
    # each thread this often.  Envoy's 200 ms default cost 2.7 ms of CPU a
    # second idle, 1 s costs 1.3 (bench/results/2026-12-02-envoy-watchdog.md).
    watchdog_miss_s: float = 1.0
    access_log: bool = False  # ~40 us per request when on
    # Requests that could not reach a router (connect failure, reset before
    # it got the request) are retried this often with back-off, so one sent
    # during a router restart is served late rather than refused.
    retries: int = 3
    retry_base_s: float = 0.25
    retry_max_s: float = 1.0
    # Concurrent client connections, and concurrent requests to the router
    # (HTTP/1.1: one upstream connection each); beyond -> 503 overflow.
    max_connections: int = 8192


class RateLimitConfig(_Cfg):
    """Envoy local rate limits: a route-wide bucket and one bucket per
    distinct ``x-api-key`` value (refilled continuously)."""

    route_rps: int = 1000
    route_burst: int = 2000
    per_key_rps: int = 100
    per_key_burst: int = 200
    max_keys: int = 10000  # Envoy's max_dynamic_descriptors


class RouterConfig(_Cfg):
    http: str = "127.0.0.1:8001"  # what Envoy proxies to; also /metrics, /admin
    frontend: str = "tcp://127.0.0.1:5555"  # direct ZeroMQ clients
    backend: str = "tcp://127.0.0.1:5556"  # engine workers connect here
    heartbeat_interval_s: float = 1.0
    heartbeat_liveness: int = 3  # missed intervals before a peer is dead
    log_level: str = "info"
    # A request whose worker is lost after it streamed output continues on
    # another worker (prompt + the tokens so far), at most this many times.
    max_resumes: int = 2
    # A worker told to stop (SIGTERM) or drained by an operator takes no new
    # work and has this long to finish what it runs; the rest then resumes elsewhere.
    # A router told to stop (SIGTERM, POST /admin/drain) likewise: no new
    # requests (503 router_draining), the admitted ones finish within this,
    # what still runs then ends with an error event (router/lifecycle/drain.py).
    drain_timeout_s: float = 30.0
    # A dispatched request that hears nothing from its (heartbeating) worker
    # for this long is aborted there and resumed elsewhere.  0: off.  The
    # tiny model's longest step here is ~50 ms, a 2k-token prefill ~0.3 s.
    stall_timeout_s: float = 10.0
    # A completion whose ``prompt`` is a list (strings or token-id lists) runs
    # one job per prompt; a longer list is refused (400, param ``prompt``).
    max_prompts_per_request: int = 128
    # The router's /admin/* (drain, models, reload, views) needs this file's
    # token (``Authorization: Bearer TOKEN``; relative to the config file),
    # except from loopback without a token (`weir up`, the CLI on the host).
    # "": no token -- /admin/* answers loopback only.  Kubernetes: a Secret.
    admin_token_file: str = ""
    # HOST:PORT of a second listener serving only /admin/*, /metrics and
    # /health, so a firewall or NetworkPolicy can give the API port to Envoy
    # alone (the rendered Kubernetes manifests do).  "": those stay on ``http`` only.
    admin_http: str = ""
    # Long /tokenize and /detokenize calls waiting for the tokenizer threads,
    # per tenant and in all; more are refused (503 tokenizer_busy, Retry-After).
    tokenize_queue_per_tenant: int = 32
    tokenize_queue_max: int = 256
    # Threads tokenizing long prompts and calls at once (``tokenizers``
    # releases the GIL: they scale with cores), plus one kept for short
    # prompts; calls use at most half.  0: one per core this process may run
    # on (its CPU affinity, capped by its cgroup's CPU quota), at least 2.
    tokenize_threads: int = 0


class LoggingConfig(_Cfg):
    """Log lines of the router and the workers (shared/logs.py)."""

    format: Literal["text", "json"] = "text"  # json: one object per line, for log shippers
    # One line per finished request (its request id, model, outcome, tokens,
    # seconds) from the router, and one from the worker that ran it.  Off by
    # default: measured 37 us (text) / 59 us (json) per line on this VM, against
    # the router's ~150-200 us of CPU per request.
    requests: bool = False


class TracingConfig(_Cfg):
    """OpenTelemetry traces from every component (docs/operating.md#tracing):
    Envoy's tracer, the router, the workers and vLLM export spans over OTLP to
    one collector.  Off unless ``endpoint`` is set."""

    endpoint: str = ""  # HOST:PORT of an OTLP collector (4317: grpc, 4318: http); "": off
    protocol: Literal["grpc", "http"] = "grpc"  # http: OTLP/HTTP protobuf, POST /v1/traces
    # A request without a sampled parent (a client's traceparent) is traced
    # with this probability, decided once at the edge (Envoy, or the router
    # for a direct client) and followed by every component after it.
    sampling_ratio: float = 0.01
    envoy_service: str = "weir-envoy"
    router_service: str = "weir-router"
    worker_service: str = "weir-worker"
    engine_service: str = "vllm"  # vLLM's own request spans (--otlp-traces-endpoint)
    # Spans waiting for export per process; beyond it (a collector that is
    # down or slow) new ones are dropped and counted, never waited for.
    max_queued_spans: int = 8192
    export_timeout_s: float = 2.0

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


class RouterEndpoint(_Cfg):
    """One router process of several (``[[routers]]``): its own three listen
    addresses.  The settings in ``[router]`` apply to all of them."""

    http: str
    frontend: str
    backend: str
    # Where workers dial this router's backend (default: ``backend`` itself,
    # with a wildcard host read as loopback); a worker's own ``routers`` list wins.
    worker_connect: str | None = None

    def dial(self) -> str:
        return self.worker_connect or zmq_connect_addr(self.backend)


class Budgets(_Cfg):
    """Token and request budgets (router/tenancy/budgets.py): None = unlimited.  Reserved
    at admission (prompt + max_tokens), settled on the engine's usage."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    # Tokens of batch lines (router/services/batch/) per day, on top of the budgets
    # above; [[tenants]] only.  Exhausted: the tenant's batches wait.
    batch_tokens_per_day: int | None = None
    # Storage of the Batch API, per tenant (router/services/batch/storage.py): files
    # kept, their bytes, batches not yet ended.  None: the [batch] default;
    # set on a key and on its tenant, the smaller applies.
    max_stored_files: int | None = None
    max_stored_file_bytes: int | None = None
    max_active_batches: int | None = None
    # LoRA adapters its requests may name (None: every adapter); set on a key
    # and on its tenant, both apply.  Any other adapter is a 404 to it.
    adapters: list[str] | None = None


class ApiKey(Budgets, kw_only=True):
    # Exactly one of the two: the key's SHA-256 (hex; `weir keys new` makes
    # one), or the key itself in plain text (still loads, with a warning).
    key_sha256: str | None = None
    key: str | None = None
    tenant: str
    tier: str = "normal"  # a scheduler class name
    weight: float = 1.0  # fair-share weight inside its class
    # Envoy per-key bucket for this key only (default: rate_limit.per_key_*);
    # needs the plain ``key`` (Envoy matches header values).
    rate_limit_rps: int | None = None
    rate_limit_burst: int | None = None


class TenantConfig(Budgets, kw_only=True):
    """Budgets shared by all of a tenant's keys (on top of each key's own)."""

    name: str
    # This tenant's own stored-responses bounds (default: [responses] max_stored / max_bytes).
    responses_max_stored: int | None = None
    responses_max_bytes: int | None = None


class QuotaConfig(_Cfg):
    store: Literal["memory", "redis"] = "memory"  # memory: this router alone
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "weir:quota:"
    redis_timeout_s: float = 0.25
    # Budget store unreachable: "open" admits (logged, counted in
    # weir_quota_store_errors), "closed" refuses with 503 quota_unavailable.
    on_store_error: Literal["open", "closed"] = "open"


class ResponsesConfig(_Cfg):
    """/v1/responses: where stored responses live (router/services/response_store.py)."""

    # memory: this router alone; redis: shared by every router naming it
    # (the [quota] Redis: redis_url and redis_timeout_s there).
    store: Literal["memory", "redis"] = "memory"
    redis_prefix: str = "weir:responses:"
    # Per tenant (a [[tenants]] entry may set its own: responses_max_stored,
    # responses_max_bytes): beyond either, that tenant's oldest is evicted,
    # never another tenant's.
    max_stored: int = 10_000
    max_bytes: int = 64 << 20
    max_age_s: float = 3600.0  # older: gone (404), as if deleted
    max_stored_bytes: int = 1 << 20  # one response + its conversation; larger: served, not stored


class SecurityConfig(_Cfg):
    """CURVE on the router's two ZeroMQ planes (`weir keys curve DIR` makes
    the keys): only the public keys in ``curve_dir``/clients (frontend) and
    ``curve_dir``/workers (backend) are let in."""

    curve: bool = False
    curve_dir: str = "curve"  # relative to the config file


class LoraConfig(_Cfg):
    """LoRA on a model's vLLM workers (vLLM's --enable-lora and its bounds).
    On CPU every slot costs max_lora_rank x the layers' widths of host memory,
    so the bounds are small by default."""

    max_loras: int = 2  # adapters in one engine step (vLLM's GPU slots)
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16  # vLLM's allowed ranks
    max_cpu_loras: int = 8  # adapters kept loaded in host memory (>= max_loras): LRU beyond


class AdapterConfig(_Cfg):
    """A LoRA adapter (PEFT's format: adapter_config.json + adapter_model.safetensors)
    served beside its base model: a request whose ``model`` is ``name`` runs on
    ``base``'s workers with the adapter applied."""

    name: str
    base: str  # a [[models]] name (a vLLM generation model)
    path: str  # the adapter's directory; relative to the config file


class ModelConfig(_Cfg):
    name: str
    engine: Literal["vllm", "sim"] = "vllm"
    path: str | None = None  # model directory (vllm); relative to the config file
    max_model_len: int = 512
    # Models that may answer instead when this one has no worker or no room
    # (no worker, queue full, predicted wait over the bound, queue deadline),
    # in order -- only for requests that allow it (``fallback``).
    fallbacks: list[str] = []
    # "generate": completions and chat; "embed": a pooling model that serves
    # /v1/embeddings only (vLLM's runner="pooling"; the simulated engine
    # answers with a deterministic placeholder vector).
    task: Literal["generate", "embed"] = "generate"
    # Tool calling (as vLLM's --tool-call-parser / --enable-auto-tool-choice):
    # the format the model writes tool calls in; without it, a request whose
    # tool_choice needs parsing gets 400.  docs/api.md#tool-calling
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (the default with tools) parses calls
    # LoRA adapters on this model's workers (with its defaults when [[adapters]]
    # name the model and this is unset); set it to add adapters at run time.
    lora: LoraConfig | None = None


class AliasTarget(_Cfg):
    model: str
    weight: float = 1.0  # its share of the alias's requests, against the other targets' weights


class AliasConfig(_Cfg):
    """One public model name over served models (router/api/aliases.py): a
    request for ``name`` goes to one of ``targets``, drawn by weight (a
    session's requests to the same one), and, when that one has no worker
    or no room (the refusals a model's ``fallbacks`` answer), to each of
    ``fallbacks`` in order.  The response names the model that served it."""

    name: str
    targets: list[AliasTarget]
    fallbacks: list[str] = []


class SimEngineConfig(_Cfg):
    """Parameters of the simulated continuous-batching engine (see
    engine_worker/sim_model.py).  Calibrated against vLLM on the tiny model:
    see that module's docstring."""

    kv_capacity_tokens: int = 65536
    block_size: int = 16
    step_fixed_ms: float = 2.3  # per engine step, whatever it holds
    prefill_token_us: float = 5.0  # per prompt token in the step
    decode_token_us: float = 60.0  # per running sequence decoded in the step
    max_prefill_tokens: int = 2048  # chunked-prefill budget per step
    zero_cost: bool = False  # no sleeping at all: measures pure dataplane overhead
    admit_request_us: float = 1100.0  # per request newly admitted in the step (frontend/tokenizer work)
    # A prefix cache after vLLM's (engine_worker/sim_model.py): prompt blocks named by
    # the router's hashes (GenerateRequest.block_hashes) stay cached after
    # their request ends, LRU-evicted when blocks run out; cached tokens skip
    # prefill; the engine reports them as vLLM's KV events do.
    prefix_caching: bool = False


class WorkerConfig(_Cfg):
    id: str
    model: str
    pool: Literal["any", "short", "long"] = "any"
    max_num_seqs: int = 16
    max_model_len: int | None = None  # default: the model's
    kv_cache_bytes: int | None = 64 << 20  # vllm on CPU; 0 on GPU: vLLM sizes KV by gpu_memory_utilization
    gpu_index: int | None = None  # None: no GPU (NVML reports absent)
    gpu_memory_utilization: float = 0.9
    dtype: str = "bfloat16"
    sim: SimEngineConfig = msgspec.field(default_factory=SimEngineConfig)
    env: dict[str, str] = {}  # extra environment for the worker and its engine processes
    # CURVE secret key file (default: security.curve_dir/workers/<id>.key_secret)
    curve_secret_key: str | None = None
    # Before registering (so before it gets any real request) the worker runs
    # one short generation through its engine (engine_worker/warmup.py);
    # a warm-up that fails or outlasts warmup_timeout_s stops the worker (exit 1).
    warmup: bool = True
    warmup_timeout_s: float = 120.0
    # The routers' backend addresses this worker dials, one link each (default:
    # every router of the config, ``RouterEndpoint.dial``).  A worker on
    # another host needs only these and its CURVE key.  An address given by
    # DNS name stands for every address the name resolves to (a Kubernetes
    # headless Service: every router pod): one link each, resolved again every
    # discovery_interval_s and when a link is lost (engine_worker/discovery.py).
    # 0: the name is one link, resolved once by ZeroMQ.
    routers: list[str] = []
    discovery_interval_s: float = 5.0


class ClassConfig(_Cfg):
    name: str
    # A request is queued only if its predicted queue wait (work queued ahead
    # of it over the measured drain rate: router/policy/wait_model.py) is within this
    # bound; else 429 at once, Retry-After = when to come back.  None: the
    # class's queue_deadline_s.  <= 0 (or no deadline): no wait bound.
    max_predicted_wait_s: float | None = None
    queue_deadline_s: float = 60.0  # waited longer -> 503
    # Queued requests of this class per model; beyond -> 429 queue_full.
    # Memory protection only (~1 KB a queued request in the router), far
    # above what the wait bound admits on a fleet of any size.
    max_queue: int = 200_000
    # Latency targets (router/policy/targets.py): the class's TTFT target for
    # requests that state none (0: none), and whether a request of the class
    # predicted to miss its target is refused at once (429
    # latency_target_unattainable) rather than served late.
    ttft_target_ms: float = 0.0
    sheddable: bool = False
    tpot_target_ms: float = 0.0  # the class's time-per-output-token target (0: none)


class SchedulerConfig(_Cfg):
    policy: Literal["weir", "fifo"] = "weir"
    classes: list[ClassConfig] = msgspec.field(
        default_factory=lambda: [ClassConfig(name=n) for n in ("critical", "high", "normal", "low", "batch")]
    )
    aging_bound_s: float = 60.0  # no class waits longer than this behind others
    short_threshold_tokens: int = 1024  # estimated prompt+max_tokens
    short_share: int = 3  # weighted share short:long when both wait
    long_share: int = 1
    borrow_idle_long: bool = True  # short work may use an idle long worker
    kv_safety_margin: float = 0.0  # reserve at most capacity * (1 - margin)
    overcommit: float = 1.0  # >1 lets reservations exceed capacity
    gpu_free_floor_bytes: int = 0  # a GPU with less free memory gets no new work
    # A GPU at or over this temperature (NVML, degrees C), or with at least
    # this fraction of its memory used, gets no new work until a heartbeat
    # reads it under again (router/policy/gpu_gate.py).  0: off.
    gpu_max_temperature_c: float = 0.0
    gpu_max_memory_fraction: float = 0.0
    # Queued requests per tenant, all classes; beyond -> 429 tenant_queue_full.
    # Memory protection only: fairness between tenants is the wait bound's
    # weighted share (router/policy/wait_model.py), and a tenant alone may use all of it.
    max_queue_per_tenant: int = 200_000
    generation_deadline_s: float = 600.0
    backfill: bool = True
    # Class headroom: class rank r of K may fill a worker's KV budget and seq
    # slots only up to 1 - priority_headroom * (r - top)/(K-1), top = highest
    # class active within aging_bound_s, so higher classes start at once under
    # overload (router/policy/placement/filters.py).  0.2: measured in simulation/des.py.
    priority_headroom: float = 0.2
    # Jobs a worker may hold beyond its engine's max_num_seqs.  0: every
    # waiting job waits here, under this policy.  k > 0: up to k wait inside
    # the engine (vLLM orders them by the priority passed on), so a finished
    # sequence's slot is refilled at the engine's next step rather than after
    # a worker -> router -> worker round trip; their KV is reserved all the
    # same.  Worth it where a hop is long next to an engine step (bench/README.md).
    dispatch_lookahead: int = 0
    # Prefix-cache affinity (router/fleet/prefix_index.py; README "Scheduling").  A
    # job whose prompt blocks a worker's cache holds prefers that worker, but
    # only among the workers that can take it now whose load score (KV budget
    # left + seq slots left, fractions: 0..2) is within prefix_load_margin of
    # the least loaded one's, so a hot prefix spreads once its worker fills.
    prefix_affinity: bool = True
    prefix_affinity_weight: float = 1.0  # score per unit of cached prompt fraction
    prefix_load_margin: float = 0.25
    prefix_index_max_blocks: int = 1_000_000  # index entries per model (LRU beyond)
    prefix_speculative_ttl_s: float = 2.0  # a dispatched prompt's blocks count as cached until confirmed
    # "round_robin": the next feasible worker in id order after the last one
    # dispatched to, instead of the least loaded: a baseline for benchmarks
    # (bench/scenarios/prefix.py), not for serving.
    placement: Literal["least_loaded", "round_robin"] = "least_loaded"
    # Session affinity (router/policy/sessions.py): a session's turns go to its
    # worker while it holds under session_load_bound of its sequence slots and
    # KV budget, else where placement sends them (the session moves there).
    # Forgotten session_ttl_s after its last turn, or after a final one;
    # at most session_max_per_tenant sessions of a tenant (its least recently
    # used beyond) and session_max in all (the tenant with the most gives one up).
    sessions: bool = True
    session_ttl_s: float = 600.0
    session_max: int = 100_000
    session_max_per_tenant: int = 10_000  # beyond: that tenant's own oldest session is forgotten
    session_load_bound: float = 0.8
    # Header names a session id may come in besides the built-in ones
    # (router/api/agent_headers.py SESSION_HEADERS), read after them in this
    # order: lower-case HTTP header names, e.g. ["x-my-agent-session"].
    session_headers: list[str] = []
    # LoRA adapters (router/policy/adapter_placement.py): a job under an adapter
    # prefers a worker holding it, then one with a free adapter slot; a worker
    # takes a job whose adapter it must load only while fewer than this many
    # such loads are in flight there.
    adapter_affinity: bool = True
    adapter_loads_in_flight: int = 1
    # Added to the predicted wait of a job whose adapter no worker of its model
    # holds: one load from disk into an engine (the tiny adapter on CPU: ~50 ms).
    adapter_load_s: float = 0.2

    def kv_budget(self, capacity_tokens: int) -> int:
        """A worker's KV budget: what the router's policy reserves against and
        the worker's own ledger (engine_worker.ledger) enforces, one formula."""
        return int(capacity_tokens * (1.0 - self.kv_safety_margin) * self.overcommit)

    def seq_slots(self, max_num_seqs: int) -> int:
        """Sequences (jobs) a worker may hold at once."""
        return max_num_seqs + max(0, self.dispatch_lookahead)


class KubernetesConfig(_Cfg):
    """What ``deploy/k8s.py`` renders under deploy/k8s/ (README: Operating
    weir): every other setting there comes from the rest of this file."""

    namespace: str = "weir"
    image: str = "weir:0.1.0"  # the Containerfile's image, ENGINE=cpu
    gpu_image: str = "weir:0.1.0-gpu"  # ENGINE=gpu: the GPU overlay's
    envoy_replicas: int = 2
    router_replicas: int = 2  # >= 2: a PodDisruptionBudget keeps one
    # A terminating router or Envoy pod keeps serving this long (preStop)
    # before it drains, while Endpoints, DNS, kube-proxy and Envoy's health
    # checks stop sending it new work; its grace period adds the drain timeout.
    endpoint_propagation_s: int = 5
    models_claim: str = "weir-models"  # PVC (ReadOnlyMany) with [[models]] under /models/<name>
    # PVC (ReadWriteMany) the router pods keep the Batch API's files and batch
    # state on ([batch] directory, mounted at /var/lib/weir/batches): batches
    # outlive a router pod and every replica answers for every file.  "": an
    # emptyDir per pod instead -- batches are lost with their pod (a demo).
    batch_claim: str = "weir-batches"
    # vLLM workers' startupProbe budget: model load + compile (the tiny model
    # ~16-25 s on an idle CPU; a 70B model from network storage: minutes).
    model_load_timeout_s: int = 900
    # Autoscaling (KEDA ScaledObject per worker StatefulSet).  Demand is the
    # model's queued + running requests over max_num_seqs * this fraction.
    min_workers: int = 1
    max_workers: int = 8
    target_slot_utilization: float = 0.8
    gpu_utilization_target_percent: float = 80.0  # GPU overlay: second trigger
    scale_up_window_s: int = 30  # short: a queue building up gets capacity at once
    scale_down_window_s: int = 600  # long: no flapping after a burst
    polling_interval_s: int = 15
    prometheus_url: str = "http://prometheus.monitoring.svc:9090"
    monitoring_namespace: str = "monitoring"  # may scrape routers and Envoy
    # Without [[api_keys]] the rendering is refused (an open cluster: one
    # anonymous tenant for every client in reach) unless this says so.
    allow_anonymous: bool = False
    # Scheduled pre-scaling (CronJob patches the ScaledObjects' floor):
    prescale_schedule: str = "30 7 * * 1-5"  # before the weekday peak
    prescale_min_workers: int = 2
    prescale_end_schedule: str = "0 19 * * 1-5"


class BatchConfig(_Cfg):
    """The Batch API (/v1/files, /v1/batches; router/services/batch/): offline work in
    the lowest scheduler class, fed in only as fast as slots free up."""

    enabled: bool = True
    # Files and batch state (relative to the config file).  Several routers
    # running batches share it (one host, or a shared filesystem + Redis).
    directory: str = "~/.local/state/weir/batches"
    # An upload over this is refused (413).  The router writes an upload to
    # disk as it arrives (never whole in memory); Envoy streams it through.
    max_file_bytes: int = 100 << 20
    # Each result file of a batch (output, errors) may grow to this; a batch whose
    # results would pass it fails alone (results_too_large), what it wrote kept.
    max_result_bytes: int = 1 << 30
    completion_windows: list[str] = msgspec.field(default_factory=lambda: ["24h"])  # may ask for (<n>s|m|h|d)
    # Lines of one batch in the router at once (queued + running), and how
    # many of them wait queued for a free slot; the rest of the file stays on disk.
    max_in_flight: int = 256
    queued_target: int = 16
    lease_ttl_s: float = 10.0  # [quota] store = "redis": a dead holder's batches move after this
    scan_interval_s: float = 0.5  # new batches, cancels, leases, state saved
    retry_s: float = 1.0  # a line refused for room (429/503) waits at least this long
    # Interactive work waiting for room while batch lines run on its model:
    # the newest batch lines leave their workers and resume later (router/services/batch/service.py).
    preempt: bool = True
    # Weight of queued/running batch lines in the autoscaling demand (deploy/k8s_scaling.py).
    # 0: batch work never adds workers; it fills idle ones.
    autoscale_weight: float = 0.0
    # Per tenant (a [[tenants]] or [[api_keys]] entry may set its own): files
    # kept (uploads and results), their bytes, and batches not yet ended.
    # Beyond: 429 (count, active batches) or 413 (bytes).
    max_stored_files: int = 10_000
    max_stored_file_bytes: int = 10 << 30
    max_active_batches: int = 100
    # A batch that ended is kept (GET /v1/batches/{id}) this long, then its
    # directory is deleted; its files follow their own expires_at.
    finished_retention_s: float = 30 * 86400.0
    # How often expired files and old batches are deleted and the per-tenant
    # index re-reads the directory (another router's uploads and deletions).
    housekeeping_interval_s: float = 5.0


class Config(_Cfg):
    envoy: EnvoyConfig = msgspec.field(default_factory=EnvoyConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    # Several routers over one fleet (README: Scaling out): each entry is one
    # router process; every worker links to all of them.  Empty: one router
    # at [router]'s http/frontend/backend.
    routers: list[RouterEndpoint] = []
    rate_limit: RateLimitConfig = msgspec.field(default_factory=RateLimitConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    api_keys: list[ApiKey] = []
    tenants: list[TenantConfig] = []
    quota: QuotaConfig = msgspec.field(default_factory=QuotaConfig)
    responses: ResponsesConfig = msgspec.field(default_factory=ResponsesConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    models: list[ModelConfig] = []
    aliases: list[AliasConfig] = []
    adapters: list[AdapterConfig] = []  # LoRA adapters of the models (docs/operating.md#lora-adapters)
    workers: list[WorkerConfig] = []
    kubernetes: KubernetesConfig = msgspec.field(default_factory=KubernetesConfig)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    base_dir: str = ""  # set by load(): relative paths resolve against it

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def lora(self, model: ModelConfig) -> LoraConfig | None:
        """The LoRA bounds of ``model``'s workers; None: LoRA off there."""
        if model.lora is not None:
            return model.lora
        return LoraConfig() if any(a.base == model.name for a in self.adapters) else None

    def router_endpoints(self) -> list[RouterEndpoint]:
        if self.routers:
            return list(self.routers)
        r = self.router
        return [RouterEndpoint(http=r.http, frontend=r.frontend, backend=r.backend)]

    def for_router(self, index: int) -> Config:
        """This config as router ``index`` of ``[[routers]]`` runs it: [router]
        with that entry's three addresses."""
        ep = self.router_endpoints()[index]
        return msgspec.structs.replace(
            self, router=msgspec.structs.replace(self.router, http=ep.http, frontend=ep.frontend, backend=ep.backend)
        )

    def worker_backends(self, wcfg: WorkerConfig) -> list[str]:
        return list(wcfg.routers) or [ep.dial() for ep in self.router_endpoints()]

    def worker(self, worker_id: str) -> WorkerConfig:
        for w in self.workers:
            if w.id == worker_id:
                return w
        raise KeyError(worker_id)

    def resolve(self, path: str) -> str:
        return str((Path(self.base_dir) / os.path.expanduser(path)).resolve())


class ConfigError(ValueError):
    pass


# Headers that carry a credential: never read as anything else (a session id is kept in tables).
_CREDENTIAL_HEADERS = frozenset(("authorization", "proxy-authorization", "x-api-key", "cookie"))


def _validate(cfg: Config) -> None:
    names = [m.name for m in cfg.models]
    if len(set(names)) != len(names):
        raise ConfigError("duplicate model names")
    ids = [w.id for w in cfg.workers]
    if len(set(ids)) != len(ids):
        raise ConfigError("duplicate worker ids")
    if cfg.router.max_prompts_per_request < 1:
        raise ConfigError("router.max_prompts_per_request must be at least 1")
    if cfg.router.tokenize_queue_per_tenant < 1 or cfg.router.tokenize_queue_max < 1:
        raise ConfigError("router.tokenize_queue_per_tenant and tokenize_queue_max must be at least 1")
    if cfg.router.tokenize_threads < 0:
        raise ConfigError("router.tokenize_threads must be 0 (one per core) or more")
    classes = {c.name for c in cfg.scheduler.classes}
    for m in cfg.models:
        # A simulated engine must never answer under a real model's name.
        if m.engine == "sim" and not m.name.startswith("sim-"):
            raise ConfigError(f"sim model {m.name!r}: simulated models must be named 'sim-...'")
        if m.engine == "vllm" and not m.path:
            raise ConfigError(f"vllm model {m.name!r} needs a path")
        if m.enable_auto_tool_choice and m.tool_call_parser is None:
            raise ConfigError(f"model {m.name!r}: enable_auto_tool_choice needs a tool_call_parser")
    for m in cfg.models:
        for fb in m.fallbacks:
            if fb not in names or fb == m.name:
                raise ConfigError(f"model {m.name!r}: fallback {fb!r} is not another configured model")
            if cfg.model(fb).task != m.task:
                raise ConfigError(f"model {m.name!r}: fallback {fb!r} serves another task ({cfg.model(fb).task})")
    _validate_adapters(cfg, names)
    if cfg.scheduler.adapter_loads_in_flight < 1:
        raise ConfigError("scheduler.adapter_loads_in_flight must be at least 1")
    for w in cfg.workers:
        if w.model not in names:
            raise ConfigError(f"worker {w.id!r} serves unknown model {w.model!r}")
    aliases = [a.name for a in cfg.aliases]
    if len(set(aliases)) != len(aliases) or set(aliases) & set(names):
        raise ConfigError("[[aliases]]: an alias name is used twice, or is a model's name")
    for a in cfg.aliases:
        if not a.targets or any(t.weight <= 0 for t in a.targets):
            raise ConfigError(f"alias {a.name!r}: needs targets, each with a weight above 0")
        for target in [*(t.model for t in a.targets), *a.fallbacks]:
            if target not in names:
                raise ConfigError(f"alias {a.name!r}: {target!r} is not a configured model")
    sc = cfg.scheduler
    if not (0.0 < sc.session_load_bound <= 1.0) or sc.session_ttl_s <= 0:
        raise ConfigError("scheduler: session_load_bound must be in (0, 1] and session_ttl_s > 0")
    if min(sc.session_max, sc.session_max_per_tenant) < 1:
        raise ConfigError("scheduler: session_max and session_max_per_tenant must be >= 1")
    for name in sc.session_headers:
        # an HTTP token, lower-case (as the router matches them); never a credential
        if not re.fullmatch(r"[a-z0-9!#$%&'*+.^_`|~-]+", name) or name in _CREDENTIAL_HEADERS:
            raise ConfigError(
                f"scheduler.session_headers: {name!r} must be a lower-case HTTP header name, not a credential's"
            )
    if any(c.ttft_target_ms < 0 for c in sc.classes):
        raise ConfigError("scheduler.classes: ttft_target_ms must be >= 0 (0: none)")
    if any(c.tpot_target_ms < 0 for c in sc.classes):
        raise ConfigError("scheduler.classes: tpot_target_ms must be >= 0 (0: none)")
    for k in cfg.api_keys:
        where = f"api key of tenant {k.tenant!r}"
        if k.tier not in classes:
            raise ConfigError(f"{where}: unknown tier {k.tier!r}")
        if (k.key is None) == (k.key_sha256 is None):
            raise ConfigError(f"{where}: give exactly one of key_sha256 (preferred) or key")
        if k.key is not None and not re.fullmatch(r"[\x21-\x7e]+", k.key):  # shared.keys.well_formed
            raise ConfigError(f"{where}: a key must be printable ASCII without spaces")
        if k.key_sha256 is not None:
            h = k.key_sha256
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h.lower()):
                raise ConfigError(f"{where}: key_sha256 must be 64 hex digits")
            if k.rate_limit_rps is not None or k.rate_limit_burst is not None:
                raise ConfigError(
                    f"{where}: rate_limit_rps/burst need the plain key (Envoy matches "
                    f"header values); use requests_per_minute for a hashed key"
                )
    tenants = [t.name for t in cfg.tenants]
    if len(set(tenants)) != len(tenants):
        raise ConfigError("duplicate [[tenants]] names")
    for b in [*cfg.api_keys, *cfg.tenants]:
        for f in ("requests_per_minute", "tokens_per_minute", "tokens_per_day", "batch_tokens_per_day"):
            v = getattr(b, f)
            if v is not None and v < 1:
                raise ConfigError(f"{f} = {v}: must be >= 1 (leave it out for no limit)")
    for field in ("http", "frontend", "backend"):
        addrs = [getattr(ep, field) for ep in cfg.routers]
        if len(set(addrs)) != len(addrs):
            raise ConfigError(f"[[routers]]: two routers share the {field} address")
    for w in cfg.workers:
        if w.discovery_interval_s < 0:
            raise ConfigError(f"worker {w.id!r}: discovery_interval_s must be >= 0 (0: off)")
    bc = cfg.batch
    for window in bc.completion_windows:
        if not re.fullmatch(r"[1-9][0-9]{0,6}[smhd]", window):
            raise ConfigError(f"batch.completion_windows: {window!r} is not <n>s, <n>m, <n>h or <n>d")
    if bc.max_in_flight < 1 or bc.queued_target < 1 or bc.max_file_bytes < 1:
        raise ConfigError("batch.max_in_flight, queued_target and max_file_bytes must be >= 1")
    if bc.max_result_bytes < 1:
        raise ConfigError("batch.max_result_bytes must be >= 1")
    limits = [("[batch]", bc), *((f"api key of tenant {k.tenant!r}", k) for k in cfg.api_keys)]
    for where, lim in [*limits, *((f"tenant {t.name!r}", t) for t in cfg.tenants)]:
        for f in ("max_stored_files", "max_stored_file_bytes", "max_active_batches"):
            v = getattr(lim, f)
            if v is not None and v < 0:
                raise ConfigError(f"{where}: {f} = {v}: must be >= 0")
    if bc.finished_retention_s < 0 or bc.housekeeping_interval_s <= 0:
        raise ConfigError("batch.finished_retention_s must be >= 0 and housekeeping_interval_s > 0")
    if cfg.responses.max_stored < 1 or cfg.responses.max_age_s <= 0:
        raise ConfigError("[responses] max_stored must be >= 1 and max_age_s > 0")
    if cfg.router.admin_http and len(cfg.routers) > 1:
        raise ConfigError("router.admin_http is one address: it cannot serve several [[routers]] on one host")
    for t in cfg.tenants:
        for f in ("responses_max_stored", "responses_max_bytes"):
            v = getattr(t, f)
            if v is not None and v < 1:
                raise ConfigError(f"tenant {t.name!r}: {f} = {v}: must be >= 1 (leave it out for [responses]'s)")
    if cfg.responses.max_bytes < 1:
        raise ConfigError("[responses] max_bytes must be >= 1")
    if (cfg.envoy.tls_cert_file is None) != (cfg.envoy.tls_key_file is None):
        raise ConfigError("envoy.tls_cert_file and envoy.tls_key_file go together")
    _validate_tracing(cfg.tracing)


def _validate_tracing(t: TracingConfig) -> None:
    if not 0.0 <= t.sampling_ratio <= 1.0:
        raise ConfigError(f"tracing.sampling_ratio = {t.sampling_ratio!r}: must be within 0..1")
    if t.max_queued_spans < 1 or t.export_timeout_s <= 0:
        raise ConfigError("tracing.max_queued_spans must be >= 1 and export_timeout_s > 0")
    if t.endpoint:
        try:
            host, port = split_hostport(t.endpoint)
        except ValueError:
            host, port = "", 0
        if not host or not 0 < port < 65536:
            raise ConfigError(f"tracing.endpoint = {t.endpoint!r}: expected HOST:PORT of an OTLP collector")


def adapter_problem(a: AdapterConfig, base: ModelConfig | None, taken: set[str]) -> str | None:
    """Why ``a`` cannot be served on ``base`` (None: it can); ``taken``: model and adapter names in use."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}", a.name):
        return f"adapter {a.name!r}: a name is 1-128 letters, digits and ._:/-"
    if a.name in taken:
        return f"adapter {a.name!r}: the name is already a model's or an adapter's"
    if base is None:
        return f"adapter {a.name!r}: base {a.base!r} is not a model served"
    if base.engine != "vllm" or base.task != "generate":
        return f"adapter {a.name!r}: base {a.base!r} is not a vLLM generation model"
    if not a.path:
        return f"adapter {a.name!r} needs a path"
    return None


def _validate_adapters(cfg: Config, names: list[str]) -> None:
    taken = set(names)
    for a in cfg.adapters:
        why = adapter_problem(a, next((m for m in cfg.models if m.name == a.base), None), taken)
        if why is not None:
            raise ConfigError(why)
        taken.add(a.name)
    for m in cfg.models:
        lc = m.lora
        if lc is None:
            continue
        if m.engine != "vllm" or m.task != "generate":
            raise ConfigError(f"model {m.name!r}: lora needs a vLLM generation model")
        if not 1 <= lc.max_loras <= 64 or not lc.max_loras <= lc.max_cpu_loras <= 1024:
            raise ConfigError(
                f"model {m.name!r}: lora needs 1 <= max_loras <= max_cpu_loras, max_loras <= 64, max_cpu_loras <= 1024"
            )


validate = _validate  # a Config built in code (router/observe/views.py: a model added at run time)


def load(path: str | os.PathLike[str] | None = None) -> Config:
    path = Path(path or os.environ.get("WEIR_CONFIG") or DEFAULT_CONFIG).resolve()
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    raw.setdefault("base_dir", str(path.parent))
    try:
        cfg = msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {e}") from None
    _validate(cfg)
    return cfg


def loads(text: str, base_dir: str = ".") -> Config:
    raw = tomllib.loads(text)
    raw.setdefault("base_dir", str(Path(base_dir).resolve()))
    try:
        cfg = msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(str(e)) from None
    _validate(cfg)
    return cfg
