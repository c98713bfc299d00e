"""The ServerApp: FedAvg (or another strategy) over the federation, with a per-round ledger.

Per round: sample clients, send the global model, aggregate their updates, evaluate
the new global model on the held-out test set, append one record to
``metrics.jsonl`` (flushed, so a crash keeps finished rounds) and print a table row.
"""

from __future__ import annotations

import datetime as dt
import random
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from privacy.anonymizers import public_transform
from privacy.disclosure import policy
from strategies import Observed, RoundLog, build_strategy
from strategies.central_dp import CentralDP, CentralPrivacy, PrivacyBudgetReached
from strategies.observed import short_reason
from strategies.secure import SecureRounds, secure_central
from tasks.config import validate
from tasks.models import count_parameters, model_for
from tasks.splits import Split, dataset_for, feature_shape, test_split
from tasks.training import evaluate, resolve_device

from .console import say, table_header, table_row
from .cvae_phase import run_cvae_phase
from .discovery import ClientInfo, discover_clients
from .plots import plot_label_distribution, plot_run
from .privacy_log import AnonymizationLog, PrivacyLog, headline_epsilon
from .results import RunFolder, read_metrics
from .summary import outcome, write_summary

app = ServerApp()
PLOT_EVERY_S = 10.0  # redraw plots at most this often during a run (and always at the end)


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("flwr", "torch", "ray", "opacus", "numpy")}


def _now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _weighted_mean(clients: list[dict[str, Any]], key: str) -> float | None:
    """Example-weighted mean of one client metric over the clients that reported it."""
    pairs = [(int(c["num-examples"]), float(c[key])) for c in clients if key in c]
    total = sum(w for w, _ in pairs)
    return sum(w * v for w, v in pairs) / total if total else None


def _train_summary(log: RoundLog) -> dict[str, Any]:
    """Example-weighted train loss/accuracy over the clients that trained this round.

    Computed from the per-client metrics rather than taken from the strategy, because
    central DP aggregates with equal weights and SecAgg+ reports no metrics at all.
    """
    out: dict[str, Any] = {"num-examples": sum(int(c.get("num-examples", 0)) for c in log.clients),
                           "clients": len(log.clients)}
    for key in ("loss", "accuracy"):
        if (value := _weighted_mean(log.clients, f"train-{key}")) is not None:
            out[key] = value
    return out


class StopRun(Exception):
    """Raised after a round is recorded when the run should end early (reason in the message)."""


class RunRecorder:
    """Turns what the strategy observed plus central evaluation into ledger records."""

    def __init__(self, run: RunFolder, strategy: Any, info: dict[str, Any],
                 title: str, privacy: PrivacyLog, target_accuracy: float = 0.0,
                 anonymization: AnonymizationLog | None = None) -> None:
        self.run = run
        self.anonymization = anonymization or AnonymizationLog("none")
        self.target_accuracy = target_accuracy
        self.privacy = privacy
        self.strategy = strategy
        self.info = info
        self.title = title
        self.t_first_round: float | None = None
        self.last_plot = 0.0

    def record(self, rnd: int, test: dict[str, float], eval_s: float) -> None:
        if rnd == 0:
            self.info["initial"] = test
            self.run.write_json("run.json", self.info)
            say(table_header(self.privacy.enabled))
            say(table_row(0, test, None, "-", None, 0.0 if self.privacy.enabled else None))
            return
        log = self.strategy.current
        assert log is not None and log.round == rnd
        now = time.perf_counter()
        if self.t_first_round is None:
            self.t_first_round = log.started
        record: dict[str, Any] = {
            "round": rnd,
            "test": test,
            "train": _train_summary(log),
            "sampled": log.sampled,
            "clients": log.clients,
            "failures": log.failures,
            "time": {
                "round-s": now - log.started,
                "train-s": (log.train_done or now) - log.started,
                "central-eval-s": eval_s,
                "elapsed-s": now - self.t_first_round,
            },
        }
        entry = self.privacy.update(rnd, log)
        if entry is not None:
            record["privacy"] = entry
        anon = self.anonymization.entry(log.clients)
        if anon is not None:
            record["anonymization"] = anon
            self.info["anonymization"] = {k: v for k, v in anon.items() if k != "clients"}
        if log.skipped:
            record["skipped"] = log.skipped
        if log.evaluated:
            record["client-eval"] = {
                "loss": _weighted_mean(log.evaluated, "eval-loss"),
                "accuracy": _weighted_mean(log.evaluated, "eval-accuracy"),
                "clients": log.evaluated,
            }
        self.run.append_metrics(record)
        self.info["rounds-completed"] = rnd
        ok = f"{len(log.clients)}/{len(log.sampled)}"
        say(table_row(rnd, test, record["train"], ok, record["time"]["round-s"],
                      headline_epsilon(entry)))
        if log.skipped:
            say(f"  round {rnd}: {len(log.skipped)} client(s) out of privacy budget, skipped: "
                f"{[c['partition-id'] for c in log.skipped]}")
        if log.failures:
            say(f"  round {rnd}: {len(log.failures)} client error(s), e.g. client "
                f"{log.failures[0]['partition-id']}: {short_reason(log.failures[0]['error'])}")
        if now - self.last_plot >= PLOT_EVERY_S:
            self.plot()
        if self.privacy.all_exhausted():
            raise StopRun(f"every client has spent its privacy budget (target-epsilon "
                          f"{self.privacy.target}) by round {rnd}")
        if self.target_accuracy and test["accuracy"] >= self.target_accuracy:
            self.info["target-reached-round"] = rnd
            raise StopRun(f"test accuracy {test['accuracy']:.4f} reached target-accuracy "
                          f"{self.target_accuracy} at round {rnd}")

    def plot(self) -> None:
        plot_run(self.run.path / "plots", read_metrics(self.run.path), self.info.get("initial"),
                 self.title)
        self.last_plot = time.perf_counter()


def secagg_max_weight(cfg: Mapping[str, Any], sizes: list[int], train_size: int) -> float:
    """SecAgg+'s bound on one client's weight: 1 under central DP (equal weights); else
    ``secagg-max-weight``, or the largest client when sizes are disclosed (local DP),
    or the training set's size, which bounds every client without asking any."""
    if cfg["dp"] == "central":
        return 1.0
    if cfg["secagg-max-weight"]:
        return float(cfg["secagg-max-weight"])
    return float(max(sizes)) if len(sizes) == int(cfg["num-clients"]) and sizes else float(
        train_size)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_federation(grid: Grid, context: Context, cfg: Mapping[str, Any],
                   run: RunFolder) -> dict[str, Any]:
    """Everything between a validated config and a finished results folder."""
    t0 = time.perf_counter()
    info: dict[str, Any] = {"status": "running", "started": _now(), "run-dir": str(run.path),
                            "versions": _versions()}
    run.write_json("run.json", info)
    _seed_everything(int(cfg["seed"]))

    data = dataset_for(cfg)
    test = test_split(cfg)
    transform = public_transform(str(cfg["anonymizer"]), cfg, int(test.x.shape[1])) \
        if cfg["features"] == "embeddings" else None
    if transform is not None:  # e.g. hashing: the head reads hashed embeddings
        test = Split(torch.from_numpy(transform(test.x.numpy())), test.y, test.num_classes)
    model, model_name = model_for(cfg)
    device = resolve_device(str(cfg["device"]))
    info.update({"dataset": data.summary(), "dataset-source": data.source, "model": model_name,
                 "parameters": count_parameters(model)})
    if cfg["features"] == "embeddings":
        from tasks.embeddings import backbone_info, backbone_spec

        info["backbone"] = backbone_info(backbone_spec(cfg))
        say(f"features: {info['backbone'].get('embedding-dim')}-d embeddings from a frozen "
            f"{info['backbone'].get('backbone')} trained on {info['backbone'].get('trained-on')}")
    say(f"data: {data.summary()}")

    clients: list[ClientInfo] = discover_clients(grid, float(cfg["round-timeout"]))
    n_clients = len(clients)
    if n_clients != int(cfg["num-clients"]):
        say(f"note: the federation has {n_clients} clients (num-partitions of its nodes) but "
            f"num-clients = {cfg['num-clients']}; using {n_clients}. With `flwr run`, pass "
            f"--federation-config \"num-supernodes={cfg['num-clients']}\".")
    info["num-clients"] = n_clients
    partitions = [c.as_json() for c in clients]
    run.write_json("partitions.json", {"partitioner": cfg["partitioner"],
                                       "num-classes": data.num_classes, "clients": partitions})
    title = (f"{cfg['dataset']} · {model_name} · {cfg['strategy']} · {n_clients} clients "
             f"({cfg['partitioner']})")
    if all(c.label_counts is not None for c in clients):
        plot_label_distribution(run.path / "plots" / "label_distribution.png", partitions,
                                f"label distribution — {title}")
    sizes = [c.num_examples for c in clients if c.num_examples is not None]
    size_text = (f"sizes {min(sizes)}–{max(sizes)}" if len(sizes) == n_clients
                 else "sizes not disclosed")
    say(f"model: {model_name} ({info['parameters']:,} parameters) · strategy {cfg['strategy']}"
        f" · {n_clients} clients ({cfg['partitioner']}, {size_text}) · "
        f"{cfg['num-server-rounds']} rounds")
    disclosure = policy(str(cfg["dp"]), bool(cfg["secure-aggregation"]),
                        bool(cfg["report-client-metrics"]))
    if disclosure.restricted:
        say(f"clients send in the clear only: {', '.join(sorted(disclosure.allowed or ()))} "
            f"({disclosure.reason})")

    partition_of = {c.node_id: c.partition_id for c in clients}
    if cfg["anonymizer"] == "cvae-federated":
        info["cvae-phase"] = run_cvae_phase(grid, cfg, partition_of, int(test.x.shape[1]),
                                            data.num_classes, run)
    central: CentralPrivacy | None = None
    if cfg["secure-aggregation"]:
        central = (secure_central(cfg, n_clients, info["parameters"])
                   if cfg["dp"] == "central" else None)
        rounds: Any = SecureRounds(cfg, grid, context, partition_of,
                                   secagg_max_weight(cfg, sizes, len(data.y_train)), central)
        info["aggregation"] = {
            "protocol": "SecAgg+", "individual-updates-visible": False,
            **disclosure.describe(),
            "num-shares": cfg["secagg-num-shares"],
            "reconstruction-threshold": cfg["secagg-reconstruction-threshold"],
            "clipping-range": cfg["secagg-clipping-range"],
            "quantization-range": cfg["secagg-quantization-range"]}
    else:
        strategy = build_strategy(cfg, n_clients)
        if isinstance(strategy, CentralDP):
            central = strategy.privacy
        rounds = Observed(strategy, int(cfg["seed"]), partition_of)
        info["aggregation"] = {"protocol": "plain", "individual-updates-visible": True,
                               **disclosure.describe()}
    privacy = PrivacyLog(cfg, central, n_clients)
    anonymization = AnonymizationLog(str(cfg["anonymizer"]))
    if "cvae-phase" in info:  # every client scored its release when it sampled it
        anonymization.add(info["cvae-phase"]["clients"])
    recorder = RunRecorder(run, rounds, info, title, privacy, float(cfg["target-accuracy"]),
                           anonymization)

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        start = time.perf_counter()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, test.x, test.y, int(cfg["eval-batch-size"]), device)
        recorder.record(server_round, {"loss": loss, "accuracy": acc},
                        time.perf_counter() - start)
        return MetricRecord({"loss": loss, "accuracy": acc})

    info["setup-s"] = time.perf_counter() - t0
    initial = ArrayRecord(model.state_dict())
    num_rounds = int(cfg["num-server-rounds"])
    try:
        if isinstance(rounds, SecureRounds):
            arrays = initial
            central_evaluate(0, arrays)
            for rnd in range(1, num_rounds + 1):
                arrays = rounds.run_round(rnd, arrays) or arrays
                central_evaluate(rnd, arrays)
        else:
            rounds.start(grid=grid, initial_arrays=initial, num_rounds=num_rounds,
                         timeout=float(cfg["round-timeout"]),
                         train_config=ConfigRecord({"local-epochs": int(cfg["local-epochs"])}),
                         evaluate_fn=central_evaluate)
    except (StopRun, PrivacyBudgetReached) as stop:
        info["stopped-early"] = str(stop)
        say(f"stopping early: {stop}")
    info["privacy"] = privacy.summary()
    # central_evaluate loaded every new global model, so `model` holds the final one
    if cfg["save-model"]:
        torch.save({"model": model_name, "input-shape": list(feature_shape(cfg)),
                    "num-classes": data.num_classes, "mlp-hidden": cfg["mlp-hidden"],
                    "state-dict": model.state_dict()}, run.file("model.pt"))
    recorder.plot()
    records = read_metrics(run.path)
    info.update({"status": "finished", "finished": _now(), "wall-s": time.perf_counter() - t0,
                 **outcome(records)})
    run.write_json("run.json", info)
    write_summary(run, cfg, info, records)
    return info


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config, open the results folder, run the rounds, record everything."""
    cfg = validate(context.run_config)
    if hasattr(grid, "pull_interval"):
        # The simulation's InMemoryGrid checks for client replies every 0.1 s by default;
        # polling every 10 ms takes about 0.05 s of idle waiting off each round.
        grid.pull_interval = 0.01
    run = RunFolder.open(cfg)
    run.write_config(cfg)
    say(f"results: {run.path}")
    try:
        info = run_federation(grid, context, cfg, run)
    except BaseException as exc:
        info = {**_read_info(run), "status": "failed", "finished": _now(),
                "error": f"{type(exc).__name__}: {exc}"}
        run.write_json("run.json", info)
        say(f"error: {type(exc).__name__}: {exc}")
        raise
    final = info.get("final", {})
    say(f"done: test accuracy {final.get('accuracy', float('nan')):.4f} after "
        f"{info.get('rounds-completed', 0)} rounds in {info['wall-s']:.1f} s · {run.path}")


def _read_info(run: RunFolder) -> dict[str, Any]:
    from .results import read_run_info

    return read_run_info(run.path)
