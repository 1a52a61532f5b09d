"""Stored objects have owners, on real processes through Envoy: one tenant
cannot read, continue, cancel or delete another's stored response (404, as
for an id never stored), a keyless client gets 401; ``metadata`` is held to
OpenAI's limits; the Redis store keeps each tenant's responses within its
own bounds; and a reload that removes a key, or moves it to another tenant,
cancels that key's running batches and makes its stored responses unreadable."""

from __future__ import annotations

import asyncio
import json
import os
import time
import tomllib

import openai
import pytest
import requests
import tomli_w
from stackutil import KEY_ALPHA, KEY_BETA, SIM_MODEL, sim_worker, start_stack, write_config

from router.services.response_store import RedisResponseStore, decode_record, encode_record
from shared.config import load


def _h(key: str | None) -> dict[str, str]:
    return {} if key is None else {"authorization": f"Bearer {key}"}


def _create(base: str, key: str | None, **body) -> requests.Response:
    body = {"model": SIM_MODEL, "input": "Remember the number 7.", "max_output_tokens": 3, **body}
    return requests.post(f"{base}/v1/responses", json=body, headers=_h(key), timeout=30)


def _refused(r: requests.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_another_tenant_cannot_read_continue_cancel_or_delete_a_stored_response(stack):
    base = stack.envoy_url
    mine = _create(base, KEY_ALPHA)
    assert mine.status_code == 200, mine.text
    rid = mine.json()["id"]
    url = f"{base}/v1/responses/{rid}"
    never = f"{base}/v1/responses/resp_{'0' * 48}"

    # tenant beta: every way in is the 404 of an id that was never stored (not a 403)
    unknown = _refused(requests.get(never, headers=_h(KEY_BETA), timeout=10), 404, "response_id")
    err = _refused(requests.get(url, headers=_h(KEY_BETA), timeout=10), 404, "response_id")
    assert (err["type"], err["code"]) == (unknown["type"], unknown["code"])
    assert err["message"] == unknown["message"].replace("0" * 48, rid[len("resp_") :])
    _refused(requests.delete(url, headers=_h(KEY_BETA), timeout=10), 404, "response_id")
    _refused(requests.post(url + "/cancel", headers=_h(KEY_BETA), timeout=10), 404, "response_id")
    _refused(_create(base, KEY_BETA, previous_response_id=rid, input="What number?"), 404, "previous_response_id")

    # no key, or a wrong one: 401 before anything is looked up
    for key in (None, "sk-not-a-key"):
        for r in (
            requests.get(url, headers=_h(key), timeout=10),
            requests.delete(url, headers=_h(key), timeout=10),
            requests.post(url + "/cancel", headers=_h(key), timeout=10),
            _create(base, key, previous_response_id=rid),
        ):
            assert _refused(r, 401)["code"] == "invalid_api_key"

    # the owner still has it, whole, and may continue it, then delete it
    got = requests.get(url, headers=_h(KEY_ALPHA), timeout=10)
    assert got.status_code == 200 and got.json() == mine.json()
    assert _create(base, KEY_ALPHA, previous_response_id=rid, input="What number?").status_code == 200
    assert requests.delete(url, headers=_h(KEY_ALPHA), timeout=10).json()["deleted"] is True
    _refused(requests.get(url, headers=_h(KEY_ALPHA), timeout=10), 404, "response_id")

    # a background response: another tenant's cancel is a 404 whether it still runs or not
    bg = _create(base, KEY_ALPHA, background=True, max_output_tokens=400)
    assert bg.status_code == 200, bg.text
    bg_url = f"{base}/v1/responses/{bg.json()['id']}"
    _refused(requests.post(bg_url + "/cancel", headers=_h(KEY_BETA), timeout=10), 404, "response_id")
    assert requests.post(bg_url + "/cancel", headers=_h(KEY_ALPHA), timeout=10).status_code in (200, 400)


def test_metadata_over_openais_limits_is_a_400_naming_metadata(stack):
    base = stack.envoy_url
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        _refused(_create(base, KEY_ALPHA, metadata=metadata), 400, "metadata")
    ok = _create(base, KEY_ALPHA, metadata={f"k{i}": "v" * 512 for i in range(16)})
    assert ok.status_code == 200 and len(ok.json()["metadata"]) == 16
    # batches too: checked before anything is created
    c = openai.OpenAI(base_url=base + "/v1", api_key=KEY_ALPHA, max_retries=0, timeout=30)
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": SIM_MODEL, "prompt": "x", "max_tokens": 1},
    }
    f = c.files.create(file=("m.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", metadata={"k" * 65: "v"}
        )
    assert e.value.body["param"] == "metadata"
    assert not any(b.input_file_id == f.id for b in c.batches.list())
    c.files.delete(f.id)


def test_the_redis_store_keeps_owners_and_evicts_within_each_tenants_bounds(redis_url):
    bounds = {"noisy": (3, 1 << 20), "quiet": (2, 1 << 20), "small": (100, 300)}
    prefix = f"weir-own-test-{os.getpid()}:"

    async def run() -> None:
        a = RedisResponseStore(redis_url, prefix, 2.0, 10, 3600.0, 1 << 20, bounds=lambda t: bounds[t])
        b = RedisResponseStore(redis_url, prefix, 2.0, 10, 3600.0, 1 << 20, bounds=lambda t: bounds[t])  # 2nd router
        rec = encode_record(b"{}", [{"role": "user", "content": "y" * 50}], "quiet", "k-quiet")
        assert len(rec) * 3 > 300 >= len(rec) * 2
        await a.put("q1", rec, "quiet")
        await b.put("q2", rec, "quiet")
        for i in range(50):
            await (a if i % 2 else b).put(f"n{i}", rec, "noisy")
        got = await b.get("q1")
        assert got is not None and (decode_record(got).tenant, decode_record(got).key) == ("quiet", "k-quiet")
        assert await a.get("q2") == rec
        assert [await a.get(f"n{i}") is not None for i in (46, 47, 48, 49)] == [False, True, True, True]
        await a.put("q3", rec, "quiet")
        assert await b.get("q1") is None and await b.get("q3") == rec
        for i in range(5):
            await b.put(f"s{i}", rec, "small")
        assert [await a.get(f"s{i}") is not None for i in range(5)] == [False, False, False, True, True]
        # a delete names the tenant whose shelf it is on: its count and bytes go with it
        assert not await a.delete("q3", "noisy") and await a.get("q3") == rec
        assert await a.delete("q3", "quiet") and await b.get("q3") is None
        client = a._redis()
        assert int(await client.get(prefix + "b:small")) == 2 * len(rec)
        assert await client.zcard(prefix + "t:noisy") == 3 and await client.zcard(prefix + "t:quiet") == 1
        assert a.evicted["count"] + b.evicted["count"] == 47 + 1 and a.evicted["bytes"] + b.evicted["bytes"] == 3
        await a.close()
        await b.close()

    asyncio.run(run())


# ------------------------------------------------------------------ revocation

A1, A2 = "sk-own-alpha-one", "sk-own-alpha-two"
B1, B2 = "sk-own-beta-one", "sk-own-beta-two"
SLOW_SIM = {"step_fixed_ms": 3.0, "decode_token_us": 60.0}  # a few hundred 64-token lines take seconds


def _keys(moved: bool = False) -> list[dict]:
    """A1 (alpha) and B1 (beta) are revoked by the reload: A1 removed, B1 moved to tenant delta."""
    keys = [{"key": A2, "tenant": "alpha"}, {"key": B2, "tenant": "beta"}]
    if not moved:
        return [{"key": A1, "tenant": "alpha"}, {"key": B1, "tenant": "beta"}, *keys]
    return [{"key": B1, "tenant": "delta"}, *keys]


def _client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.envoy_url + "/v1", api_key=key, max_retries=3, timeout=30)


def _slow_batch(c: openai.OpenAI) -> str:
    rows = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": SIM_MODEL, "prompt": f"line {i}", "max_tokens": 64},
        }
        for i in range(400)
    ]
    f = c.files.create(file=("slow.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in rows)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id


def _wait(c: openai.OpenAI, bid: str, statuses: set[str], timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while (b := c.batches.retrieve(bid)).status not in statuses:
        assert time.monotonic() < deadline, f"batch stuck in {b.status}: {b.request_counts}"
        time.sleep(0.2)
    return b


def test_a_reload_that_removes_or_moves_a_key_cancels_its_batches_and_hides_its_responses(tmp_path):
    cfg_path = write_config(
        tmp_path,
        workers=[sim_worker("sim-0", max_num_seqs=8, sim=SLOW_SIM)],
        api_keys=_keys(),
        batch={"scan_interval_s": 0.2},
    )
    with start_stack(cfg_path, tmp_path / "run") as stack:
        base = stack.envoy_url
        made = {k: _create(base, k).json()["id"] for k in (A1, A2, B1, B2)}
        batches = {k: _slow_batch(_client(stack, k)) for k in (A1, B1)}
        for k, bid in batches.items():
            _wait(_client(stack, k), bid, {"in_progress"})
        # the tenant's other key sees what A1 made, while A1 is configured
        assert requests.get(f"{base}/v1/responses/{made[A1]}", headers=_h(A2), timeout=10).status_code == 200

        conf = tomllib.loads(cfg_path.read_text())
        conf.pop("base_dir", None)
        conf["api_keys"] = _keys(moved=True)
        cfg_path.write_text(tomli_w.dumps(conf))
        load(cfg_path)
        assert requests.post(stack.router_url + "/admin/reload", timeout=5).json()["ok"] is True

        for revoked, other in ((A1, A2), (B1, B2)):
            c = _client(stack, other)
            done = _wait(c, batches[revoked], {"cancelled", "completed", "failed"})
            assert done.status == "cancelled", (done.status, done.request_counts)
            assert [e.code for e in done.errors.data] == ["api_key_revoked"]
            counts = done.request_counts
            assert counts.completed < 400 and counts.completed + counts.failed == 400, counts
            errs = [json.loads(x) for x in c.files.content(done.error_file_id).content.splitlines()]
            revoked_lines = [e for e in errs if e["error"] and e["error"]["code"] == "api_key_revoked"]
            assert len(revoked_lines) == counts.failed > 0
            assert all("API key" in e["error"]["message"] and e["response"] is None for e in revoked_lines)
            out = [] if done.output_file_id is None else c.files.content(done.output_file_id).content.splitlines()
            assert len({json.loads(x)["custom_id"] for x in out} | {e["custom_id"] for e in errs}) == 400
            # the revoked key's stored response is gone for its tenant's other key; theirs stays
            r = requests.get(f"{base}/v1/responses/{made[revoked]}", headers=_h(other), timeout=10)
            _refused(r, 404, "response_id")
            assert requests.get(f"{base}/v1/responses/{made[other]}", headers=_h(other), timeout=10).status_code == 200
        # A1 is no key at all; B1 now speaks for tenant delta, which owns none of it
        _refused(requests.get(f"{base}/v1/responses/{made[A1]}", headers=_h(A1), timeout=10), 401)
        _refused(requests.get(f"{base}/v1/responses/{made[B1]}", headers=_h(B1), timeout=10), 404, "response_id")
        with pytest.raises(openai.NotFoundError):
            _client(stack, B1).batches.retrieve(batches[B1])


def test_one_tenants_stored_responses_never_evict_anothers(tmp_path):
    """Each tenant's own bound: alpha storing far past it evicts only alpha's
    oldest; beta, with a bound of its own in [[tenants]], keeps all of its."""
    cfg_path = write_config(
        tmp_path,
        workers=[sim_worker("sim-0")],
        api_keys=_keys(),
        responses={"max_stored": 3},
        tenants=[{"name": "beta", "responses_max_stored": 5}],
    )
    with start_stack(cfg_path, tmp_path / "run") as stack:
        base = stack.envoy_url
        beta = [_create(base, B2, input=f"b{i}").json()["id"] for i in range(5)]
        alpha = [_create(base, A2, input=f"a{i}").json()["id"] for i in range(20)]
        for key, ids, kept in ((B2, beta, 5), (A2, alpha, 3)):
            found = [requests.get(f"{base}/v1/responses/{rid}", headers=_h(key), timeout=10).status_code for rid in ids]
            assert found == [404] * (len(ids) - kept) + [200] * kept, (key, found)
