"""weir against `vllm serve`: the same requests, the same answers.

One `vllm serve` (vLLM's own OpenAI server, python -m
vllm.entrypoints.openai.api_server) on the tiny model with the engine
settings weir's worker uses (tests/e2e/conftest.py's ``stack``: same model
directory, served name, context, dtype, eager mode, prefix caching), and
weir's whole stack through Envoy.  Each request of ``CORPUS`` -- valid ones,
deterministic ones (greedy or seeded) and bad ones -- goes to both, and:

  * the statuses agree;
  * a 200's JSON has the same keys (recursively), except the differences
    listed in ``DELIBERATE`` (each with its reason; docs/api.md lists them);
  * a deterministic request's outputs agree token for token (texts, finish
    reasons, token counts, token ids of /tokenize, logprobs' tokens);
  * an error is OpenAI's body on both, and weir's names the ``param``.

The agreement counts are printed (``pytest -s``) for the record.  Other
endpoints' cases (tools, Responses, embeddings) join ``CORPUS`` as they land.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
import stackutil

pytestmark = pytest.mark.vllm

MODEL = stackutil.VLLM_MODEL


@dataclass
class Case:
    name: str
    path: str
    body: Any  # a dict (sent as JSON) or raw bytes
    exact: bool = False  # deterministic: outputs must agree token for token
    stream: bool = False
    known: str = ""  # a documented output difference (docs/api.md): counted, reported, not a failure


def _c(name: str, exact: bool = True, **body: Any) -> Case:
    return Case(name, "/v1/completions", {"model": MODEL, "max_tokens": 8, **body}, exact, bool(body.get("stream")))


def _chat(name: str, exact: bool = True, **body: Any) -> Case:
    msgs = body.pop("messages", [{"role": "user", "content": "Say something about rivers."}])
    return Case(
        name,
        "/v1/chat/completions",
        {"model": MODEL, "messages": msgs, "max_tokens": 8, **body},
        exact,
        bool(body.get("stream")),
    )


GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "seed": 1234}
IDS = [1, 72, 101, 108, 108, 111, 44, 32, 119]  # a token-id prompt (all inside the tiny vocabulary)
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]

CORPUS: list[Case] = [
    # --- completions: every prompt form, deterministic
    _c("string", prompt="Once upon a time", **GREEDY),
    _c("list-of-one", prompt=["Once upon a time"], **GREEDY),
    _c("list-of-strings", prompt=["The river", "A mountain", "In the city"], **GREEDY),
    _c("token-ids", prompt=IDS, **GREEDY),
    _c("token-id-lists", prompt=[IDS, IDS[:4], [1, 50, 60]], **GREEDY),
    _c("strings-n2-seeded", prompt=["The river", "A mountain"], n=2, **SEEDED),
    _c("ids-n2-seeded", prompt=[IDS, [1, 50, 60]], n=2, **SEEDED),
    _c("strings-echo", prompt=["The river", "A mountain"], echo=True, **GREEDY),
    _c("ids-echo", prompt=IDS, echo=True, **GREEDY),
    _c("strings-logprobs", prompt=["The river", "A mountain"], logprobs=2, **GREEDY),
    _c("strings-stream", prompt=["The river", "A mountain"], stream=True, **GREEDY),
    _c(
        "ids-stream-usage",
        prompt=[IDS, [1, 50, 60]],
        stream=True,
        stream_options={"include_usage": True},
        n=2,
        **SEEDED,
    ),
    _c("best-of", prompt="Once upon a time", best_of=3, **GREEDY),
    _c("stop", prompt="Once upon a time", stop=[" "], max_tokens=16, **GREEDY),
    _c("penalties", prompt="The river", presence_penalty=1.0, frequency_penalty=0.5, **SEEDED),
    _c("max-tokens-1", prompt=["a", "b", "c", "d"], max_tokens=1, **GREEDY),
    Case(
        "ids-logprobs",
        "/v1/completions",
        {"model": MODEL, "max_tokens": 8, "prompt": [IDS, [1, 50, 60]], "logprobs": 1, **GREEDY},
        exact=True,
        # vLLM 0.32 re-decodes a logprob token ending in U+FFFD with up to 4 preceding
        # sampled tokens (vllm/v1/engine/logprobs.py) and names an unfinished one "";
        # weir names each token decoded alone
        known="logprob token text of a byte token that is part of a multi-byte character",
    ),
    _c("long-prompt-in-list", prompt=["a", "word " * 300], **GREEDY),  # tokenized off the loop
    # --- completions: bad input
    _c("empty-list", prompt=[]),
    _c("mixed-list", prompt=[1, "a"]),
    _c("negative-id", prompt=[-1, 5]),
    _c("id-out-of-vocab", prompt=[1, 999999]),
    _c("ids-out-of-vocab-second", prompt=[[1, 2], [999999]]),
    _c("float-ids", prompt=[1.5, 2]),
    _c("temperature-3", prompt="x", temperature=3),
    _c("unknown-model", prompt="x", model="no-such-model"),
    _c("greedy-n2", prompt="x", n=2, temperature=0),
    _c("one-prompt-over-context", prompt=["a", [1] + [50] * (stackutil.STACK_VLLM_MAX_LEN + 10)]),
    _c("top-logprobs-too-many", prompt="x", logprobs=100),
    Case("malformed-json", "/v1/completions", b'{"model": "tiny-llama", "prompt": '),
    # --- chat
    _chat("chat", messages=CHAT, **GREEDY),
    _chat("chat-seeded-n2", messages=CHAT, n=2, **SEEDED),
    _chat("chat-logprobs", messages=CHAT, logprobs=True, top_logprobs=2, **GREEDY),
    _chat("chat-stream", messages=CHAT, stream=True, **GREEDY),
    _chat("chat-empty-messages", messages=[]),
    _chat("chat-temperature-3", temperature=3),
    # --- tokenize / detokenize
    Case("tokenize", "/tokenize", {"model": MODEL, "prompt": "Hello, world"}, exact=True),
    Case("tokenize-no-special", "/tokenize", {"model": MODEL, "prompt": "Hello", "add_special_tokens": False}, True),
    Case("tokenize-strs", "/tokenize", {"model": MODEL, "prompt": "Hi there", "return_token_strs": True}, True),
    Case("tokenize-chat", "/tokenize", {"model": MODEL, "messages": CHAT}, exact=True),
    Case("tokenize-chat-strs", "/tokenize", {"model": MODEL, "messages": CHAT, "return_token_strs": True}, True),
    Case("detokenize", "/detokenize", {"model": MODEL, "tokens": IDS}, exact=True),
    Case("tokenize-long", "/tokenize", {"model": MODEL, "prompt": "The river runs. " * 150}, exact=True),
    Case("detokenize-empty", "/detokenize", {"model": MODEL, "tokens": []}, exact=True),
    Case("detokenize-out-of-vocab", "/detokenize", {"model": MODEL, "tokens": [72, 999999, 101]}, exact=True),
    Case("tokenize-unknown-model", "/tokenize", {"model": "no-such-model", "prompt": "x"}),
    Case("tokenize-nothing", "/tokenize", {"model": MODEL}),
    Case("detokenize-negative", "/detokenize", {"model": MODEL, "tokens": [-1]}),
    Case("detokenize-not-a-list", "/detokenize", {"model": MODEL, "tokens": "abc"}),
]

# Differences weir keeps on purpose (key-path patterns, both directions), and why.
DELIBERATE = {
    # vLLM-only response fields weir does not send
    "*.system_fingerprint": "not sent yet (the response-fields work adds it)",
    "*.choices[].stop_reason": "not sent yet (the response-fields work adds it)",
    "*.choices[].token_ids": "vLLM's return_token_ids extension: null unless asked for",
    "*.choices[].prompt_token_ids": "vLLM's return_token_ids extension: null unless asked for",
    "*.prompt_token_ids": "vLLM's return_token_ids extension: null unless asked for",
    "*.choices[].prompt_logprobs": "prompt logprobs are not computed by weir",
    "*.prompt_logprobs": "prompt logprobs are not computed by weir",
    "*.kv_transfer_params": "vLLM's disaggregated-prefill extension",
    "*.service_tier": "OpenAI's field, always null in vLLM",
    "*.usage.prompt_tokens_details*": "weir always reports cached prompt tokens (vLLM: null unless enabled)",
    "*.choices[].message.*": "chat message extras (refusal, tool_calls, reasoning...): the chat work",
    "*.choices[].delta.*": "chat delta extras: the chat work",
    "*.choices[].routed_experts": "vLLM's mixture-of-experts extension (null here)",
    "*.ec_transfer_params": "vLLM's encoder-cache transfer extension (null here)",
    "*.metrics": "vLLM's per-request metrics extension (null here)",
    "*.prompt_text": "vLLM's rendered-prompt extension (null unless asked for)",
    "*.usage.completion_tokens_details": "null in vLLM's answers",
}
# Statuses that differ on purpose: case name -> (vLLM's, weir's, why)
DELIBERATE_STATUS: dict[str, tuple[int, int, str]] = {}


def _shape(obj: Any, path: str = "*") -> set[str]:
    """Every key path of a JSON value (list elements merged as ``[]``)."""
    out: set[str] = set()
    if isinstance(obj, dict):
        if path.endswith(".logprobs.top_logprobs[]"):
            return out  # a completion's top_logprobs: token text -> logprob, data rather than shape
        for k, v in obj.items():
            p = f"{path}.{k}"
            out.add(p)
            out |= _shape(v, p)
    elif isinstance(obj, list):
        for v in obj:
            out |= _shape(v, path + "[]")
    return out


def _unexplained(a: set[str], b: set[str]) -> set[str]:
    return {p for p in a ^ b if not any(fnmatch.fnmatchcase(p, pat) for pat in DELIBERATE)}


@dataclass
class Answer:
    status: int
    body: Any = None  # JSON, or for a stream: the list of events
    raw: bytes = b""
    events: list[Any] = field(default_factory=list)


def _send(base: str, case: Case, headers: dict[str, str]) -> Answer:
    data = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    r = requests.post(
        base + case.path,
        data=data,
        headers={"content-type": "application/json", **headers},
        timeout=60,
        stream=case.stream,
    )
    if case.stream and r.status_code == 200:
        events = []
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[6:]))
        return Answer(r.status_code, None, b"", events)
    raw = r.content
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    return Answer(r.status_code, body, raw)


def _outputs(case: Case, a: Answer) -> Any:
    """What a deterministic request must agree on."""
    if case.path in ("/tokenize", "/detokenize"):
        return a.body
    if case.stream:
        texts: dict[int, str] = {}
        finish: dict[int, str | None] = {}
        usage = None
        for e in a.events:
            for c in e["choices"]:
                i = c["index"]
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content") or ""
                texts[i] = texts.get(i, "") + (piece or "")
                if c.get("finish_reason"):
                    finish[i] = c["finish_reason"]
            if e.get("usage"):
                u = e["usage"]
                usage = (u["prompt_tokens"], u["completion_tokens"])
        return sorted(texts.items()), sorted(finish.items()), usage
    body = a.body
    choices = []
    for c in body["choices"]:
        text = c["text"] if "text" in c else c["message"]["content"]
        lp = c.get("logprobs")
        tokens = None
        if lp:
            tokens = lp.get("tokens") or [t["token"] for t in lp.get("content") or []]
        choices.append((c["index"], text, c["finish_reason"], tokens))
    u = body["usage"]
    return choices, (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])


@pytest.fixture(scope="module")
def vllm_serve(tmp_path_factory):
    """vLLM's own server with the engine settings of the ``stack`` fixture's worker."""
    port = stackutil.free_port()
    log_path = tmp_path_factory.mktemp("vllm_serve") / "vllm.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(stackutil.TINY_MODEL_DIR),
        "--served-model-name", MODEL,
        "--max-model-len", str(stackutil.STACK_VLLM_MAX_LEN),
        "--max-num-seqs", "16",
        "--dtype", "bfloat16",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(stackutil.TEST_KV_CACHE_BYTES),
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, **stackutil.localconfig.CPU_ENGINE_ENV, "HF_HUB_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({proc.returncode}); log: {log_path.read_text()[-3000:]}")
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not become healthy; log: {log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_weir_answers_as_vllm_serve_does(stack, vllm_serve):
    weir_headers = {"authorization": f"Bearer {stackutil.KEY_ALPHA}"}
    statuses = shapes = outputs = errors = 0
    shape_cases = output_cases = error_cases = 0
    problems: list[str] = []
    known: list[str] = []
    for case in CORPUS:
        theirs = _send(vllm_serve, case, {})
        ours = _send(stack.envoy_url, case, weir_headers)
        want = DELIBERATE_STATUS.get(case.name)
        if (theirs.status, ours.status) == ((want[0], want[1]) if want else (theirs.status, theirs.status)):
            statuses += 1
        else:
            problems.append(f"{case.name}: status vllm {theirs.status} weir {ours.status}: {ours.raw[:300]!r}")
            continue
        if ours.status != 200:
            error_cases += 1
            err = (ours.body or {}).get("error") or {}
            if set(err) >= {"message", "type", "param", "code"} and "error" in (theirs.body or {}):
                errors += 1
            else:
                problems.append(f"{case.name}: error bodies vllm {theirs.raw[:200]!r} weir {ours.raw[:200]!r}")
            if ours.status == 400 and not err.get("param") and case.name != "malformed-json":
                problems.append(f"{case.name}: weir's 400 names no param: {ours.raw[:200]!r}")
            continue
        shape_cases += 1
        if case.stream:
            mine = set().union(*(_shape(e) for e in ours.events)) if ours.events else set()
            their = set().union(*(_shape(e) for e in theirs.events)) if theirs.events else set()
        else:
            mine, their = _shape(ours.body), _shape(theirs.body)
        odd = _unexplained(mine, their)
        if odd:
            problems.append(f"{case.name}: keys only in vllm {sorted(odd & their)}, only in weir {sorted(odd & mine)}")
        else:
            shapes += 1
        if case.exact:
            output_cases += 1
            a, b = _outputs(case, theirs), _outputs(case, ours)
            if a == b:
                outputs += 1
            elif case.known:
                known.append(f"{case.name}: {case.known}")
            else:
                problems.append(f"{case.name}: outputs differ:\n  vllm {a}\n  weir {b}")
    print(
        f"\ndifferential vs vllm serve: statuses {statuses}/{len(CORPUS)}, shapes {shapes}/{shape_cases}, "
        f"deterministic outputs {outputs}/{output_cases} (known differences: {known or 'none'}), "
        f"error bodies {errors}/{error_cases}"
    )
    assert not problems, "\n".join(problems)
