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

from router.fleet.block_hash import SIM, BlockHasher
from router.lifecycle.prompts import ModelPrompts
from shared import protocol as p
from shared.config import Config, ModelConfig, WorkerConfig

log = logging.getLogger("weir.router")


class HashedPrompt(NamedTuple):
    """A prompt as its model's engines see it: router.lifecycle.prompts.PromptTokens plus its block hashes."""

    ids: list[int]  # exact token ids; empty when the model has no tokenizer
    count: int  # type: ignore[assignment]  # len(ids), or the estimate (shadows tuple.count, as in router.lifecycle.prompts)
    hashes: Sequence[int] = ()  # its full blocks as its model's engines hash them (router.fleet.block_hash)


def tokenize_hashed(prompts: ModelPrompts, sub: p.Submit, hasher: BlockHasher | None) -> HashedPrompt:
    """Tokens, and the prompt's block hashes as its model's engines compute
    them (prefix affinity): in the same place, on the tokenizing thread for
    long prompts, so hashing never stalls the loop either."""
    ids, count = prompts.tokenize(sub)
    if hasher is None:
        return HashedPrompt(ids, count)
    if hasher.algo == SIM:  # the simulated engine's blocks: the text it was counted by
        text = (
            sub.prompt
            if sub.kind != p.RequestKind.CHAT
            else "".join(m.role + "\n" + m.content + "\n" for m in sub.messages)
        )
        return HashedPrompt(ids, count, hasher.text_hashes(text, count))
    return HashedPrompt(ids, count, hasher.hashes(ids) if ids else ())


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
        self._models: dict[str, ServedModel] = {}
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
            self.version += 1
            log.info("model %s removed", name)
