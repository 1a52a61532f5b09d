"""The models this router serves now: the one owner of model state.

A model comes from the loaded config or is added at run time
(POST /admin/models); it is removed in two steps: *unloading* (new requests
get 503 model_unloading, running ones finish) and then forgotten once
nothing of it is left (the lifecycle decides when: it knows the jobs and the
workers).  The loaded config is never changed: ``configs`` is the current
set, in the order models came.

Also here: how a request's prompt becomes the token ids and block hashes
its model's engines see (``tokenize_hashed``), since that is per model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from router.fleet.block_hash import SIM, BlockHasher, lora_extra
from router.lifecycle.adapters import Adapters
from router.lifecycle.prompts import ModelPrompts
from shared import protocol as p
from shared.config import AdapterConfig, Config, ModelConfig, WorkerConfig

log = logging.getLogger("weir.router")


class HashedPrompt(NamedTuple):
    """A prompt as its model's engines see it: router.lifecycle.prompts.PromptTokens plus its block hashes."""

    ids: list[int]  # exact token ids; empty when the model has no tokenizer
    count: int  # type: ignore[assignment]  # len(ids), or the estimate (shadows tuple.count, as in router.lifecycle.prompts)
    hashes: Sequence[int] = ()  # its full blocks as its model's engines hash them (router.fleet.block_hash)
    # ``ids`` already encoded for the worker (a long prompt's: ``WIRE_MIN_IDS``), else None
    wire: msgspec.Raw | None = None


# From this many token ids on (~0.1 ms of msgpack) a prompt's ids are encoded
# where it is tokenized, on the tokenizer thread: a 150k-token prompt's take
# ~0.8 ms, which the loop would spend on each dispatch.
WIRE_MIN_IDS = 16_384


def tokenize_hashed(
    prompts: ModelPrompts, sub: p.Submit, hasher: BlockHasher | None, lora: p.LoraRef | None = None
) -> HashedPrompt:
    """Tokens, and the prompt's block hashes as its model's engines compute
    them (prefix affinity; under ``lora``, as they hash that adapter's blocks):
    in the same place, on the tokenizing thread for long prompts, so hashing
    never stalls the loop either."""
    ids, count = prompts.tokenize(sub)
    wire = msgspec.Raw(msgspec.msgpack.encode(ids)) if len(ids) >= WIRE_MIN_IDS else None
    if hasher is None:
        return HashedPrompt(ids, count, (), wire)
    if hasher.algo == SIM:  # the simulated engine's blocks: the text it was counted by
        text = (
            sub.prompt
            if sub.kind != p.RequestKind.CHAT
            else "".join(m.role + "\n" + m.content + "\n" for m in sub.messages)
        )
        return HashedPrompt(ids, count, hasher.text_hashes(text, count), wire)
    every = lora_extra(lora.name, lora.path) if lora is not None else None
    return HashedPrompt(ids, count, hasher.hashes(ids, every_extra=every) if ids else (), wire)


@dataclass(slots=True, eq=False)
class ServedModel:
    config: ModelConfig
    prompts: ModelPrompts  # its tokenizer and prompt checks
    # Added at run time: the workers it wants, for the supervisor (deploy/stack.py)
    # to start; None: it came with the loaded config.
    runtime_workers: list[WorkerConfig] | None = None
    unloading: bool = False


class ModelRegistry:
    def __init__(self, cfg: Config, prompts: dict[str, ModelPrompts] | None = None) -> None:
        self._resolve: Callable[[str], str] = cfg.resolve
        self._cfg = cfg  # (which models' workers run LoRA: Config.lora)
        self._models: dict[str, ServedModel] = {}
        self.adapters = Adapters(cfg)  # the LoRA adapters served beside the models
        self.version = 0  # counts changes to the set (readers cache what they derive from it)
        for m in cfg.models:
            given = prompts.get(m.name) if prompts is not None else None
            self._models[m.name] = ServedModel(m, given if given is not None else self._prompts_for(m))

    def _prompts_for(self, model: ModelConfig) -> ModelPrompts:
        return ModelPrompts(
            self._resolve(model.path) if model.path else None, model.tool_call_parser, model.enable_auto_tool_choice
        )

    # ------------------------------------------------------------ reading

    def get(self, name: str) -> ServedModel | None:
        """A model known now, unloading or not."""
        return self._models.get(name)

    def get_or_base(self, name: str) -> ServedModel | None:
        """A model known now, or the base model of an adapter served now."""
        adapter = self.adapters.get(name)
        return self._models.get(adapter.base if adapter is not None else name)

    def of(self, name: str) -> ServedModel:
        """A model a live job names: known until its last job ends (KeyError otherwise)."""
        return self._models[name]

    def serves(self, name: str) -> bool:
        """Known and taking new requests."""
        m = self._models.get(name)
        return m is not None and not m.unloading

    def configs(self) -> list[ModelConfig]:
        return [m.config for m in self._models.values()]

    def unloading(self) -> list[str]:
        return [name for name, m in self._models.items() if m.unloading]

    def runtime_workers(self) -> dict[str, list[WorkerConfig]]:
        """Per model added at run time: the workers it wants."""
        return {name: m.runtime_workers for name, m in self._models.items() if m.runtime_workers is not None}

    # ------------------------------------------------------------ changing

    def add(self, model: ModelConfig, workers: list[WorkerConfig]) -> str | None:
        """Serve a new model; an error message if it cannot be added."""
        known = self._models.get(model.name)
        if known is not None:
            return f"model {model.name!r} already exists" + (" (still unloading)" if known.unloading else "")
        bad = [fb for fb in model.fallbacks if not self.serves(fb)]
        if bad:
            return f"model {model.name!r}: fallbacks {bad} are not models served now"
        self._models[model.name] = ServedModel(model, self._prompts_for(model), workers)
        self.version += 1
        log.info("model %s added (%s, %d workers to start)", model.name, model.engine, len(workers))
        return None

    def lora_models(self) -> list[str]:
        """The models served now whose workers run LoRA (an adapter may be added to them)."""
        return [n for n, m in self._models.items() if not m.unloading and self._cfg.lora(m.config) is not None]

    def add_adapter(self, a: AdapterConfig) -> str | None:
        """Serve adapter ``a`` beside its base model from now on; an error message if it cannot be."""
        base = self._models.get(a.base)
        if base is not None and base.unloading:
            return f"adapter {a.name!r}: model {a.base!r} is being removed"
        taken = set(self._models) | {x.name for x in self.adapters.all()}
        lora = self._cfg.lora(base.config) if base is not None else None
        added = self.adapters.add(a, base.config if base is not None else None, lora, taken)
        if isinstance(added, str):
            return added
        self.version += 1
        return None

    def remove_adapter(self, name: str) -> bool:
        """Stop serving adapter ``name`` (False: none): new requests for it get 404; those
        queued or running carry their adapter and finish."""
        if self.adapters.remove(name) is None:
            return False
        self.version += 1
        return True

    def start_unloading(self, name: str) -> bool:
        """True if ``name`` was served and is unloading from now on."""
        m = self._models.get(name)
        if m is None or m.unloading:
            return False
        m.unloading = True
        log.info("model %s unloading", name)
        return True

    def forget(self, name: str) -> None:
        """An unloaded model with nothing of it left."""
        if self._models.pop(name, None) is not None:
            for adapter in self.adapters.of_base(name):  # nothing left to run them on
                self.adapters.remove(adapter.name)
            self.version += 1
            log.info("model %s removed", name)
