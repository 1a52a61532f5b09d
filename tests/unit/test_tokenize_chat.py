"""/tokenize with ``messages`` and the chat-template fields renders the ids a
chat completion with the same fields is given (router.api.tokenize
reuses the chat path's options; test_tools_vllm checks those against vLLM),
and refuses what the chat path refuses, naming the field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest
from test_tools_vllm import HISTORY, MODEL, TOOLS, TOOLS_TEMPLATE, USER

from router.api import RequestError, parse_chat
from router.api.request import RequestMeta
from router.api.tokenize import parse_tokenize
from router.ingress.tokenize import answer_tokenize
from router.lifecycle import prompts as prompts_module
from router.lifecycle.prompts import ModelPrompts

CASES = {
    "plain": {"messages": USER[:1]},
    "no-generation-prompt": {"messages": USER, "add_generation_prompt": False},
    "continue-final": {"messages": USER, "add_generation_prompt": False, "continue_final_message": True},
    "kwargs-read": {"messages": USER[:1], "chat_template_kwargs": {"enable_thinking": True}},
    "kwargs-generation-prompt": {"messages": USER[:1], "chat_template_kwargs": {"add_generation_prompt": False}},
    "tools": {"messages": USER[:1], "tools": TOOLS},
    "tool-turn": {"messages": HISTORY, "tools": TOOLS},
    "special-tokens": {"messages": USER[:1], "add_special_tokens": True},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Iterator[dict[str, ModelPrompts]]:
    # "auto" tools compile their schemas, which imports xgrammar: the process
    # forgets it afterwards (test_lifecycle checks the first import's path).
    first = prompts_module._xgr
    d = tmp_path_factory.mktemp("tools-model")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(MODEL / name, d / name)
    (d / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    yield {"tiny": ModelPrompts(str(MODEL), "hermes", True), "tools": ModelPrompts(str(d), "hermes", True)}
    prompts_module._xgr = first


def _tokenize(prompts: ModelPrompts, body: dict) -> list[int]:
    job = parse_tokenize(json.dumps({"model": "tiny-llama", **body}).encode())
    return json.loads(answer_tokenize(prompts, job, 512))["tokens"]


@pytest.mark.parametrize("template", ["tiny", "tools"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tokenize_renders_the_ids_the_chat_path_does(models, template, case):
    prompts = models[template]
    body = CASES[case]
    sub, _ = parse_chat(json.dumps({"model": "tiny-llama", **body}).encode(), RequestMeta(), "r")
    assert _tokenize(prompts, body) == prompts.tokenize(sub).ids


def test_tools_reach_the_template_and_options_change_the_ids(models):
    prompts = models["tools"]
    plain = _tokenize(prompts, {"messages": USER[:1]})
    with_tools = _tokenize(prompts, {"messages": USER[:1], "tools": TOOLS})
    assert len(with_tools) > len(plain) and "Tools: get_weather=" in prompts.decode(with_tools)
    no_prompt = _tokenize(prompts, {"messages": USER[:1], "add_generation_prompt": False})
    assert no_prompt != plain and plain[: len(no_prompt)] == no_prompt
    thinking = _tokenize(prompts, {"messages": USER[:1], "chat_template_kwargs": {"enable_thinking": True}})
    assert thinking[: len(plain)] == plain and len(thinking) > len(plain)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": "{{ messages }}"}}, "chat_template"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt's default
        ({"tools": [{"type": "function"}]}, None),  # no function: not a tool
    ],
)
def test_tokenize_refuses_what_the_chat_path_refuses(extra, param):
    body = json.dumps({"model": "tiny-llama", "messages": USER[:1], **extra}).encode()
    with pytest.raises(RequestError) as e:
        parse_tokenize(body)
    assert e.value.info.status == 400
    if param is not None:
        assert e.value.info.param == param
