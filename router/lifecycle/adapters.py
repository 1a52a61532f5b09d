"""The LoRA adapters this router serves now, each beside its base model.

A request whose ``model`` names an adapter runs on its base model's workers
(the base's tokenizer, queues, KV ledger and placement) with the adapter
applied there (``GenerateRequest.lora``); the answer names the adapter.
Adapters come from the loaded config (``[[adapters]]``) or are added and
removed at run time; the model registry (router.lifecycle.models) owns this
table beside its models.

An adapter's ``lora_id`` (vLLM's ``lora_int_id``, which keys the engine's
adapter caches and its prefix-cache block hashes) is derived from its name
and path, so every router of a fleet gives one adapter the same id without
talking, and an adapter removed and added again from another path is a new
one to the engines.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

from shared import protocol as p
from shared.config import AdapterConfig, Config, ConfigError, LoraConfig, ModelConfig, adapter_problem

log = logging.getLogger("weir.router")

# adapter_config.json is a few hundred bytes; anything far larger is not one.
_MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    base: str  # the model whose workers run it
    path: str  # absolute: what a worker loads
    rank: int  # adapter_config.json's r
    ref: p.LoraRef  # what a GenerateRequest carries

    @property
    def lora_id(self) -> int:
        return self.ref.lora_id


def lora_id(name: str, path: str) -> int:
    """A positive 31-bit id from the adapter's name and path (vLLM wants an int >= 1)."""
    digest = hashlib.sha256(f"{name}\0{path}".encode()).digest()
    return (int.from_bytes(digest[:4], "big") & 0x7FFFFFFF) or 1


def read_rank(path: str) -> int:
    """The adapter's rank from its adapter_config.json (PEFT's format); ValueError saying why not."""
    f = os.path.join(path, "adapter_config.json")
    try:
        if os.path.getsize(f) > _MAX_CONFIG_BYTES:
            raise ValueError(f"{f} is too large to be an adapter config")
        with open(f, "rb") as fh:
            doc = json.loads(fh.read())
    except OSError as e:
        raise ValueError(f"cannot read {f}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not JSON: {e}") from None
    rank = doc.get("r") if isinstance(doc, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{f} has no LoRA rank (an integer 'r' >= 1)")
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        raise ValueError(f"no adapter_model.safetensors in {path}")
    return rank


def make_adapter(cfg: Config, a: AdapterConfig, lora: LoraConfig | None) -> Adapter:
    """``a`` as served, its files checked (a ValueError naming what is wrong):
    its base runs LoRA, and its rank fits the base workers' ``max_lora_rank``."""
    if lora is None:
        raise ValueError(f"adapter {a.name!r}: model {a.base!r} runs without LoRA (set its [models.lora])")
    path = cfg.resolve(a.path)
    rank = read_rank(path)
    if rank > lora.max_lora_rank:
        raise ValueError(
            f"adapter {a.name!r}: rank {rank} exceeds model {a.base!r}'s max_lora_rank {lora.max_lora_rank}"
        )
    return Adapter(a.name, a.base, path, rank, p.LoraRef(a.name, lora_id(a.name, path), path))


class Adapters:
    """name -> Adapter, for the adapters served now."""

    def __init__(self, cfg: Config) -> None:
        self._cfg = cfg
        self._by_name: dict[str, Adapter] = {}
        self._names: dict[int, str] = {}  # every id ever served -> its name (metrics of removed ones too)
        for a in cfg.adapters:
            try:
                adapter = self._by_name[a.name] = make_adapter(cfg, a, cfg.lora(cfg.model(a.base)))
                self._names[adapter.lora_id] = a.name
            except ValueError as e:  # a config that cannot be served: the router does not start
                raise ConfigError(f"[[adapters]]: {e}") from None

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def name_of(self, lora_id: int) -> str:
        """The name an adapter id was served under (its id if never: another router's)."""
        return self._names.get(lora_id) or str(lora_id)

    def all(self) -> list[Adapter]:
        return list(self._by_name.values())

    def of_base(self, base: str) -> list[Adapter]:
        return [a for a in self._by_name.values() if a.base == base]

    def add(
        self, a: AdapterConfig, base: ModelConfig | None, lora: LoraConfig | None, taken: set[str]
    ) -> Adapter | str:
        """Serve ``a`` on ``base`` (a model served now, its workers' LoRA bounds ``lora``) or
        say why not; ``taken``: every model and adapter name."""
        why = adapter_problem(a, base, taken)
        if why is not None:
            return why
        try:
            adapter = make_adapter(self._cfg, a, lora)
        except ValueError as e:
            return str(e)
        self._by_name[a.name] = adapter
        self._names[adapter.lora_id] = a.name
        log.info("adapter %s added (base %s, rank %d)", a.name, a.base, adapter.rank)
        return adapter

    def remove(self, name: str) -> Adapter | None:
        adapter = self._by_name.pop(name, None)
        if adapter is not None:
            log.info("adapter %s removed", name)
        return adapter
