"""End to end: ``/v1/responses`` through Envoy with the openai SDK -- create
(whole, streamed, in the background), ``previous_response_id`` chaining,
``store: false``, retrieve / delete / cancel, OpenAI's 404 for an unknown id,
refusals before anything is reserved; stored responses shared by two
routers over a real Redis; and, on the real tiny model, a Responses turn
answering exactly what the same chat request answers."""

from __future__ import annotations

import json
import os
import time

import jsonschema
import openai
import pytest
import requests
from stackutil import SIM_MODEL, VLLM_MODEL, sim_worker, start_stack, write_config
from test_e2e_api import metric, sdk, wait_until

KEY = "sk-any"  # the sim stack has no keys configured


def _sdk(stack) -> openai.OpenAI:
    return sdk(stack, KEY)


def test_create_retrieve_chain_and_delete(sim_stack):
    c = _sdk(sim_stack)
    first = c.responses.create(model=SIM_MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=5)
    assert first.id.startswith("resp_") and first.object == "response" and first.status == "incomplete"
    assert first.incomplete_details.reason == "max_output_tokens"
    assert first.instructions == "Be brief." and first.store is True and first.previous_response_id is None
    [msg] = first.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert first.output_text == msg.content[0].text != ""
    assert first.usage.output_tokens == 5 and first.usage.total_tokens == first.usage.input_tokens + 5

    got = c.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()

    second = c.responses.create(model=SIM_MODEL, input="And again.", previous_response_id=first.id, max_output_tokens=3)
    assert second.previous_response_id == first.id
    # the stored conversation (input + output, not the instructions) comes first
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 6
    third = c.responses.create(model=SIM_MODEL, input="And again.", previous_response_id=second.id, max_output_tokens=3)
    assert third.usage.input_tokens > second.usage.input_tokens

    deleted = requests.delete(f"{sim_stack.envoy_url}/v1/responses/{first.id}", headers=_auth(), timeout=10)
    assert deleted.status_code == 200 and deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve(first.id)
    assert e.value.body["param"] == "response_id" and e.value.body["type"] == "invalid_request_error"
    # the later turns carry their own copy of the conversation
    assert c.responses.create(model=SIM_MODEL, input="x", previous_response_id=second.id, max_output_tokens=1)


def _auth() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


def test_unknown_ids_and_store_false_get_openais_404(sim_stack):
    c = _sdk(sim_stack)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=SIM_MODEL, input="hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id" and "resp_nope" in e.value.body["message"]
    unstored = c.responses.create(model=SIM_MODEL, input="hi", store=False, max_output_tokens=2)
    assert unstored.store is False and unstored.status == "incomplete"
    for call in (
        lambda: c.responses.retrieve(unstored.id),
        lambda: c.responses.create(model=SIM_MODEL, input="hi", previous_response_id=unstored.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    r = requests.delete(f"{sim_stack.envoy_url}/v1/responses/resp_nope", headers=_auth(), timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


def test_streamed_events_in_openais_order_and_stored_before_the_last(sim_stack):
    c = _sdk(sim_stack)
    events = list(c.responses.create(model=SIM_MODEL, input="Count.", max_output_tokens=6, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == text == events[-4].text and final.usage.output_tokens == 6
    # stored before its last event was sent: retrievable and continuable at once
    assert c.responses.retrieve(final.id).output_text == text
    with c.responses.stream(
        model=SIM_MODEL, input="More.", previous_response_id=final.id, max_output_tokens=2
    ) as stream:
        done = stream.get_final_response()
    assert done.previous_response_id == final.id and done.usage.output_tokens == 2


def test_bad_input_refused_with_param_before_anything_is_reserved(sim_stack):
    c = _sdk(sim_stack)
    cases = [
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "hi", "background": True, "store": False}, "background"),
    ]
    for body, param in cases:
        r = requests.post(
            f"{sim_stack.envoy_url}/v1/responses", json={"model": SIM_MODEL, **body}, headers=_auth(), timeout=10
        )
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="no-such-model", input="hi")
    rows = requests.get(sim_stack.router_url + "/admin/workers", timeout=5).json()
    assert all(w["running"] == 0 for w in rows)


def test_background_runs_on_and_cancel(sim_stack):
    c = _sdk(sim_stack)
    bg = c.responses.create(model=SIM_MODEL, input="hi", background=True, max_output_tokens=4)
    assert bg.status == "queued" and bg.background is True
    assert wait_until(lambda: c.responses.retrieve(bg.id).status == "incomplete", timeout=20)
    assert c.responses.retrieve(bg.id).usage.output_tokens == 4
    with pytest.raises(openai.BadRequestError):  # done: nothing to cancel (vLLM's answer)
        c.responses.cancel(bg.id)
    long = c.responses.create(model=SIM_MODEL, input="hi", background=True, max_output_tokens=4000)
    time.sleep(0.3)
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert c.responses.retrieve(long.id).status == "cancelled"
    rows = requests.get(sim_stack.router_url + "/admin/workers", timeout=5).json()
    assert wait_until(
        lambda: all(w["running"] == 0 for w in requests.get(sim_stack.router_url + "/admin/workers", timeout=5).json())
    )
    assert rows
    with pytest.raises(openai.NotFoundError):
        c.responses.cancel("resp_nope")
    assert metric(sim_stack, "weir_responses_stored", store="memory") >= 2


def test_two_routers_share_stored_responses_over_redis(tmp_path, redis_url):
    responses = {"store": "redis", "redis_prefix": f"weir-resp-test-{os.getpid()}:", "max_stored": 3}
    quota = {"redis_url": redis_url}
    a = write_config(tmp_path / "a", workers=[sim_worker("sim-a")], quota=quota, responses=responses)
    b = write_config(tmp_path / "b", workers=[sim_worker("sim-b")], quota=quota, responses=responses)
    with start_stack(a, tmp_path / "run-a") as sa, start_stack(b, tmp_path / "run-b") as sb:
        ca, cb = _sdk(sa), _sdk(sb)
        first = ca.responses.create(model=SIM_MODEL, input="Remember this.", max_output_tokens=3)
        assert cb.responses.retrieve(first.id).output_text == first.output_text
        events = list(
            cb.responses.create(
                model=SIM_MODEL, input="And?", previous_response_id=first.id, max_output_tokens=2, stream=True
            )
        )
        second = events[-1].response
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 6
        assert ca.responses.retrieve(second.id).output_text == second.output_text
        requests.delete(f"{sb.envoy_url}/v1/responses/{second.id}", headers=_auth(), timeout=10).raise_for_status()
        with pytest.raises(openai.NotFoundError):
            ca.responses.retrieve(second.id)
        # the count bound holds across routers: the oldest are evicted
        ids = [
            (ca if i % 2 else cb).responses.create(model=SIM_MODEL, input=str(i), max_output_tokens=1).id
            for i in range(4)
        ]
        with pytest.raises(openai.NotFoundError):
            cb.responses.retrieve(ids[0])
        assert cb.responses.retrieve(ids[-1]).id == ids[-1]
        evicted = [metric(s, "weir_responses_evicted_total", why="count") for s in (sa, sb)]
        assert sum(evicted) >= 2, evicted


def test_real_model_turn_answers_what_chat_answers(stack):
    """Greedy: a Responses turn is the chat request it translates to, token for token."""
    c = sdk(stack)
    kw = {"temperature": 0, "extra_body": {}}
    chat = c.chat.completions.create(
        model=VLLM_MODEL,
        max_tokens=8,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
        **kw,
    )
    resp = c.responses.create(
        model=VLLM_MODEL, instructions="You are terse.", input="Name a colour.", max_output_tokens=8, **kw
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    events = list(
        c.responses.create(
            model=VLLM_MODEL,
            instructions="You are terse.",
            input="Name a colour.",
            max_output_tokens=8,
            stream=True,
            **kw,
        )
    )
    assert events[-1].response.output_text == resp.output_text


# ------------------------------------------------------------------ tools (the real model, its hermes parser)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _valid_call(item) -> dict:
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id
    args = json.loads(item.arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    return args


def test_tool_calls_named_required_streamed_and_a_tool_result_turn(stack):
    c = sdk(stack)  # the session stack: tiny-llama with the hermes parser
    named = {"type": "function", "name": "get_weather"}
    calls = []
    # seeded sampling (vLLM's extra): greedy, the random-weight model may write whitespace to the limit
    for seed, choice in enumerate((named, "required", named, "required")):
        r = c.responses.create(
            model=VLLM_MODEL,
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice=choice,
            max_output_tokens=200,
            extra_body={"seed": seed},
        )
        assert r.status == "completed", r.output
        assert r.output and all(o.type == "function_call" for o in r.output)
        calls += [_valid_call(o) for o in r.output]
    assert calls  # every call's arguments valid for the schema (the constraint's promise)

    # the tool's result as the next turn's input, after the stored call
    first = c.responses.create(
        model=VLLM_MODEL,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice=named,
        max_output_tokens=200,
        extra_body={"seed": 5},
    )
    [call] = first.output
    follow = c.responses.create(
        model=VLLM_MODEL,
        previous_response_id=first.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=4,
        temperature=0,
    )
    assert follow.status in ("completed", "incomplete") and follow.previous_response_id == first.id
    # the same prompt as the chat request it stands for (the stored call, then the tool's message)
    chat = c.chat.completions.create(
        model=VLLM_MODEL,
        max_tokens=4,
        temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        messages=[
            {"role": "user", "content": "Weather in Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
        ],
    )
    assert follow.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens

    # streamed: the call's items when the turn ends, arguments whole
    events = list(
        c.responses.create(
            model=VLLM_MODEL,
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=200,
            extra_body={"seed": 6},
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert "response.function_call_arguments.done" in types and types[-1] == "response.completed"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.model_dump() for e in done] == [o.model_dump() for o in events[-1].response.output]
    for o in events[-1].response.output:
        _valid_call(o)
    # no parser-less surprises: auto with this model's parser is served too
    auto = c.responses.create(model=VLLM_MODEL, input="hi", tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert auto.status in ("completed", "incomplete")
