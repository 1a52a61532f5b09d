"""/v1/models and /v1/models/{id} on the router's real HTTP ingress, core and
views (a fake worker link): with API keys configured they answer only a valid
key, and a missing, wrong or malformed key gets exactly what a completion
gets (401, the same OpenAI error body); a valid key sees the models and the
adapters it may use.  Without keys they stay open (the anonymous tenant)."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import requests
from fakes import LoopThread, registration
from test_views import FakeLink

from router.ingress.http_server import start_http_server
from router.lifecycle.core import RouterCore
from router.lifecycle.reads import RouterCoreReads
from router.observe.metrics import RouterMetrics
from router.observe.views import RouterViews
from shared.config import Config
from shared.keys import digest

MODEL = "sim-m"
KEY = "sk-models-valid"
MALFORMED = "sk-bad key"  # a space inside: not a key's text (shared.keys.well_formed)


class Router:
    """A RouterCore, its views and its HTTP ingress on a uvloop in a thread of their own."""

    def __init__(self, keys: list[str]) -> None:
        cfg = msgspec.convert(
            {
                "models": [{"name": MODEL, "engine": "sim", "max_model_len": 4096}],
                "api_keys": [{"key_sha256": digest(k), "tenant": "t"} for k in keys],
            },
            Config,
        )
        self.lt = LoopThread()
        self.loop = self.lt.loop
        link = FakeLink()

        async def start():
            metrics = RouterMetrics()
            core = RouterCore(cfg, self.loop, link, metrics=metrics)
            link.models["w0"] = MODEL
            core.worker_joined(registration("w0", MODEL))
            views = RouterViews(RouterCoreReads(core), link, metrics)
            return core, await start_http_server(core, views, metrics, "127.0.0.1", 0)

        self.core, self.srv = self.lt.run(start())
        self.url = f"http://127.0.0.1:{self.srv.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        self.lt.stop(self.srv.close, self.core.close)


@pytest.fixture
def keyed() -> Iterator[Router]:
    r = Router([KEY])
    yield r
    r.close()


@pytest.fixture
def open_router() -> Iterator[Router]:
    r = Router([])
    yield r
    r.close()


REFUSED = [
    pytest.param({}, id="no-key"),
    pytest.param({"authorization": "Bearer sk-wrong"}, id="wrong-bearer"),
    pytest.param({"x-api-key": KEY + "x"}, id="wrong-x-api-key"),
    pytest.param({"authorization": f"Basic {KEY}"}, id="not-bearer"),
    pytest.param({"x-api-key": MALFORMED}, id="malformed"),
]


@pytest.mark.parametrize("headers", REFUSED)
@pytest.mark.parametrize("path", ["/v1/models", f"/v1/models/{MODEL}", "/v1/models/nope"])
def test_models_without_a_valid_key_answer_as_a_completion_does(keyed, path, headers):
    completion = requests.post(
        keyed.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        headers=headers,
        timeout=10,
    )
    assert completion.status_code == 401, completion.text
    r = requests.get(keyed.url + path, headers=headers, timeout=10)
    assert r.status_code == 401, r.text
    err, expected = r.json()["error"], completion.json()["error"]
    expected.pop("request_id")  # a generation's own id; the rest is the same error
    assert err == expected
    assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
    assert MODEL not in r.text
    if headers.get("x-api-key") == MALFORMED:
        assert err["message"].startswith("Malformed API key")


@pytest.mark.parametrize(
    "headers", [{"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"authorization": f"bearer \t {KEY}"}], ids=str
)
def test_models_with_a_valid_key_list_the_models(keyed, headers):
    listed = requests.get(keyed.url + "/v1/models", headers=headers, timeout=10)
    assert listed.status_code == 200, listed.text
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]
    one = requests.get(keyed.url + f"/v1/models/{MODEL}", headers=headers, timeout=10)
    assert one.status_code == 200 and one.json() == listed.json()["data"][0]
    missing = requests.get(keyed.url + "/v1/models/nope", headers=headers, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-anything"}], ids=["no-key", "any-key"])
def test_without_keys_configured_models_stay_open(open_router, headers):
    listed = requests.get(open_router.url + "/v1/models", headers=headers, timeout=10)
    assert listed.status_code == 200, listed.text
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]
    one = requests.get(open_router.url + f"/v1/models/{MODEL}", headers=headers, timeout=10)
    assert one.status_code == 200 and one.json()["id"] == MODEL
