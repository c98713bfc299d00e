"""Everything between a validated config and a finished results folder, in steps.

:func:`run_federation` assembles the server's task (test data, model, evaluator), finds
the clients, picks the round runner (plain or SecAgg+), and hands them to the round
loop (:mod:`server.loop`) with the recorder, the plot hook and the stop conditions.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid

from privacy.anonymize import public_transform
from privacy.dp.disclosure import Disclosure, policy
from strategies.build import build_runner as runner_for
from strategies.grid import FederationGrid
from strategies.protocols.he import encoding_slack
from strategies.protocols.secagg import max_weight
from strategies.runner import RoundRunner
from tasks.config import RunConfig
from tasks.datasets import DatasetBundle
from tasks.embeddings import backbone_info, backbone_spec
from tasks.models import count_parameters
from tasks.splits import (
    Split,
    dataset_for,
    feature_shape,
    heldout_split,
    model_for,
    validation_split,
)
from tasks.training import resolve_device

from .checkpoint import CLIENTS as CLIENT_STATES
from .checkpoint import FOLDER as CHECKPOINT
from .checkpoint import (
    Checkpoint,
    CheckpointHook,
    ResumeError,
    needs_client_state,
    resume_config,
    rewind_ledger,
)
from .client_state import check_client_state
from .console import say
from .cvae_phase import run_cvae_phase
from .discovery import ClientInfo, assign_partitions, discover_clients, simulated
from .evaluation import CentralEvaluator, ModelSelection
from .ledger import outcome, read_ledger
from .loop import RoundHook, run_rounds, target_accuracy_reached
from .observe import ObservationHook
from .plots import PlotHook, plot_label_distribution
from .privacy_log import AnonymizationLog, PrivacyLog
from .recorder import RoundRecorder
from .results import RunFolder, now, read_run_info
from .summary import write_summary

VERSIONS = ("flwr", "torch", "ray", "opacus", "numpy")


@dataclass
class ServerTask:
    """What the server holds of the task: the data's description, its test split, the model."""

    data: DatasetBundle
    test: Split
    model: torch.nn.Module
    model_name: str
    validation: Split | None = None  # for model selection (validation-fraction)

    @classmethod
    def load(cls, cfg: RunConfig) -> ServerTask:
        test = heldout_split(cfg)
        a = cfg.anonymization
        transform = public_transform(a.anonymizer, a.params(), int(test.x.shape[1])) \
            if cfg.embeddings.enabled else None
        if transform is not None:  # e.g. hashing: the head reads hashed embeddings
            test = Split(torch.from_numpy(transform(test.x.numpy())), test.y, test.num_classes)
        model, name = model_for(cfg)
        test, validation = validation_split(cfg, test)
        return cls(dataset_for(cfg), test, model, name, validation)

    def observer(self, cfg: RunConfig, run: RunFolder, num_clients: int) -> ObservationHook:
        images = not cfg.embeddings.enabled and self.data.kind == "image"
        return ObservationHook(cfg, run.path, num_clients, feature_shape(cfg),
                               self.data.num_classes, self.data.mean if images else (0.0,),
                               self.data.std if images else (1.0,),
                               "image" if images else "vector")

    def evaluator(self, cfg: RunConfig) -> CentralEvaluator:
        return CentralEvaluator(self.model, self.test, cfg.training.eval_batch_size,
                                resolve_device(cfg.resources.device), self.validation)


def build_runner(cfg: RunConfig, grid: Grid, context: Context, clients: list[ClientInfo],
                 task: ServerTask, disclosure: Disclosure, info: dict[str, Any]) -> RoundRunner:
    """The run's round runner (:func:`strategies.build.build_runner`); run.json records how
    it aggregates."""
    sizes = [c.num_examples for c in clients if c.num_examples is not None]
    params = count_parameters(task.model)
    runner = runner_for(cfg, grid, {c.node_id: c.partition_id for c in clients},
                        num_parameters=params, context=context,
                        max_weight=max_weight(cfg, sizes, len(clients), len(task.data.y_train)))
    info["aggregation"] = {**runner.describe(), **disclosure.describe()}
    if cfg.secagg.he:
        info["aggregation"]["encoding-slack"] = encoding_slack(params)
    return runner


def discover(grid: Grid, cfg: RunConfig, task: ServerTask, run: RunFolder, title: str
             ) -> list[ClientInfo]:
    """The run's clients (assigned in simulation, asked on SuperNodes); write
    partitions.json and, when the clients disclosed them, the label plot."""
    fed = cfg.federation
    if simulated(grid):
        clients = assign_partitions(grid, fed.num_clients, fed.round_timeout)
    else:
        clients = discover_clients(grid, fed.round_timeout)
        if len(clients) != fed.num_clients:
            say(f"note: the federation has {len(clients)} clients (num-partitions of its "
                f"nodes) but num-clients = {fed.num_clients}; using {len(clients)}.")
    partitions = [c.as_json() for c in clients]
    run.write_json("partitions.json", {"partitioner": cfg.data.partitioner,
                                       "num-classes": task.data.num_classes,
                                       "clients": partitions})
    if all(c.label_counts is not None for c in clients):
        plot_label_distribution(run.path / "plots" / "label_distribution.png", partitions,
                                f"label distribution — {title}")
    return clients


def _describe(cfg: RunConfig, task: ServerTask, info: dict[str, Any]) -> None:
    info.update({"dataset": task.data.summary(), "dataset-source": task.data.source,
                 "model": task.model_name, "parameters": count_parameters(task.model)})
    if cfg.embeddings.enabled:
        info["backbone"] = backbone_info(backbone_spec(cfg.embeddings, cfg.data))
        b = info["backbone"]
        say(f"features: {b.get('embedding-dim')}-d embeddings from a frozen "
            f"{b.get('backbone')} trained on {b.get('trained-on')}")
    say(f"data: {task.data.summary()}")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_federation(grid: Grid, context: Context, cfg: RunConfig, run: RunFolder,
                   cell: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the rounds; write the ledger, plots, model, run.json and summary.

    ``cell``: in a sweep run inside one simulation, the cell's index and the keys in
    which its config differs from the simulation's (sent to the clients with every
    message, :class:`strategies.grid.FederationGrid`).
    """
    t0 = time.perf_counter()
    checkpoint = Checkpoint.load(run.path) if cfg.results.resume else None
    info: dict[str, Any] = {"status": "running", "started": now(), "run-dir": str(run.path),
                            "run-id": cfg.results.run_id,
                            "versions": {name: version(name) for name in VERSIONS}}
    if checkpoint is not None:  # what run.json said then, and how often it was resumed
        info = {**checkpoint.info, "status": "running", "run-dir": str(run.path),
                "resumed": read_run_info(run.path).get("resumed", [])}
        rewind_ledger(run.path, checkpoint.round)
        say(f"resuming after round {checkpoint.round} of "
            f"{cfg.federation.num_server_rounds} from {run.path / 'checkpoint'}")
    run.write_info(info)
    _seed_everything(cfg.training.seed)
    task = ServerTask.load(cfg)
    _describe(cfg, task, info)
    title = (f"{cfg.data.dataset} · {task.model_name} · {cfg.federation.strategy} · "
             f"{cfg.federation.num_clients} clients ({cfg.data.partitioner})")
    clients = discover(grid, cfg, task, run, title)
    state_dir = (str(run.path / CHECKPOINT / CLIENT_STATES)
                 if cfg.results.checkpoint and simulated(grid) else "")
    stateless = [] if state_dir else [c.partition_id for c in clients if not c.keeps_state]
    if checkpoint is not None and needs_client_state(cfg) and stateless:
        raise ResumeError(
            f"the SuperNodes of client(s) {', '.join(map(str, stateless))} keep no state "
            "(they were started without a state-dir), so resuming would reset their epsilon "
            "or CVAE; start every SuperNode with --state-dir to resume this run")
    info["client-state"] = state_dir or (None if stateless else "on each SuperNode (state-dir)")
    grid = FederationGrid(grid, {c.node_id: c.partition_id for c in clients},
                          assign=simulated(grid), cell=cell, state_dir=state_dir,
                          poll_interval=cfg.federation.reply_poll_interval,
                          min_nodes=min(cfg.federation.min_train_clients, len(clients)),
                          wait_limit=cfg.federation.round_timeout)
    if checkpoint is not None and needs_client_state(cfg):
        check_client_state(grid, grid.partition_of, cfg,
                           {int(p): int(n) for p, n in
                            checkpoint.privacy.get("steps", {}).items()},
                           state_dir or "on each SuperNode, under its state-dir")
    info["num-clients"] = len(clients)
    sizes = [c.num_examples for c in clients if c.num_examples is not None]
    say(f"model: {task.model_name} ({info['parameters']:,} parameters) · strategy "
        f"{cfg.federation.strategy} · {len(clients)} clients ({cfg.data.partitioner}, "
        + (f"sizes {min(sizes)}–{max(sizes)}" if len(sizes) == len(clients)
           else "partitions assigned by the server" if grid.assign
           else "sizes not disclosed") + f") · {cfg.federation.num_server_rounds} rounds")
    disclosure = policy(cfg.privacy.dp, cfg.secagg.enabled, cfg.privacy.report_client_metrics)
    if disclosure.restricted:
        say(f"clients send in the clear only: {', '.join(sorted(disclosure.allowed or ()))} "
            f"({disclosure.reason})")
    anonymization = AnonymizationLog(cfg.anonymization.anonymizer)
    if cfg.anonymization.anonymizer == "cvae-federated" and checkpoint is None:
        info["cvae-phase"] = run_cvae_phase(grid, cfg, {c.node_id: c.partition_id
                                                        for c in clients},
                                            int(task.test.x.shape[1]), task.data.num_classes,
                                            run)
        anonymization.add(info["cvae-phase"]["clients"])  # each scored the release it sampled
    runner = build_runner(cfg, grid, context, clients, task, disclosure, info)
    central = runner.central
    privacy = PrivacyLog(cfg, central, len(clients))
    initial = ArrayRecord(task.model.state_dict())
    if checkpoint is not None:
        runner.restore(checkpoint.runner)
        privacy.restore(checkpoint.privacy)
        anonymization.restore(checkpoint.anonymization)
        initial = checkpoint.model
    recorder = RoundRecorder(run, info, privacy, anonymization)
    info["setup-s"] = time.perf_counter() - t0
    evaluator = task.evaluator(cfg)
    hooks: list[RoundHook] = [PlotHook(run.path, info, title)]
    if cfg.leakage.enabled:
        hooks.append(task.observer(cfg, run, len(clients)))
    selection = ModelSelection(run.path, read_ledger(run.path)) \
        if task.validation is not None else None
    if selection is not None:
        hooks.append(selection)
    if cfg.results.checkpoint:
        hooks.append(CheckpointHook(run.path, runner, privacy, anonymization, info,
                                    resume_config(cfg)))
    result = run_rounds(
        runner, initial, cfg.federation.num_server_rounds, evaluator, recorder, hooks=hooks,
        stop_before=[central.stop_reason] if central is not None else [],
        stop_after=[lambda r: privacy.stop_reason(r.round),
                    target_accuracy_reached(cfg.federation.target_accuracy)],
        start=checkpoint.round + 1 if checkpoint is not None else 1)
    if result.stopped_early:
        info["stopped-early"] = result.stopped_early
        say(f"stopping early: {result.stopped_early}")
    _report_model(cfg, info, evaluator, selection, result.arrays)
    return _finish(cfg, run, info, task, evaluator, privacy, t0)


def _report_model(cfg: RunConfig, info: dict[str, Any], evaluator: CentralEvaluator,
                  selection: ModelSelection | None, final: ArrayRecord) -> None:
    """Which model the run reports (the lowest validation loss, or the final one) and, with
    test-noise, how it scores on noisy test inputs; the evaluator is left on the final model
    (the one saved)."""
    reported = final
    if selection is not None and selection.record is not None:
        reported = selection.arrays or final
        info["model-selection"] = {
            "round": selection.record.round, "rule": "lowest validation loss",
            "validation-fraction": cfg.training.validation_fraction,
            "test": {k: v for k, v in selection.record.test.items()
                     if not k.startswith("validation-")}}
    if cfg.training.noise_sigmas:
        info["robustness"] = evaluator.robustness(reported, cfg.training.noise_sigmas,
                                                  cfg.training.seed)
        say("robustness (test inputs + Gaussian noise): " + ", ".join(
            f"sigma {r['sigma']:g}: acc {r['accuracy']:.3f}"
            + (f", AUROC {r['auroc']:.3f}" if r.get("auroc") is not None else "")
            for r in info["robustness"]))
    evaluator.model.load_state_dict(final.to_torch_state_dict())


def _finish(cfg: RunConfig, run: RunFolder, info: dict[str, Any], task: ServerTask,
            evaluator: CentralEvaluator, privacy: PrivacyLog, t0: float) -> dict[str, Any]:
    info["privacy"] = privacy.summary()
    if cfg.results.save_model:  # the evaluator loaded every new model: it holds the final one
        torch.save({"model": task.model_name, "input-shape": list(feature_shape(cfg)),
                    "num-classes": task.data.num_classes, "mlp-hidden": cfg.training.mlp_hidden,
                    "state-dict": evaluator.model.state_dict()}, run.file("model.pt"))
    records = read_ledger(run.path)
    target = cfg.federation.target_accuracy
    if target:
        info["target-reached-round"] = next((r.round for r in records if r.accuracy >= target),
                                            None)
    info.update({"status": "finished", "finished": now(), "wall-s": time.perf_counter() - t0,
                 **outcome(records)})
    run.write_info(info)
    write_summary(run, cfg, info, records)
    return info
