"""What the policy is told and what it answers: the job and worker it is
given, the actions it returns, and the constants its decisions use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from shared.config import SimEngineConfig
from shared.errors import Refusal
from shared.protocol import Pool, TaskType

SHORT, LONG = 0, 1
SIZE_NAMES = ("short", "long")

NO_WORKER_RETRY_S = 2.0  # nothing to drain: a worker registering is what is awaited
RATE_TAU_S = 30.0  # memory of the drain-rate estimate, in seconds of backlog
# The capacity model (from what engines registered with) counts as PRIOR_S
# seconds of measured backlog, fading as releases are seen (RateMeter): it
# decides a burst on a cold fleet alone.
PRIOR_S = 5.0
PRIOR_JOBS = 8.0
# Engine step time when a worker does not report one: the sim engine's
# calibration on the tiny model (shared/config.py SimEngineConfig, measured
# against vLLM's CPU build): 2.3 ms a step + 60 us per running sequence, i.e.
# 3.3 ms at 16 sequences (vLLM measured 3.30 ms).
DEFAULT_STEP_FIXED_S = SimEngineConfig().step_fixed_ms / 1e3
DEFAULT_STEP_PER_SEQ_S = SimEngineConfig().decode_token_us / 1e6
DEFAULT_PREFILL_TOKEN_S = SimEngineConfig().prefill_token_us / 1e6
# ... and each new request costs the engine 1.1 ms of serial work (vLLM's
# frontend tokenizes and ships it to its EngineCore), which every running
# sequence waits for.
DEFAULT_REQUEST_S = SimEngineConfig().admit_request_us / 1e6
MIN_RETRY_S, MAX_RETRY_S = 1.0, 3600.0
# Placement: up to this many workers of a model, score each one; beyond,
# score PLACE_SAMPLE drawn from those with a free slot below the job's class
# cap (bench/scenarios/placement.py: the per-request cost then stays flat
# from 16 to 1,024 workers).
PLACE_SCAN_ALL = 16
PLACE_SAMPLE = 4

# Plain ints for the hot loops (an IntEnum attribute lookup costs more than the compare).
POOL_ANY, POOL_SHORT, POOL_LONG = int(Pool.ANY), int(Pool.SHORT), int(Pool.LONG)


@dataclass(slots=True)
class WorkerSpec:
    """What a worker registered with."""

    worker_id: str
    model: str
    pool: Pool
    capacity_tokens: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    gpu_total_bytes: int = 0  # 0 = no GPU / unknown
    # Seconds of one engine step with a full batch (max_num_seqs running), for
    # the wait prediction before anything was measured.  None: the sim
    # calibration, DEFAULT_STEP_FIXED_S + DEFAULT_STEP_PER_SEQ_S x max_num_seqs.
    step_time_s: float | None = None
    request_overhead_s: float | None = None  # engine time per new request; None: DEFAULT_REQUEST_S
    shares_prompt: bool = False  # prefix caching: n sequences hold one prompt (estimate.kv_cost)
    prefix_hash: str = ""  # its engine's block hash scheme (Register.prefix_hash); "": cache-blind
    prefix_hash_seed: str = ""

    def request_s(self) -> float:
        if self.request_overhead_s is not None and self.request_overhead_s >= 0:
            return self.request_overhead_s
        return DEFAULT_REQUEST_S

    def step_s(self) -> float:
        if self.step_time_s is not None and self.step_time_s > 0:
            return self.step_time_s
        return DEFAULT_STEP_FIXED_S + DEFAULT_STEP_PER_SEQ_S * max(1, self.max_num_seqs)


@dataclass(slots=True)
class Job:
    """A job as the caller submits it.  The policy never writes to it: a
    re-priced prompt (``Policy.correct_prompt_tokens``) goes to the policy's
    own copy."""

    job_id: str
    model: str
    tenant: str
    klass: str  # a class name from config
    prompt_tokens: int  # estimate (router.policy.estimate); the engine's count re-prices the policy's copy
    max_tokens: int
    task_type: TaskType
    arrival: float
    weight: float = 1.0  # tenant's fair-share weight inside its class
    n: int = 1  # sequences (OpenAI's n): KV and token budgets count all of them
    block_hashes: Sequence[int] = ()  # the prompt's full blocks (router.fleet.block_hash), for prefix affinity
    # Agents' sessions (router.policy.sessions): its session and its parent's, per tenant; its last turn
    session: str = ""
    parent_session: str = ""
    session_final: bool = False
    # Latency targets (router.policy.targets): its TTFT and TPOT in seconds (0: none); a
    # sheddable job no worker is predicted to meet them on is refused at once
    ttft_target_s: float = 0.0
    sheddable: bool = False
    tpot_target_s: float = 0.0
    lora_id: int = 0  # the LoRA adapter it runs under (0: none): router.policy.adapter_placement
    fairness_id: str = ""  # its end user inside its tenant (router.policy.fairness); "": none


class DispatchJob(NamedTuple):
    job_id: str
    worker_id: str
    priority: int  # for vLLM: lower runs first


class RejectJob(NamedTuple):
    job_id: str
    error: Refusal  # left the queue (queue deadline); nothing was reserved


class AbortJob(NamedTuple):
    job_id: str
    worker_id: str
    error: Refusal  # ran past the generation deadline; reservation already released


Action = DispatchJob | RejectJob | AbortJob
