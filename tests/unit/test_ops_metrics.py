"""The per-model queue depth the autoscalers read (Policy.queued_by_model,
router/observe/ops_metrics.py) counts what the policy holds, model by model and pool
by pool, and agrees with the per-class view /metrics already had."""

from __future__ import annotations

import msgspec

from router.policy import DispatchJob, Job, Policy, WorkerSpec
from shared.config import SchedulerConfig
from shared.protocol import Pool, TaskType


def _spec(wid: str, model: str, seqs: int) -> WorkerSpec:
    return WorkerSpec(
        worker_id=wid,
        model=model,
        pool=Pool.ANY,
        capacity_tokens=1 << 20,
        block_size=16,
        max_num_seqs=seqs,
        max_model_len=4096,
    )


def _job(i: int, model: str, prompt: int, klass: str = "normal") -> Job:
    return Job(
        job_id=f"{model}-{i}",
        model=model,
        tenant="t",
        klass=klass,
        prompt_tokens=prompt,
        max_tokens=28,
        task_type=TaskType.AUTO,
        arrival=0.0,
    )


def test_queued_by_model_counts_each_model_and_pool_and_drops_what_is_dispatched():
    p = Policy(msgspec.structs.replace(SchedulerConfig(), short_threshold_tokens=1024))
    p.add_worker(_spec("wa", "a", seqs=2), 0.0)
    p.add_worker(_spec("wb", "b", seqs=8), 0.0)
    for i in range(5):
        p.submit(_job(i, "a", 100, klass="high" if i % 2 else "normal"), 0.0)
    p.submit(_job(9, "a", 2000), 0.0)  # over the short threshold: the long pool
    p.submit(_job(0, "b", 100), 0.0)
    assert p.queued_by_model() == {("a", "short"): 5, ("a", "long"): 1, ("b", "short"): 1, ("b", "long"): 0}
    sent = [a for a in p.schedule(0.0) if isinstance(a, DispatchJob)]
    by_model = {m: sum(1 for a in sent if a.job_id.startswith(m + "-")) for m in ("a", "b")}
    assert by_model == {"a": 2, "b": 1}  # a's worker has two slots
    q = p.queued_by_model()
    assert q[("a", "short")] + q[("a", "long")] == 4 and q[("b", "short")] == 0
    # the same total as the per-class, per-pool queues of /metrics (weir_queue_depth)
    assert sum(q.values()) == sum(x["queued"] for x in p.snapshot(0.0)["queues"])
