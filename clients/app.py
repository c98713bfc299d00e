"""The ClientApp: load this node's partition, train the global model on it, reply with the update.

The same app runs in Flower's simulation runtime (one Ray actor serves many clients
in turn) and on a real SuperNode started with
``--node-config "partition-id=I num-partitions=N"``.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable

from tasks.config import validate
from tasks.models import build_model
from tasks.splits import Split, client_split, dataset_for
from tasks.training import evaluate, make_loader, resolve_device, sgd, train_epochs

from .local_dp import dp_round


def central_dp_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Clip this client's update before it leaves (dp = central, client-side clipping).

    Flower's fixedclipping_mod / adaptiveclipping_mod do the clipping; they are applied only
    to training messages of runs that asked for client-side clipping.
    """
    cfg = context.run_config
    if msg.metadata.message_type == MessageType.TRAIN and cfg.get("dp") == "central":
        if cfg.get("central-clipping") == "client-fixed":
            return fixedclipping_mod(msg, context, call_next)
        if cfg.get("central-clipping") == "client-adaptive":
            return adaptiveclipping_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[central_dp_mod])


def derive_seed(*parts: int) -> int:
    """A 31-bit seed that depends on every part (run seed, round, partition...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)


def _setup(context: Context) -> tuple[dict, int, int, Split]:
    cfg = validate(context.run_config)
    torch.set_num_threads(int(cfg["client-threads"]))
    pid = int(context.node_config["partition-id"])
    n = int(context.node_config["num-partitions"])
    return cfg, pid, n, client_split(cfg, pid, n)


def _model(cfg: dict, arrays: ArrayRecord) -> torch.nn.Module:
    data = dataset_for(cfg)
    model = build_model(str(cfg["model"]), data.input_shape, data.num_classes,
                        str(cfg["mlp-hidden"]))
    model.load_state_dict(arrays.to_torch_state_dict())
    return model


@app.query()
def describe(msg: Message, context: Context) -> Message:
    """Report which partition this node holds, its size and label histogram."""
    cfg, pid, n, data = _setup(context)
    metrics = MetricRecord({"partition-id": pid, "num-partitions": n,
                            "num-examples": len(data), "label-counts": data.label_counts()})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received global model for ``local-epochs`` on the local partition.

    With ``dp = "local"`` the training is DP-SGD and the reply carries the client's
    cumulative epsilon; a client whose budget would be exceeded replies without an
    update (``dp-skipped``).
    """
    cfg, pid, n_parts, data = _setup(context)
    round_config = msg.content["config"]
    server_round = int(round_config["server-round"])
    device = resolve_device(str(cfg["device"]))
    seed = derive_seed(int(cfg["seed"]), server_round, pid)
    torch.manual_seed(seed)

    model = _model(cfg, msg.content["arrays"])
    metrics: dict = {"num-examples": len(data), "partition-id": pid}
    if cfg["dp"] == "central":
        metrics["dp-weight"] = 1  # DP-FedAvg averages clipped updates with equal weights
    start = time.perf_counter()
    if cfg["dp"] == "local":
        outcome = dp_round(cfg, context, model, data.x, data.y, n_parts, seed, device)
        metrics.update(outcome.metrics())
        if outcome.result is None:  # budget exhausted: no update, no privacy spent
            return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
        result, model = outcome.result, outcome.model
    else:
        loader = make_loader(data.x, data.y, int(cfg["batch-size"]), seed)
        optimizer = sgd(model, float(cfg["lr"]), float(cfg["momentum"]),
                        float(cfg["weight-decay"]))
        result = train_epochs(model, loader, optimizer, int(cfg["local-epochs"]), device,
                              proximal_mu=float(round_config.get("proximal-mu", 0.0)))
    metrics.update({
        "train-loss": result.loss,
        "train-accuracy": result.accuracy,
        "train-steps": result.steps,
        "train-time-s": time.perf_counter() - start,
    })
    arrays = ArrayRecord(model.cpu().state_dict())
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}),
                   reply_to=msg)


@app.evaluate()
def evaluate_local(msg: Message, context: Context) -> Message:
    """Evaluate the global model on this client's own data (a personalization view)."""
    cfg, pid, _, data = _setup(context)
    model = _model(cfg, msg.content["arrays"])
    loss, acc = evaluate(model, data.x, data.y, int(cfg["eval-batch-size"]),
                         resolve_device(str(cfg["device"])))
    metrics = MetricRecord({"num-examples": len(data), "partition-id": pid,
                            "eval-loss": loss, "eval-accuracy": acc})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
