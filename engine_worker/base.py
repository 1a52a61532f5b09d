"""The one interface the worker process drives: a real vLLM engine or the simulated one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from shared.protocol import Delta, ErrorInfo, GenerateRequest, WorkerStats

Emit = Callable[[Delta], None]


@dataclass(frozen=True)
class EngineInfo:
    """What the running engine really has (read after start-up, not from config)."""

    engine: str  # "vllm" | "sim"
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    max_num_seqs: int


class Engine(Protocol):
    # Set when the engine can no longer serve (e.g. vLLM's EngineCore died); the
    # worker then says Goodbye and exits non-zero so its supervisor restarts it.
    fatal_error: Optional[BaseException]

    async def start(self) -> EngineInfo: ...

    def submit(self, req: GenerateRequest, emit: Emit) -> None:
        """Non-blocking.  ``emit`` gets the request's Deltas as they come, the
        last one with ``finish_reason`` or ``error`` set -- exactly one such."""

    def abort(self, request_ids: list[str]) -> None:
        """Requests still live end with a final Delta ``finish_reason="abort"``."""

    def stats(self) -> WorkerStats: ...

    async def shutdown(self) -> None: ...


def bad_request(request_id: str, message: str, param: Optional[str] = None) -> Delta:
    return Delta(request_id, error=ErrorInfo(400, message, "invalid_request_error", None, param))


def server_error(request_id: str, message: str, status: int = 500) -> Delta:
    return Delta(request_id, error=ErrorInfo(status, message, "server_error"))
