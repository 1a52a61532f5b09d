"""/v1/embeddings, the pure parts: the body's four input forms -> one Submit
per input, the refusals (with ``param``), the response as the openai SDK
parses it (float and base64), the router's ``dimensions`` rules, an
embedding's admission (prefill only), and the simulated engine's vector."""

from __future__ import annotations

import base64
import json
import math
import struct

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from engine_worker.sim_engine import sim_vector
from router import api
from router.api.checks import check_shape, resolve_max_tokens
from router.lifecycle.embedding_model import SIM_SHAPE, EmbeddingShape, dimensions_error, read_shape
from shared.protocol import SIM_EMBEDDING_SIZE, ErrorInfo, RequestKind, Submit, TaskType, pack_floats

META = api.RequestMeta()


def _body(**fields) -> bytes:
    return json.dumps({"model": "e", "input": "hello", **fields}).encode()


def _refusal(body: bytes, meta=META) -> ErrorInfo:
    with pytest.raises(api.RequestError) as e:
        api.parse_embeddings(body, meta, "r1")
    return e.value.info


@pytest.mark.parametrize(
    "value, prompts, ids",
    [
        ("hello", ["hello"], [[]]),
        (["a", "b", "c"], ["a", "b", "c"], [[], [], []]),
        ([5, 6, 7], [""], [[5, 6, 7]]),
        ([[5, 6], [7]], ["", ""], [[5, 6], [7]]),
    ],
)
def test_every_input_form_becomes_one_embedding_submit_per_input(value, prompts, ids):
    subs, ctx = api.parse_embeddings(_body(input=value, user="u1", dimensions=32), META, "r1")
    assert [s.prompt for s in subs] == prompts and [s.prompt_token_ids for s in subs] == ids
    assert all(s.kind == RequestKind.EMBEDDING and s.max_tokens is None and s.params is None for s in subs)
    assert all(s.dimensions == 32 and s.user == "u1" and s.model == "e" for s in subs)
    assert len({s.request_id for s in subs}) == len(subs)  # each its own job
    assert ctx.count == len(subs) and ctx.id == "embd-r1" and not ctx.base64


def test_priority_and_task_type_come_from_the_body_or_the_headers():
    (sub,), _ = api.parse_embeddings(_body(priority="low", task_type="long"), META, "r1")
    assert sub.priority == "low" and sub.task_type == TaskType.LONG
    meta = api.RequestMeta(api_key="k", priority="batch", task_type="short")
    (sub,), _ = api.parse_embeddings(_body(), meta, "r1")
    assert sub.priority == "batch" and sub.task_type == TaskType.SHORT and sub.api_key == "k"


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"input": []}, "input", None),
        ({"input": ""}, "input", None),
        ({"input": ["a", ""]}, "input", None),
        ({"input": [[]]}, "input", None),
        ({"input": ["a", 1]}, "input", None),
        ({"input": [1, -2]}, "input", None),
        ({"input": [1.5]}, "input", None),
        ({"input": [[1], "a"]}, "input", None),
        ({"input": [True]}, "input", None),
        ({"input": ["x"] * (api.MAX_EMBEDDING_INPUTS + 1)}, "input", None),
        ({"input": 3}, "input", None),
        ({"encoding_format": "int8"}, "encoding_format", None),
        ({"dimensions": 0}, "dimensions", None),
        ({"model": None}, "model", None),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "unsupported_value"),
        ({"padding": "max_length"}, "padding", "unsupported_value"),
        ({"truncation_side": "left"}, "truncation_side", "unsupported_value"),
        ({"embed_dtype": "float16"}, "embed_dtype", "unsupported_value"),
        ({"add_special_tokens": False}, "add_special_tokens", "unsupported_value"),
        ({"use_activation": False}, "use_activation", "unsupported_value"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "unsupported_value"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(fields, param, code):
    info = _refusal(_body(**fields))
    assert info.status == 400 and info.param == param and info.code == code


def test_missing_input_and_bad_task_type_header():
    assert _refusal(json.dumps({"model": "e"}).encode()).param == "input"
    assert _refusal(_body(), api.RequestMeta(task_type="huge")).param == "x-weir-task-type"


def test_fields_weir_honours_as_vllm_does_are_accepted():
    subs, ctx = api.parse_embeddings(
        _body(add_special_tokens=True, use_activation=True, embed_dtype="float32", endianness="little"), META, "r"
    )
    assert len(subs) == 1 and not ctx.big_endian


VEC = [0.5, -0.25, 1.0 / 3.0, 1e-8]


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_the_response_is_what_the_openai_sdk_parses(fmt):
    _, ctx = api.parse_embeddings(_body(input=["a", "b"], encoding_format=fmt), META, "r9")
    body = api.encode(api.render_embeddings(ctx, [pack_floats(VEC), pack_floats(VEC[::-1])], 7))
    raw = json.loads(body)
    if fmt == "base64":  # the SDK decodes these before it validates the response
        for d in raw["data"]:
            d["embedding"] = np.frombuffer(base64.b64decode(d["embedding"]), dtype="float32").tolist()
    resp = CreateEmbeddingResponse.model_validate(raw)
    assert resp.object == "list" and resp.model == "e" and [d.index for d in resp.data] == [0, 1]
    assert resp.usage.prompt_tokens == 7 and resp.usage.total_tokens == 7
    raw = json.loads(body)
    assert raw["id"] == "embd-r9" and raw["usage"]["completion_tokens"] == 0
    f32 = np.array(VEC, dtype=np.float32)
    if fmt == "float":  # float32 values, as vLLM's tensor.tolist() prints them
        assert resp.data[0].embedding == [float(x) for x in f32]
    else:  # what the SDK does with base64: np.frombuffer(b64decode(s), dtype="float32")
        got = np.frombuffer(base64.b64decode(raw["data"][1]["embedding"]), dtype="float32")
        assert got.tolist() == f32[::-1].tolist()


def test_big_endian_base64_is_swapped():
    _, ctx = api.parse_embeddings(_body(encoding_format="base64", endianness="big"), META, "r")
    body = json.loads(api.encode(api.render_embeddings(ctx, [pack_floats(VEC)], 1)))
    got = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype=">f4")
    assert got.tolist() == np.array(VEC, dtype=np.float32).tolist()


# ------------------------------------------------------------ the model's side


def test_dimensions_follow_vllms_matryoshka_rules(tmp_path):
    plain = EmbeddingShape(128, False)
    assert "does not support Matryoshka" in (dimensions_error(plain, "m", 8) or "")
    mat = EmbeddingShape(128, True)
    assert dimensions_error(mat, "m", 128) is None and dimensions_error(mat, "m", 1) is None
    assert "range [1, 128]" in (dimensions_error(mat, "m", 129) or "")
    listed = EmbeddingShape(128, True, (32, 64))
    assert dimensions_error(listed, "m", 64) is None and "[32, 64]" in (dimensions_error(listed, "m", 48) or "")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 96, "matryoshka_dimensions": [48, 96]}))
    assert read_shape(str(tmp_path)) == EmbeddingShape(96, True, (48, 96))
    assert read_shape(str(tmp_path / "missing")).width == 0  # unknown: the engine judges
    assert read_shape(None) == SIM_SHAPE and SIM_SHAPE.width == SIM_EMBEDDING_SIZE


def test_an_embedding_is_priced_as_prefill_only_and_refused_over_the_context():
    sub = Submit("r", "e", kind=RequestKind.EMBEDDING, prompt="hi")
    assert check_shape(sub) is None
    assert resolve_max_tokens(sub, 512, 512) == 0
    err = resolve_max_tokens(sub, 513, 512)
    assert isinstance(err, ErrorInfo) and err.code == "context_length_exceeded" and err.param == "input"
    assert "513 tokens in the input" in err.message


def test_embedding_shape_rules_at_admission():
    empty = check_shape(Submit("r", "e", kind=RequestKind.EMBEDDING))
    assert empty is not None and empty.param == "input"
    both = check_shape(Submit("r", "e", kind=RequestKind.EMBEDDING, prompt="a", prompt_token_ids=[1]))
    assert both is not None and both.param == "input"
    stray = check_shape(Submit("r", "m", prompt="a", dimensions=8))  # a completion with embedding fields
    assert stray is not None and stray.status == 400


def test_the_simulated_vector_is_deterministic_unit_length_and_truncates():
    a = sim_vector(12, [1, 2])
    assert a == sim_vector(12, [1, 2]) and a != sim_vector(13, [1, 2])
    full = struct.unpack(f"<{SIM_EMBEDDING_SIZE}f", a)
    assert math.isclose(sum(v * v for v in full), 1.0, rel_tol=1e-5)
    short = struct.unpack("<8f", sim_vector(12, [1, 2], 8))
    assert math.isclose(sum(v * v for v in short), 1.0, rel_tol=1e-5)
