"""LoRA adapters: the config's [[adapters]] and [models.lora], the router's adapter table
(router.lifecycle.adapters), and the tiny adapter builder (deploy/make_adapter.py)."""

from __future__ import annotations

import hashlib
import json

import pytest

from bench.localconfig import TINY_MODEL_DIR
from deploy.make_adapter import build
from router.lifecycle.adapters import Adapters, lora_id, read_rank
from shared.config import AdapterConfig, ConfigError, loads

MODELS = """
[[models]]
name = "base"
path = "/m/base"
[[models]]
name = "other"
path = "/m/other"
[[models]]
name = "sim-x"
engine = "sim"
"""


def _cfg(extra: str, base_dir: str = "."):
    return loads(MODELS + extra, base_dir)


def test_adapters_validated_at_load():
    cfg = _cfg('[[adapters]]\nname = "a"\nbase = "base"\npath = "a"\n')
    # [[adapters]] naming a model turn LoRA on for its workers, with the defaults
    assert cfg.lora(cfg.model("base")) is not None and cfg.lora(cfg.model("other")) is None
    bad = {
        '[[adapters]]\nname = "a"\nbase = "nope"\npath = "a"\n': "not a model served",
        '[[adapters]]\nname = "base"\nbase = "other"\npath = "a"\n': "already a model's",
        '[[adapters]]\nname = "a"\nbase = "sim-x"\npath = "a"\n': "not a vLLM generation model",
        '[[adapters]]\nname = "a b"\nbase = "base"\npath = "a"\n': "a name is",
        '[[adapters]]\nname = "a"\nbase = "base"\npath = "a"\n[[adapters]]\nname = "a"\nbase = "base"\npath = "b"\n': (
            "already"
        ),
    }
    for text, why in bad.items():
        with pytest.raises(ConfigError, match=why):
            _cfg(text)


def test_lora_bounds_validated():
    def with_lora(body: str):
        return loads(f'[[models]]\nname = "base"\npath = "/m"\n[models.lora]\n{body}\n')

    assert with_lora("max_loras = 2\nmax_cpu_loras = 4").models[0].lora is not None
    for body in ("max_loras = 0", "max_loras = 4\nmax_cpu_loras = 2", "max_loras = 65\nmax_cpu_loras = 65"):
        with pytest.raises(ConfigError, match="max_loras"):
            with_lora(body)
    with pytest.raises(ConfigError):  # vLLM's ranks only
        with_lora("max_lora_rank = 12")


def test_adapter_table_reads_rank_and_refuses_what_cannot_run(tmp_path):
    a = build(str(tmp_path / "a"), str(TINY_MODEL_DIR), seed=1, rank=8)
    big = build(str(tmp_path / "big"), str(TINY_MODEL_DIR), seed=1, rank=32)
    cfg = _cfg(f'[[adapters]]\nname = "a"\nbase = "base"\npath = "{a}"\n')
    table = Adapters(cfg)
    got = table.get("a")
    assert got is not None and got.rank == 8 and got.base == "base" and got.ref.path == str(a)
    assert got.lora_id == lora_id("a", str(a)) and 1 <= got.lora_id < 2**31
    base, lora = cfg.model("base"), cfg.lora(cfg.model("base"))
    taken = {"base", "other", "sim-x", "a"}
    assert "exceeds" in table.add(AdapterConfig(name="b", base="base", path=str(big)), base, lora, taken)
    assert "without LoRA" in table.add(
        AdapterConfig(name="b", base="other", path=str(a)), cfg.model("other"), None, taken
    )
    assert "already" in table.add(AdapterConfig(name="a", base="base", path=str(a)), base, lora, taken)
    assert "cannot read" in table.add(AdapterConfig(name="b", base="base", path=str(tmp_path)), base, lora, taken)
    added = table.add(AdapterConfig(name="b", base="base", path=str(a)), base, lora, taken)
    assert not isinstance(added, str) and added.lora_id != got.lora_id  # same files, another adapter
    assert [x.name for x in table.of_base("base")] == ["a", "b"]
    assert table.remove("b") is added and table.get("b") is None
    # a config whose adapter cannot be served does not start
    with pytest.raises(ConfigError, match="exceeds"):
        Adapters(_cfg(f'[[adapters]]\nname = "a"\nbase = "base"\npath = "{big}"\n'))


def test_read_rank_refuses_what_is_not_an_adapter(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": "8"}))
    with pytest.raises(ValueError, match="no LoRA rank"):
        read_rank(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    with pytest.raises(ValueError, match="safetensors"):
        read_rank(str(tmp_path))


def test_tiny_adapter_is_deterministic_and_seeded(tmp_path):
    def digest(d) -> str:
        return hashlib.sha256((d / "adapter_model.safetensors").read_bytes()).hexdigest()

    one, again, two = (
        build(str(tmp_path / n), str(TINY_MODEL_DIR), seed=s) for n, s in (("1", 1), ("1b", 1), ("2", 2))
    )
    assert digest(one) == digest(again) and digest(one) != digest(two)
    conf = json.loads((one / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 8


def test_block_hashes_under_an_adapter_agree_with_vllms():
    """The router's block hashes of a prompt under an adapter are vLLM's own
    (its request block hasher, LoRA extra keys on every block), and differ from
    the base model's and from another adapter's: the prefix index never matches
    one adapter's cached blocks for another."""
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    from router.fleet.block_hash import BlockHasher, lora_extra

    ids = list(range(100, 100 + 16 * 4 + 3))
    for algo in ("sha256", "sha256_cbor"):
        hf = get_hash_fn_by_name(algo)
        kcu.init_none_hash(hf)
        vllm_hasher = kcu.get_request_block_hasher(16, hf)
        ours = BlockHasher(algo, 16)
        got = {}
        for lora in (None, LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")):
            request = SimpleNamespace(
                block_hashes=[],
                num_tokens=len(ids),
                all_token_ids=ids,
                mm_features=[],
                lora_request=lora,
                cache_salt=None,
                prompt_embeds=None,
            )
            want = [kcu.maybe_convert_block_hash(h) for h in vllm_hasher(request)]
            extra = lora_extra(lora.lora_name, lora.lora_path) if lora is not None else None
            got[lora and lora.lora_name] = ours.hashes(ids, every_extra=extra)
            assert got[lora and lora.lora_name] == want and len(want) == 4
        assert len({tuple(h) for h in got.values()}) == 3  # no block shared between base, a and b


def test_a_cpu_lora_worker_refuses_prompt_logprobs_naming_the_field_that_asks_for_them():
    """The worker's 400 (its ``_failed``: ``bad_request(message, e.parameter)``) names
    SamplingParams' ``prompt_logprobs``, the field a ZeroMQ client sets; the HTTP router
    names ``echo`` for a completion that asked with echo and logprobs (tests/inproc)."""
    from engine_worker.lora import PromptLogprobsRefused, refuse_prompt_logprobs

    refuse_prompt_logprobs(None, lora_on_cpu=True)
    refuse_prompt_logprobs(2, lora_on_cpu=False)  # a GPU's LoRA kernels compute them
    with pytest.raises(PromptLogprobsRefused) as e:
        refuse_prompt_logprobs(0, lora_on_cpu=True)
    assert getattr(e.value, "parameter", None) == "prompt_logprobs" and "prompt logprobs" in str(e.value)
