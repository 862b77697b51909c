"""A bucket plan as plain data (lists, numbers, strings), for checkpoints and fixed plans.

:meth:`DataParallel.plan_state` writes this form and :meth:`DataParallel.load_plan_state`
reads it; plain data loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucket, Gate, Launch, Plan, ReadyTensor


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """``plan`` as nested dicts and lists of numbers and strings.

    Args:
        plan: the plan to write.
    """
    return {
        "strategy": plan.strategy,
        "buckets": [
            {
                "indices": list(bucket.indices),
                "nbytes": bucket.nbytes,
                "ready_s": bucket.ready_s,
                "start_s": bucket.start_s,
                "end_s": bucket.end_s,
                "channels": list(bucket.channels),
            }
            for bucket in plan.buckets
        ],
        "backward_s": plan.backward_s,
        "forward_s": plan.forward_s,
        "cost": {
            "a": plan.cost.a,
            "b": plan.cost.b,
            "concurrency": [list(term) for term in plan.cost.concurrency],
        },
        "tensors": [
            {"name": tensor.name, "nbytes": tensor.nbytes, "ready_s": tensor.ready_s}
            for tensor in plan.tensors
        ],
        "channels": plan.channels,
        "partition_bytes": plan.partition_bytes,
        "launches": [
            [x.bucket, x.part, x.parts, x.nbytes, x.channel, x.start_s, x.end_s]
            for x in plan.launches
        ],
        "gates": [
            {"name": gate.name, "tensors": list(gate.tensors), "forward_s": gate.forward_s}
            for gate in plan.gates
        ],
        "step_s": plan.step_s,
        "forward_end_s": plan.forward_end_s,
    }


def plan_from_dict(data: Mapping[str, Any]) -> Plan:
    """The :class:`Plan` that :func:`plan_to_dict` wrote.

    Args:
        data: what :func:`plan_to_dict` returned.

    Raises:
        KeyError: for a missing field.
        ValueError: for a field out of range (a negative cost, say).
    """
    cost = data["cost"]
    plan = Plan(
        strategy=str(data["strategy"]),
        buckets=tuple(
            Bucket(
                indices=tuple(int(i) for i in bucket["indices"]),
                nbytes=int(bucket["nbytes"]),
                ready_s=float(bucket["ready_s"]),
                start_s=float(bucket["start_s"]),
                end_s=float(bucket["end_s"]),
                channels=tuple(int(c) for c in bucket["channels"]),
            )
            for bucket in data["buckets"]
        ),
        backward_s=float(data["backward_s"]),
        forward_s=float(data["forward_s"]),
        cost=CostModel(
            float(cost["a"]),
            float(cost["b"]),
            tuple((float(a_j), float(c_j)) for a_j, c_j in cost["concurrency"]),
        ),
        tensors=tuple(
            ReadyTensor(str(t["name"]), int(t["nbytes"]), float(t["ready_s"]))
            for t in data["tensors"]
        ),
        channels=int(data["channels"]),
        partition_bytes=None if data["partition_bytes"] is None else float(data["partition_bytes"]),
        gates=tuple(
            Gate(str(g["name"]), tuple(int(i) for i in g["tensors"]), float(g["forward_s"]))
            for g in data.get("gates", ())
        ),
        step_s=float(data.get("step_s", 0.0)),
        forward_end_s=float(data.get("forward_end_s", 0.0)),
    )
    if "launches" not in data:
        # Saved before plans listed their launches: the plan derives them from its buckets.
        return plan
    launches = tuple(
        Launch(int(b), int(k), int(n), int(size), int(c), float(start), float(end))
        for b, k, n, size, c, start, end in data["launches"]
    )
    return replace(plan, launches=launches)


def plan_state_of(
    names: Sequence[str], order: Sequence[int], plan: Plan, why: str = "", summary: str = ""
) -> dict[str, Any]:
    """The plain form :meth:`DataParallel.load_plan_state` takes.

    Args:
        names: the trainable parameters' names, in registration order.
        order: their registration indices in the order ``plan`` lists them (its ready order).
        plan: the buckets, as indices into ``order``.
        why: why the plan uses its channels ("" when there is nothing to say).
        summary: the trials' summary ("" when there were none).
    """
    return {
        "names": list(names),
        "order": [int(i) for i in order],
        "plan": plan_to_dict(plan),
        "why": why,
        "tuning_summary": summary,
    }
