"""Build a tiny LoRA adapter for the tiny model (``models/tiny-llama``), in PEFT's format.

``python -m deploy.make_adapter OUT_DIR [--base models/tiny-llama] [--seed N] [--rank R] [--count K]``

No adapter can be downloaded here, so we make one, as the model is made
(deploy/make_model.py): ``adapter_config.json`` plus ``adapter_model.safetensors``
with PEFT's tensor names (``base_model.model.model.layers.{i}.{module}.lora_A/B.weight``)
on every attention and MLP projection of each layer.  Deterministic (seeded),
a few KB, well under a second.  Unlike a freshly initialised PEFT adapter
(whose B is zeros) both factors are random and scaled so that the adapter
moves the tiny model's greedy output: a request naming it answers
differently from the base model, and two seeds differ from each other.
``--count K`` builds K adapters, OUT_DIR (seed N), OUT_DIR-2 (seed N+1), ...
(``build_set``): `make setup` builds tiny-lora, tiny-lora-2 and tiny-lora-3.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(cfg: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module of one layer, from the base model's config.json."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def build(out_dir: str, base: str = "models/tiny-llama", *, seed: int = 1, rank: int = 8) -> Path:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(base) / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in _shapes(cfg).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            # B @ A has entries of ~0.5 / sqrt(fan_in) * scaling: as large as the base weights.
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) / rank**0.5
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": rank * 2,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": list(TARGETS),
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def build_set(out_dir: str, base: str = "models/tiny-llama", *, count: int, seed: int = 1, rank: int = 8) -> list[Path]:
    """``count`` distinct adapters: ``out_dir`` (seed ``seed``), ``out_dir``-2 (seed + 1), ..."""
    return [build(out_dir if i == 0 else f"{out_dir}-{i + 1}", base, seed=seed + i, rank=rank) for i in range(count)]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m deploy.make_adapter", description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="models/tiny-lora")
    ap.add_argument("--base", default="models/tiny-llama")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--count", type=int, default=1, help="adapters to build: OUT, OUT-2, ... (seeds N, N+1, ...)")
    args = ap.parse_args()
    for i, path in enumerate(build_set(args.out, args.base, count=args.count, seed=args.seed, rank=args.rank)):
        print(f"tiny LoRA adapter (rank {args.rank}, seed {args.seed + i}) written to {path}")
