"""Latency targets in the simulation: a mixed load over capacity, half the
requests interactive (a TTFT target, sheddable), half batch-like (no
target, long outputs), through three policies on the same arrivals:

* ``weir``: weir's policy with the targets (router.policy.targets predicts
  each target-bearing request's TTFT, refuses the sheddable ones predicted
  late, places them where they start soonest);
* ``targets_off``: the same policy, the requests sent without their targets;
* ``fifo``: ``scheduler.policy = "fifo"``, without targets.

Capacity is measured first on the same fleet and mix (the jobs/s it
completes when always backlogged, FIFO: des.saturation_rate), then the load
is ``load`` x that.  Reported per policy: the share of admitted
target-bearing requests whose first token came within the target, how many
were shed, goodput (target-bearing requests completed within their target
per second, batch output tokens per second, both over the arrival window),
and the TTFT prediction's mean absolute percentage error.

    python -m simulation.targets_des [--workers 4] [--load 1.5] [--duration 120]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from router.policy.targets import FREE, FULL
from shared.config import ClassConfig, SchedulerConfig, SimEngineConfig
from simulation import des
from simulation.des import Workload, occurred
from simulation.driver import Driver, Kind, Record, SimWorker

TARGET_S = 0.2


def mix(target_s: float = TARGET_S, tpot_target_s: float = 0.0, classes: bool = False) -> tuple[Kind, Kind]:
    """(interactive, batch): half each, two tenants of one class (``classes``:
    the interactive half in class ``high``, the batch half in ``batch``)."""
    interactive = Kind(
        "interactive",
        0.5,
        prompt=(128, 1024),
        max_tokens=(16, 128),
        klass="high" if classes else "normal",
        tenants=("app",),
        ttft_target_s=target_s,
        tpot_target_s=tpot_target_s,
        sheddable=True,
    )
    batch = Kind(
        "batch",
        0.5,
        prompt=(256, 2048),
        max_tokens=(256, 1024),
        klass="batch" if classes else "normal",
        tenants=("bulk",),
    )
    return interactive, batch


POLICIES: dict[str, tuple[dict[str, Any], bool]] = {
    # name: (scheduler config, requests carry their targets)
    "weir": ({}, True),
    "targets_off": ({}, False),
    "fifo": ({"policy": "fifo"}, False),
}


@dataclass
class Outcome:
    policy: str
    records: list[Record]
    counters: dict[str, int]
    mape_gauge: float | None  # the policy's own gauge (its last 1,000 predictions)
    tpot_mape_gauge: float | None  # likewise, TPOT
    duration_s: float
    wall_s: float

    def _kind(self, name: str) -> list[Record]:
        return [r for r in self.records if r.kind == name]

    def tpot_stats(self, tpot_target_s: float) -> dict[str, Any]:
        """Of the interactive requests that completed: the share within ``tpot_target_s``."""
        done = [r for r in self._kind("interactive") if r.outcome == "ok" and r.max_tokens > 1]
        tpots = [(occurred(r.finished) - occurred(r.first_token)) / (r.max_tokens - 1) for r in done]
        met = sum(1 for x in tpots if x <= tpot_target_s)
        both = sum(
            1
            for r, x in zip(done, tpots, strict=True)
            if x <= tpot_target_s and _ttft(r) <= TARGET_S and occurred(r.finished) <= self.duration_s
        )
        return {
            "goodput_both_rps": both / self.duration_s,
            "done": len(done),
            "met": met,
            "attainment": met / len(done) if done else math.nan,
            "tpot_p50_s": des.percentile(sorted(tpots), 50),
            "shed": self.counters.get("tpot_target_shed", 0),
        }

    def target_stats(self, target_s: float = TARGET_S) -> dict[str, Any]:
        recs = self._kind("interactive")
        admitted = [r for r in recs if r.submitted is not None and r.outcome not in _REFUSED]
        shed = [r for r in recs if r.outcome == "latency_target_unattainable"]
        started = [(r, _ttft(r)) for r in admitted if r.first_token is not None]
        met = [r for r, ttft in started if ttft <= target_s]
        in_window = [r for r in met if r.outcome == "ok" and r.finished is not None and r.finished <= self.duration_s]
        errors = [
            (abs(ttft - r.predicted_ttft) / ttft, r.ttft_regime)
            for r, ttft in started
            if r.predicted_ttft is not None and ttft > 0
        ]
        by_regime = {k: [x for x, g in errors if g == k] for k in (FREE, FULL)}
        ttfts = sorted(ttft for _, ttft in started)
        return {
            "sent": len(recs),
            "admitted": len(admitted),
            "shed": len(shed),
            "refused_other": len(recs) - len(admitted) - len(shed),
            "met": len(met),
            "attainment": len(met) / len(admitted) if admitted else math.nan,
            "attainment_of_sent": len(met) / len(recs) if recs else math.nan,
            "goodput_rps": len(in_window) / self.duration_s,
            "ttft_p50_s": des.percentile(ttfts, 50),
            "ttft_p99_s": des.percentile(ttfts, 99),
            "mape": sum(x for x, _ in errors) / len(errors) if errors else math.nan,
            "predictions": len(errors),
            # (the regimes: a free slot, every slot taken; router.policy.targets)
            "mape_free": sum(by_regime[FREE]) / len(by_regime[FREE]) if by_regime[FREE] else math.nan,
            "mape_full": sum(by_regime[FULL]) / len(by_regime[FULL]) if by_regime[FULL] else math.nan,
            "share_full": len(by_regime[FULL]) / len(errors) if errors else math.nan,
        }

    def batch_stats(self) -> dict[str, Any]:
        recs = self._kind("batch")
        done = [r for r in recs if r.outcome == "ok" and r.finished is not None and r.finished <= self.duration_s]
        return {
            "sent": len(recs),
            "done_in_window": len(done),
            "refused": sum(1 for r in recs if r.outcome in _REFUSED),
            "tokens_per_s": sum(r.max_tokens for r in done) / self.duration_s,
        }


def _ttft(r: Record) -> float:
    """From its (last) submission to its first token, as the router measures it."""
    assert r.first_token is not None
    return r.first_token - (r.submitted if r.submitted is not None else r.arrival)


# outcomes of a request refused at submit (never admitted)
_REFUSED = {
    "latency_target_unattainable",
    "queue_wait_exceeded",
    "tenant_share_exceeded",
    "queue_full",
    "tenant_queue_full",
    "no_worker",
}


def fleet(n: int = 4, max_num_seqs: int = 32, kv_tokens: int = 65536, slow: int = 0) -> list[SimWorker]:
    """``n`` sim workers; the first ``slow`` of them step twice as slowly (an
    older GPU beside newer ones: they register that step time)."""
    eng = msgspec.structs.replace(SimEngineConfig(), kv_capacity_tokens=kv_tokens)
    slower = msgspec.structs.replace(eng, step_fixed_ms=2 * eng.step_fixed_ms, decode_token_us=2 * eng.decode_token_us)
    return [SimWorker(f"w{i}", max_num_seqs=max_num_seqs, engine=slower if i < slow else eng) for i in range(n)]


def run_one(
    name: str, workers: list[SimWorker], workload: Workload, classes: list[ClassConfig] | None = None
) -> Outcome:
    kw, with_targets = POLICIES[name]
    cfg = msgspec.structs.replace(SchedulerConfig(), **kw)
    if classes is not None:
        cfg = msgspec.structs.replace(cfg, classes=classes)
    wall0 = time.perf_counter()
    d = Driver(cfg, workers, record_predicted=True, pass_each_instant=True, targets=with_targets)
    d.run(des.arrivals(workload), workload.duration_s + 600.0)
    p = d.routers[0]
    wall = time.perf_counter() - wall0
    t = p.targets
    return Outcome(name, list(d.records.values()), dict(p.counters), t.mape(), t.tpot_mape(), workload.duration_s, wall)


def compare(
    n_workers: int = 4,
    load: float = 1.5,
    duration_s: float = 120.0,
    seed: int = 1,
    target_s: float = TARGET_S,
    tpot_target_s: float = 0.0,
    policies: tuple[str, ...] = tuple(POLICIES),
    max_num_seqs: int = 32,
    slow: int = 0,
    classes: bool = False,
) -> tuple[float, float, dict[str, Outcome]]:
    """(capacity jobs/s, offered jobs/s, {policy: Outcome}) on the same arrivals."""
    workers = fleet(n_workers, max_num_seqs, slow=slow)
    kinds = mix(target_s, tpot_target_s, classes)
    # (the probe's requests carry no target: FIFO would shed the sheddable half)
    capacity = des.saturation_rate(workers, mix(0.0, 0.0, classes), probe_rate=100.0 * n_workers)
    rate = load * capacity
    wl = Workload(kinds, rate, duration_s, seed)
    return capacity, rate, {name: run_one(name, workers, wl) for name in policies}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulation.targets_des", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--load", type=float, default=1.5, help="offered load, times the measured capacity")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    ap.add_argument("--target-ms", type=float, default=TARGET_S * 1e3)
    ap.add_argument("--tpot-target-ms", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slow", type=int, default=0, help="this many of the workers step twice as slowly")
    ap.add_argument(
        "--classes", action="store_true", help="the interactive half in class high, the batch half in class batch"
    )
    args = ap.parse_args(argv)
    cap, rate, out = compare(
        args.workers,
        args.load,
        args.duration,
        args.seed,
        args.target_ms / 1e3,
        args.tpot_target_ms / 1e3,
        slow=args.slow,
        classes=args.classes,
    )
    slow = f" ({args.slow} of them twice as slow)" if args.slow else ""
    slow += "; interactive in class high, batch in class batch" if args.classes else ""
    print(
        f"{args.workers} sim workers x 32 seqs{slow}; capacity {cap:.1f} jobs/s (FIFO, backlogged); "
        f"offered {rate:.1f} jobs/s ({args.load:g}x) for {args.duration:g} s; "
        f"TTFT target {args.target_ms:g} ms on the interactive half"
    )
    print(
        "| policy | interactive sent | admitted | shed | met target (of admitted) | met (of sent) | "
        "TTFT p50 / p99 ms | goodput: met req/s | batch tok/s | MAPE | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, o in out.items():
        t, b = o.target_stats(args.target_ms / 1e3), o.batch_stats()
        mape = "-" if math.isnan(t["mape"]) else f"{t['mape'] * 100:.1f} %"
        print(
            f"| {name} | {t['sent']} | {t['admitted']} | {t['shed']} | {t['attainment'] * 100:.1f} % | "
            f"{t['attainment_of_sent'] * 100:.1f} % | {t['ttft_p50_s'] * 1e3:.0f} / {t['ttft_p99_s'] * 1e3:.0f} | "
            f"{t['goodput_rps']:.2f} | {b['tokens_per_s']:.0f} | {mape} | {o.wall_s:.1f} |",
            flush=True,
        )
    ws = out["weir"].target_stats(args.target_ms / 1e3)
    if ws["predictions"]:
        print(
            f"\nweir's TTFT prediction error by regime: a free slot {ws['mape_free'] * 100:.1f} % "
            f"({(1 - ws['share_full']) * 100:.0f} % of predictions), every slot taken {ws['mape_full'] * 100:.1f} % "
            f"({ws['share_full'] * 100:.0f} %)"
        )
    if args.tpot_target_ms > 0:
        print(f"\nTPOT target {args.tpot_target_ms:g} ms on the interactive half (of those completed)")
        print(
            "| policy | completed | TPOT shed | met TPOT target | TPOT p50 ms | TPOT MAPE (policy's gauge) "
            "| goodput: met both req/s |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, o in out.items():
            t = o.tpot_stats(args.tpot_target_ms / 1e3)
            g = "-" if o.tpot_mape_gauge is None else f"{o.tpot_mape_gauge * 100:.1f} %"
            print(
                f"| {name} | {t['done']} | {t['shed']} | {t['attainment'] * 100:.1f} % | "
                f"{t['tpot_p50_s'] * 1e3:.2f} | {g} | {t['goodput_both_rps']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
