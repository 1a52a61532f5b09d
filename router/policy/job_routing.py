"""A request's ``Routing`` (shared.protocol: what agents and gateways said)
onto the policy's ``Job``: its session for placement (router.policy.sessions)
and its latency target for admission (router.policy.targets)."""

from __future__ import annotations

from dataclasses import replace

from router.policy.types import Job
from shared.protocol import Routing


def with_routing(job: Job, routing: Routing) -> Job:
    """``job`` with what ``routing`` says of its session and its latency targets."""
    return replace(
        job,
        session=routing.session,
        parent_session=routing.parent_session if routing.session else "",
        session_final=routing.session_final,
        ttft_target_s=routing.ttft_target_ms / 1000.0,
        sheddable=routing.sheddable,
        tpot_target_s=routing.tpot_target_ms / 1000.0,
    )
