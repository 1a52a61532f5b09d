"""What the router knows of an embedding model's vectors, to judge ``dimensions``
before anything is reserved -- the rules of vLLM's ``PoolingParams``.

Read once per model from its ``config.json`` (the model directory the router
already reads the tokenizer from): the vector's width (``embedding_size``,
else ``hidden_size``) and whether it is Matryoshka (``is_matryoshka``, or a
``matryoshka_dimensions`` list, which then names the only widths allowed).
A model without a directory is the simulated engine's: SIM_EMBEDDING_SIZE
wide and Matryoshka (it truncates its placeholder vector).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

from shared.protocol import SIM_EMBEDDING_SIZE


class EmbeddingShape(NamedTuple):
    width: int  # 0: unknown (no config.json): the engine judges ``dimensions``
    matryoshka: bool
    allowed: tuple[int, ...] = ()  # (): any width 1..width


SIM_SHAPE = EmbeddingShape(SIM_EMBEDDING_SIZE, True)


def read_shape(model_dir: str | None) -> EmbeddingShape:
    if not model_dir:
        return SIM_SHAPE
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return EmbeddingShape(0, False)
    width = cfg.get("embedding_size") or cfg.get("hidden_size") or 0
    dims = cfg.get("matryoshka_dimensions") or ()
    return EmbeddingShape(int(width), bool(dims) or bool(cfg.get("is_matryoshka")), tuple(int(d) for d in dims))


def dimensions_error(shape: EmbeddingShape, model: str, dimensions: int) -> str | None:
    """vLLM's refusal of ``dimensions`` for this model (its wording), or None."""
    if shape.width == 0:
        return None
    if not shape.matryoshka:
        return (
            f"Model {model!r} does not support Matryoshka embeddings; dimensions must be unset "
            f"(received dimensions={dimensions})."
        )
    if not 1 <= dimensions <= shape.width:
        return f"Model {model!r} only supports dimensions in range [1, {shape.width}], got {dimensions}."
    if shape.allowed and dimensions not in shape.allowed:
        return f"Model {model!r} only supports Matryoshka dimensions {list(shape.allowed)}, got {dimensions}."
    return None
