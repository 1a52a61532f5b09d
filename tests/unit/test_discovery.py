"""engine_worker/discovery.py with an injected resolver: which addresses are
linked and unlinked as a name's records change, and what a failing name does.
The same through real getaddrinfo and real routers: tests/e2e/test_discovery_e2e.py."""

from __future__ import annotations

import asyncio

import pytest

from engine_worker.discovery import RouterDiscovery, diff, endpoint, parse


def test_only_dns_names_over_tcp_are_discovered():
    assert parse("tcp://weir-routers.weir.svc.cluster.local:5556") == ("weir-routers.weir.svc.cluster.local", 5556)
    assert parse("tcp://localhost:1") == ("localhost", 1)
    for static in ("tcp://127.0.0.1:5556", "tcp://[::1]:5556", "ipc:///tmp/x", "inproc://r", "tcp://*:5556"):
        assert parse(static) is None, static
    assert endpoint("10.0.0.7", 5556) == "tcp://10.0.0.7:5556"
    assert endpoint("fd00::7", 5556) == "tcp://[fd00::7]:5556"
    assert diff(["a", "b"], ["b", "c"]) == (["c"], ["a"])


class _Fleet:
    """What the worker would do: linked addresses; some routers still hold requests."""

    def __init__(self) -> None:
        self.linked: list[str] = []
        self.busy: set[str] = set()
        self.records: dict[str, list[str] | OSError] = {}
        self.calls = 0

    def resolve(self, host: str, port: int) -> list[str]:
        self.calls += 1
        r = self.records[host]
        if isinstance(r, OSError):
            raise r
        return list(r)

    def link(self, addr: str) -> None:
        assert addr not in self.linked
        self.linked.append(addr)

    def unlink(self, addr: str) -> bool:
        if addr in self.busy:
            return False
        self.linked.remove(addr)
        return True


def _run(coro):
    return asyncio.run(coro)


def test_addresses_appear_and_disappear_with_the_records():
    async def go():
        f = _Fleet()
        f.records["routers"] = ["10.0.0.1", "10.0.0.2"]
        d = RouterDiscovery(asyncio.get_running_loop(), [("routers", 5556)], 0.01, f.link, f.unlink, f.resolve)
        await d.resolve_due()
        assert sorted(f.linked) == ["tcp://10.0.0.1:5556", "tcp://10.0.0.2:5556"]
        f.records["routers"] = ["10.0.0.2", "10.0.0.3"]  # a pod replaced by another
        await asyncio.sleep(0.02)
        await d.resolve_due()
        assert sorted(f.linked) == ["tcp://10.0.0.2:5556", "tcp://10.0.0.3:5556"]
        # a router that left DNS but still holds requests here (draining) keeps its link until it holds none
        f.records["routers"] = ["10.0.0.3"]
        f.busy.add("tcp://10.0.0.2:5556")
        await asyncio.sleep(0.02)
        await d.resolve_due()
        assert sorted(f.linked) == ["tcp://10.0.0.2:5556", "tcp://10.0.0.3:5556"]
        f.busy.clear()
        await asyncio.sleep(0.02)
        await d.resolve_due()
        assert f.linked == ["tcp://10.0.0.3:5556"]

    _run(go())


def test_a_failing_name_keeps_its_links_and_backs_off(caplog):
    async def go():
        f = _Fleet()
        f.records["routers"] = ["10.0.0.1"]
        d = RouterDiscovery(asyncio.get_running_loop(), [("routers", 5556)], 0.05, f.link, f.unlink, f.resolve)
        await d.resolve_due()
        f.records["routers"] = OSError("Name or service not known")
        task = asyncio.get_running_loop().create_task(d.run())
        await asyncio.sleep(0.6)  # back-off 0.05, 0.1, 0.2, 0.4: ~4-5 tries, not 12
        task.cancel()
        assert f.linked == ["tcp://10.0.0.1:5556"]  # kept through the outage
        assert 3 <= f.calls - 1 <= 6, f.calls
        warnings = [r for r in caplog.records if "retrying" in r.getMessage()]
        assert len(warnings) == 1  # once per failure streak
        f.records["routers"] = []  # resolves to nothing: the same
        d.poke()
        await d.resolve_due()
        assert f.linked == ["tcp://10.0.0.1:5556"]
        f.records["routers"] = ["10.0.0.9"]
        d.poke()
        await d.resolve_due()
        assert f.linked == ["tcp://10.0.0.9:5556"]

    _run(go())


def test_poke_resolves_at_once_not_after_the_interval():
    async def go():
        f = _Fleet()
        f.records["routers"] = ["10.0.0.1"]
        d = RouterDiscovery(asyncio.get_running_loop(), [("routers", 5556)], 60.0, f.link, f.unlink, f.resolve)
        task = asyncio.get_running_loop().create_task(d.run())
        await asyncio.sleep(0.05)
        f.records["routers"] = ["10.0.0.2"]
        d.poke()  # a link was lost
        await asyncio.sleep(0.1)
        task.cancel()
        assert f.linked == ["tcp://10.0.0.2:5556"]

    _run(go())


@pytest.mark.parametrize("interval", [0.0])
def test_interval_zero_turns_discovery_off(interval):
    from shared.config import loads

    cfg = loads(
        '[[models]]\nname = "sim-x"\nengine = "sim"\n'
        f'[[workers]]\nid = "w"\nmodel = "sim-x"\nrouters = ["tcp://r.example:5556"]\ndiscovery_interval_s = {interval}\n'
    )
    assert cfg.workers[0].discovery_interval_s == 0.0
    from shared.config import ConfigError

    with pytest.raises(ConfigError, match="discovery_interval_s"):
        loads(
            '[[models]]\nname = "sim-x"\nengine = "sim"\n[[workers]]\nid = "w"\nmodel = "sim-x"\ndiscovery_interval_s = -1\n'
        )
