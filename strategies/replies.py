"""A round's replies, as the server checks and sorts them before anything is aggregated."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message

from privacy.dp.disclosure import declined
from tasks.records import ndarray

from .grid import FederationGrid


def metrics_of(msg: Message) -> dict[str, Any]:
    """Every metric a reply carries, merged."""
    out: dict[str, Any] = {}
    for record in msg.content.metric_records.values():
        out.update(record)
    return out


def update_problem(received: ArrayRecord | None, sent: ArrayRecord) -> str | None:
    """Why a client's returned weights cannot be aggregated with the others, or None."""
    if received is None:
        return "no weights in the reply"
    if list(received.keys()) != list(sent.keys()):
        missing = [k for k in sent.keys() if k not in received]
        extra = [k for k in received.keys() if k not in sent]
        return f"weights named differently (missing {missing[:3]}, extra {extra[:3]})"
    for key in sent.keys():
        got, want = received[key], sent[key]
        # the kind of number must match; its width may not (FedAdam's float64 model,
        # the clients' float32 weights)
        if tuple(got.shape) != tuple(want.shape) or \
                np.dtype(got.dtype).kind != np.dtype(want.dtype).kind:
            return (f"{key}: shape {tuple(got.shape)} {got.dtype}, expected "
                    f"{tuple(want.shape)} {want.dtype}")
        values = ndarray(got)
        if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
            return f"{key} holds NaN or Inf"
    return None


def split_replies(grid: FederationGrid, partition_of: Mapping[int, int],
                  replies: Iterable[Message], sent: ArrayRecord | None = None,
                  check: Callable[[Message], str | None] | None = None,
                  asked: Iterable[int] = (), timeout: float | None = None
                  ) -> tuple[list[Message], list[dict], list[dict]]:
    """(updates to aggregate, clients that declined to train, failures), each in
    partition order. A reply is refused as a failure before anything is aggregated when
    its weights do not match ``sent`` (the global model of a training round: missing or
    extra keys, other shapes, another kind of number, NaN or Inf), or when ``check``
    finds a problem with it; a node in ``asked`` that did not answer within ``timeout``
    is a failure too, so a round nobody answered is never taken for a quiet one."""
    ok, skipped, failures = [], [], []
    replies = list(replies)
    answered = {grid.node_of(m) for m in replies}
    for node in asked:
        if node not in answered:
            failures.append({"partition-id": partition_of.get(node, -1), "node-id": node,
                             "error": f"NoReply: no answer within {timeout:g} s "
                                      "(round-timeout)" if timeout is not None
                             else "NoReply: no answer"})
    for msg in replies:
        node = grid.node_of(msg)
        pid = partition_of.get(node, -1)
        bad = None
        if not msg.has_error() and not declined(metrics_of(msg)):
            if sent is not None:
                bad = update_problem(msg.content.array_records.get("arrays"), sent)
            if bad is None and check is not None:
                bad = check(msg)
        if msg.has_error() or bad:
            failures.append({"partition-id": pid, "node-id": node,
                             "error": msg.error.reason if msg.has_error()
                             else f"UpdateRejected: {bad}"})
        elif declined(metrics_of(msg)):
            skipped.append({"partition-id": pid, **metrics_of(msg)})
        else:
            ok.append(msg)
    ok.sort(key=lambda m: (partition_of.get(m.metadata.src_node_id, -1), m.metadata.src_node_id))
    skipped.sort(key=lambda c: c["partition-id"])
    failures.sort(key=lambda f: f["partition-id"])
    return ok, skipped, failures
