"""The ClientApp: load this node's partition, train the global model on it, reply with the update.

The same app runs in Flower's simulation runtime (one Ray actor serves many clients
in turn) and on a real SuperNode started with
``--node-config "partition-id=I num-partitions=N"``.

Training messages come in two layouts: Flower's Message API (``arrays`` + ``config``),
used by every strategy, and the legacy ``fitins.*`` layout that Flower's SecAgg+
workflow sends. Both go through :func:`local_update`; only the unpacking differs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from privacy.anonymizers import public_transform
from privacy.disclosure import policy
from privacy.dpfedavg import CLIP_KEY, UNCLIPPED_KEY, clip
from tasks.config import validate
from tasks.models import model_for
from tasks.splits import Split, client_split
from tasks.training import evaluate, make_loader, resolve_device, sgd, train_epochs

from .anonymized import (
    federated_cvae_release,
    federated_cvae_round,
    holdout_split,
    released_data,
)
from .local_dp import dp_round

LEGACY_METRICS = "fitres.metrics"  # Flower's legacy FitRes layout (SecAgg+ rounds)
LEGACY_NUM_EXAMPLES = "fitres.num_examples"


def disclosure_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Send only what the run's disclosure policy allows (:mod:`privacy.disclosure`).

    The outermost mod, so it sees every reply as it leaves the client: each MetricRecord
    is filtered, and so are the metrics of the legacy FitRes layout SecAgg+ uses, whose
    clear ``num_examples`` is zeroed when the record count is not to be disclosed (the
    SecAgg+ weight itself travels masked, inside the secure sum).
    """
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    cfg = validate(context.run_config)
    rule = policy(str(cfg["dp"]), bool(cfg["secure-aggregation"]),
                  bool(cfg["report-client-metrics"]))
    if not rule.restricted:
        return reply
    content = reply.content
    for name, record in list(content.metric_records.items()):
        if name == LEGACY_NUM_EXAMPLES:
            if not rule.permits("num-examples"):
                content.metric_records[name] = MetricRecord({"num_examples": 0})
            continue
        content.metric_records[name] = MetricRecord(rule.filter(record))
    if LEGACY_METRICS in content.config_records:
        content.config_records[LEGACY_METRICS] = ConfigRecord(
            rule.filter(content.config_records[LEGACY_METRICS]))
    return reply


def secagg_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Route the messages of a SecAgg+ round (they carry its configs) through Flower's mod."""
    if (msg.metadata.message_type == MessageType.TRAIN
            and RECORD_KEY_CONFIGS in msg.content.config_records):
        from flwr.client.mod import secaggplus_mod

        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[disclosure_mod, secagg_mod])


def derive_seed(*parts: int) -> int:
    """A 31-bit seed that depends on every part (run seed, round, partition...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)


def _setup(context: Context) -> tuple[dict, int, int, Split]:
    cfg = validate(context.run_config)
    torch.set_num_threads(int(cfg["client-threads"]))
    pid = int(context.node_config["partition-id"])
    n = int(context.node_config["num-partitions"])
    return cfg, pid, n, client_split(cfg, pid, n)


def _model(cfg: dict, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    model, _ = model_for(cfg)
    model.load_state_dict(state)
    return model


@app.query()
def describe(msg: Message, context: Context) -> Message:
    """Report which partition this node holds, its size and label histogram.

    At the end of the federated CVAE phase the same message type carries the final
    decoder: the client then samples its release and reports the release's scores.
    """
    cfg, pid, n, data = _setup(context)
    config = msg.content.config_records.get("config", {})
    if config.get("phase") == "cvae-final":
        released = federated_cvae_release(cfg, context, data,
                                          derive_seed(int(cfg["seed"]), pid),
                                          msg.content["arrays"])
        return Message(RecordDict({"metrics": MetricRecord(
            {"partition-id": pid, **released.metrics()})}), reply_to=msg)
    metrics = MetricRecord({"partition-id": pid, "num-partitions": n,
                            "num-examples": len(data), "label-counts": data.label_counts()})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def _training_data(cfg: Mapping[str, Any], context: Context, data: Split, pid: int
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """What this client trains on: its partition, or (with an anonymizer) its release —
    or, with local DP and ``dp-train-data = original``, its original member records."""
    if cfg["anonymizer"] == "none":
        return data.x, data.y, {}
    seed = derive_seed(int(cfg["seed"]), pid)
    if cfg["anonymizer"] == "cvae-federated":  # sampled from the shared decoder (phase 1)
        released = federated_cvae_release(cfg, context, data, seed)
    else:
        released = released_data(cfg, data, seed)
    if cfg["dp"] == "local" and cfg["dp-train-data"] == "original":
        members, _ = holdout_split(len(data.y), float(cfg["privacy-holdout"]), seed)
        x = data.x[members]
        transform = public_transform(str(cfg["anonymizer"]), cfg, int(x.shape[1]))
        if transform is not None:  # the head reads e.g. hashed embeddings
            x = torch.from_numpy(transform(x.numpy()))
        return x, data.y[members], released.metrics()
    return released.x, released.y, released.metrics()


def local_update(context: Context, state: Mapping[str, torch.Tensor],
                 round_config: Mapping[str, Any]
                 ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """Train the global model received (``state``) on this client's data.

    Returns the new state dict (None when the client declines: its DP budget is spent)
    and the metrics to report (the disclosure mod decides which of them leave the
    client). With ``dp = "local"`` training is DP-SGD and the metrics carry the client's
    cumulative epsilon; with central DP and client-side clipping the update is clipped
    to the norm the server sent.
    """
    cfg, pid, n_parts, data = _setup(context)
    server_round = int(round_config["server-round"])
    device = resolve_device(str(cfg["device"]))
    seed = derive_seed(int(cfg["seed"]), server_round, pid)
    torch.manual_seed(seed)

    model = _model(cfg, state)
    x, y, release_scores = _training_data(cfg, context, data, pid)
    metrics: dict[str, Any] = {"partition-id": pid, **release_scores, "num-examples": len(y)}
    start = time.perf_counter()
    if cfg["dp"] == "local":
        outcome = dp_round(cfg, context, model, x, y, n_parts, seed, device)
        metrics.update(outcome.metrics())
        if outcome.result is None:  # budget exhausted: no update, no privacy spent
            return None, metrics
        result, model = outcome.result, outcome.model
    else:
        loader = make_loader(x, y, int(cfg["batch-size"]), seed)
        optimizer = sgd(model, float(cfg["lr"]), float(cfg["momentum"]),
                        float(cfg["weight-decay"]))
        result = train_epochs(model, loader, optimizer, int(cfg["local-epochs"]), device,
                              proximal_mu=float(round_config.get("proximal-mu", 0.0)))
    metrics.update({"train-loss": result.loss, "train-accuracy": result.accuracy,
                    "train-steps": result.steps,
                    "train-time-s": time.perf_counter() - start})
    new_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if cfg["dp"] == "central" and CLIP_KEY in round_config:  # client-side clipping
        norm = float(round_config[CLIP_KEY])
        names = list(new_state)
        old = [state[k].cpu().numpy() for k in names]
        update, before = clip([new_state[k].numpy() - o for k, o in zip(names, old,
                                                                       strict=True)], norm)
        metrics.update({"update-norm": before, UNCLIPPED_KEY: int(before <= norm)})
        new_state = {k: torch.from_numpy((o + u).astype(o.dtype))
                     for k, o, u in zip(names, old, update, strict=True)}
    return new_state, metrics


def _is_legacy(msg: Message) -> bool:
    return "fitins.parameters" in msg.content.array_records


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Unpack a training message, run :func:`local_update`, pack the reply the same way."""
    if _is_legacy(msg):
        return _train_legacy(msg, context)
    if msg.content["config"].get("phase") == "cvae":  # federated CVAE, phase 1
        cfg, pid, _, data = _setup(context)
        decoder, metrics = federated_cvae_round(cfg, context, data,
                                                derive_seed(int(cfg["seed"]), pid),
                                                msg.content["arrays"])
        return Message(RecordDict({"arrays": decoder, "metrics": MetricRecord(
            {"partition-id": pid, **metrics})}), reply_to=msg)
    state = msg.content["arrays"].to_torch_state_dict()
    new_state, metrics = local_update(context, state, msg.content["config"])
    content = RecordDict({"metrics": MetricRecord(metrics)})
    if new_state is not None:
        content["arrays"] = ArrayRecord(new_state)
    return Message(content, reply_to=msg)


def _train_legacy(msg: Message, context: Context) -> Message:
    """The legacy FitIns/FitRes layout of Flower's SecAgg+ workflow."""
    import flwr.compat.common.recorddict_compat as compat
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    cfg = validate(context.run_config)
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    names = list(_blank_state(cfg))
    arrays = parameters_to_ndarrays(fitins.parameters)
    state = {k: torch.from_numpy(np.array(a)) for k, a in zip(names, arrays, strict=True)}
    new_state, metrics = local_update(context, state, fitins.config)
    # The update (not the new weights) goes into the secure sum: its values are small, so
    # SecAgg+'s [-r, r] range quantizes them finely, and clipping to [-r, r] never moves a
    # zero, which keeps central DP's sensitivity bound (strategies.secure).
    if new_state is None:  # out of budget: weight 0 adds nothing to the secure sum
        weight, reply = 0, [np.zeros_like(a) for a in arrays]
    else:
        weight = 1 if cfg["dp"] == "central" else int(metrics["num-examples"])
        reply = [new_state[k].numpy() - a for k, a in zip(names, arrays, strict=True)]
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(reply), weight,
                    {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))})
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


def _blank_state(cfg: dict) -> dict[str, torch.Tensor]:
    return model_for(cfg)[0].state_dict()


@app.evaluate()
def evaluate_local(msg: Message, context: Context) -> Message:
    """Evaluate the global model on this client's own data (a personalization view)."""
    cfg, pid, _, data = _setup(context)
    model = _model(cfg, msg.content["arrays"].to_torch_state_dict())
    x = data.x
    transform = (public_transform(str(cfg["anonymizer"]), cfg, int(x.shape[1]))
                 if cfg["features"] == "embeddings" else None)
    if transform is not None:  # the model reads e.g. hashed embeddings
        x = torch.from_numpy(transform(x.numpy()))
    loss, acc = evaluate(model, x, data.y, int(cfg["eval-batch-size"]),
                         resolve_device(str(cfg["device"])))
    metrics = MetricRecord({"num-examples": len(data), "partition-id": pid,
                            "eval-loss": loss, "eval-accuracy": acc})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
