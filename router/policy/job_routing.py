"""A request's ``Routing`` (shared.protocol: what agents and gateways said)
onto the policy's ``Job``: its session for placement (router.policy.sessions),
its latency target for admission (router.policy.targets) and its fairness
id for the order inside its tenant (router.policy.fairness)."""

from __future__ import annotations

from dataclasses import replace

from router.policy.types import Job
from shared.protocol import Routing


def with_routing(job: Job, routing: Routing) -> Job:
    """``job`` with what ``routing`` says of its session, its latency targets and its fairness id."""
    return replace(
        job,
        session=routing.session,
        parent_session=routing.parent_session if routing.session else "",
        session_final=routing.session_final,
        ttft_target_s=routing.ttft_target_ms / 1000.0,
        sheddable=routing.sheddable,
        fairness_id=routing.fairness_id,
        tpot_target_s=routing.tpot_target_ms / 1000.0,
    )
