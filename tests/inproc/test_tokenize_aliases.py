"""/tokenize and /detokenize name a model as generation does: an alias
([[aliases]]) is resolved to the model a request of the same session is
sent to, and a deployment's own session header (scheduler.session_headers)
is read by the HTTP ingress like the built-in ones.  The router's real HTTP
ingress and core in one process (fake workers, tiny-llama's tokenizer); the
two targets differ in max_model_len, which /tokenize reports, so the answer
shows which one tokenized."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import requests
from fakes import FakeClock, FakeWorkers, LoopThread

from router.api.aliases import pick
from router.ingress.http_server import start_http_server
from router.lifecycle.core import RouterCore
from shared.config import Config

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"
LENS = {"sim-a": 4096, "sim-b": 2048}
CUSTOM = "x-my-agent-session"

pytestmark = pytest.mark.skipif(not (TINY / "tokenizer.json").exists(), reason="models/tiny-llama not built")


@pytest.fixture(scope="module")
def router():
    cfg = msgspec.convert(
        {
            "models": [{"name": n, "engine": "sim", "path": str(TINY), "max_model_len": v} for n, v in LENS.items()],
            "aliases": [
                {"name": "pub", "targets": [{"model": "sim-a", "weight": 1}, {"model": "sim-b", "weight": 1}]},
                {"name": "one", "targets": [{"model": "sim-b"}]},
            ],
            "scheduler": {"session_headers": [CUSTOM]},
        },
        Config,
    )
    lt = LoopThread()

    async def start():
        core = RouterCore(cfg, lt.loop, FakeWorkers(), clock=FakeClock())
        srv = await start_http_server(
            core, core, core.metrics, "127.0.0.1", 0, session_headers=cfg.scheduler.session_headers
        )
        return core, srv

    core, srv = lt.run(start())
    yield cfg, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    lt.stop(srv.close, core.close)


def _tokenize(url: str, model: str, headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(url + "/tokenize", json={"model": model, "prompt": "Hello there"}, headers=headers, timeout=30)


def test_an_alias_tokenizes_as_its_target_does(router):
    cfg, url = router
    direct = _tokenize(url, "sim-b")
    assert direct.status_code == 200, direct.text
    got = _tokenize(url, "one")
    assert got.status_code == 200, got.text
    assert got.json() == direct.json()  # the same ids, count and max_model_len as its one target
    detok = requests.post(url + "/detokenize", json={"model": "one", "tokens": direct.json()["tokens"]}, timeout=30)
    assert detok.status_code == 200, detok.text
    assert "Hello there" in detok.json()["prompt"]
    missing = _tokenize(url, "no-such-alias")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


@pytest.mark.parametrize("header", ["x-session-id", CUSTOM])
def test_a_split_alias_tokenizes_with_the_target_its_session_is_sent_to(router, header):
    """Each session's answer comes from the target the alias draws for that
    session (router.api.aliases.pick, what generation draws by); the
    configured session header is kept by the ingress and read as a session."""
    cfg, url = router
    (alias,) = [a for a in cfg.aliases if a.name == "pub"]
    seen = set()
    for k in range(12):
        session = f"agent-{k}"
        got = _tokenize(url, "pub", {header: session})
        assert got.status_code == 200, got.text
        assert got.json()["max_model_len"] == LENS[pick(alias, session)], session
        seen.add(got.json()["max_model_len"])
    assert seen == set(LENS.values())  # both targets drawn: the session decided, not a fixed choice
