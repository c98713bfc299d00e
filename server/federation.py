"""Everything between a validated config and a finished results folder: build, loop, finish.

:func:`run_federation` reads as Flower's own ``main``: assemble the run (:func:`assemble`:
the server's task, the clients, the round runner, the recorder and the hooks), run the
round loop (:mod:`server.loop`) with its stop conditions, and record the outcome.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid

from privacy.dp.disclosure import Disclosure, policy
from strategies.build import build_runner as runner_for
from strategies.grid import FederationGrid
from strategies.protocols.secagg import max_weight
from strategies.runner import RoundRunner
from tasks.config import RunConfig
from tasks.results.folder import RunFolder, now, read_run_info
from tasks.results.info import RunInfo
from tasks.results.ledger import outcome, read_ledger
from tasks.results.plots import PlotHook
from tasks.seeding import GLOBAL_RNG
from tasks.splits import feature_shape, model_for
from tasks.version import installed_version, package_version, source_commit

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
from .console import say, shown_by_cli
from .cvae_phase import run_cvae_phase
from .discovery import ClientInfo, runtime_of, simulated
from .evaluation import CentralEvaluator, ModelSelection
from .loop import (
    DivergenceWatch,
    LoopOutcome,
    RoundHook,
    StopAfter,
    StopBefore,
    run_rounds,
    target_accuracy_reached,
)
from .privacy_log import AnonymizationLog, PrivacyLog
from .recorder import RoundRecorder
from .summary import CANARY_AUDIT, canary_audit_text, write_summary
from .tamper import Tamper
from .task import ServerTask, discover
from .tracking import BACKENDS as TRACKERS
from .tracking import Tracking, require

VERSIONS = ("flwr", "torch", "ray", "opacus", "numpy")


@dataclass
class Federation:
    """Everything a run's rounds need, assembled from its config."""

    task: ServerTask
    runner: RoundRunner
    privacy: PrivacyLog
    evaluator: CentralEvaluator
    recorder: RoundRecorder
    hooks: list[RoundHook]
    selection: ModelSelection | None
    initial: ArrayRecord  # the model round ``start`` starts from
    start: int  # the first round to run (> 1 on a resume)
    stop_before: list[StopBefore]
    stop_after: list[StopAfter]
    tamper: Tamper | None = None  # server = "malicious": trap weights in observed rounds


def run_federation(grid: Grid, context: Context, cfg: RunConfig, run: RunFolder,
                   cell: Mapping[str, Any] | None = None) -> RunInfo:
    """Run the rounds; write the ledger, plots, model, run.json and summary.

    ``cell``: in a sweep run inside one simulation, the cell's index and the keys in
    which its config differs from the simulation's (sent to the clients with every
    message, :class:`strategies.grid.FederationGrid`).
    """
    t0 = time.perf_counter()
    require(cfg)  # tracking's library, before any work (the CLI has asked already)
    checkpoint = Checkpoint.load(run.path) if cfg.results.resume else None
    info = start_info(cfg, run, checkpoint, runtime_of(grid))
    with GLOBAL_RNG:  # seeded, then the model initialised: one cell at a time
        fed = assemble(grid, context, cfg, run, info, checkpoint, cell)
    info.setup_s = time.perf_counter() - t0
    result = run_rounds(fed.runner, fed.initial, cfg.federation.num_server_rounds,
                        fed.evaluator, fed.recorder, hooks=fed.hooks,
                        stop_before=fed.stop_before, stop_after=fed.stop_after,
                        start=fed.start, tamper=fed.tamper)
    return finish(cfg, run, info, fed, result, t0)


def start_info(cfg: RunConfig, run: RunFolder, checkpoint: Checkpoint | None,
               runtime: str) -> RunInfo:
    """run.json as the run starts: new, or (a resume) what it said at the checkpoint, with
    every earlier resume; a resume also rewinds the ledger to the checkpoint. ``runtime``
    is the one carrying this (part of the) run."""
    if checkpoint is None:
        info = RunInfo(started=now(), run_dir=str(run.path), run_id=cfg.results.run_id,
                       versions={"fedpriv": package_version(),
                                 "fedpriv-commit": source_commit() or "not a git checkout",
                                 **{name: installed_version(name) for name in VERSIONS}})
    else:
        info = RunInfo.from_json(checkpoint.info)
        info.status, info.run_dir = "running", str(run.path)
        info.resumed = read_run_info(run.path).get("resumed", [])
        rewind_ledger(run.path, checkpoint.round)
        say(f"resuming after round {checkpoint.round} of "
            f"{cfg.federation.num_server_rounds} from {run.path / 'checkpoint'}")
    info.runtime = runtime
    run.write_info(info)
    return info


def assemble(grid: Grid, context: Context, cfg: RunConfig, run: RunFolder, info: RunInfo,
             checkpoint: Checkpoint | None, cell: Mapping[str, Any] | None) -> Federation:
    """The server's task, the clients, the round runner (restored on a resume), the
    recorder, the hooks and the stop conditions."""
    _seed_everything(cfg.training.seed)
    task = ServerTask.load(cfg)
    task.describe(cfg, info, show_data=not shown_by_cli(cfg.results.run_id, cell))
    clients = discover(grid, cfg, task, run, task.title(cfg))
    grid = federation_grid(grid, cfg, run, clients, info, checkpoint, cell)
    _say_federation(cfg, task, clients, grid, info)
    anonymization = AnonymizationLog(cfg.anonymization.anonymizer)
    if cfg.anonymization.anonymizer == "cvae-federated" and checkpoint is None:
        info.cvae_phase = run_cvae_phase(grid, cfg, grid.partition_of,
                                         int(task.test.x.shape[1]), task.data.num_classes, run)
        anonymization.add(info.cvae_phase["clients"])  # each scored the release it sampled
    runner = build_runner(cfg, grid, context, clients, task, disclosure_of(cfg), info)
    privacy = PrivacyLog(cfg, runner.central, len(clients),
                         sum(int(v.numel()) for v in task.model.state_dict().values()))
    initial = ArrayRecord(task.model.state_dict())
    if checkpoint is not None:
        runner.restore(checkpoint.runner)
        privacy.restore(checkpoint.privacy)
        anonymization.restore(checkpoint.anonymization)
        initial = checkpoint.model
    selection = ModelSelection(run.path, read_ledger(run.path)) \
        if task.validation is not None else None
    def on_diverged(rnd: int, cause: str) -> None:
        info.diverged = {"round": rnd, "cause": cause}

    hooks: list[RoundHook] = [PlotHook(run.path, info, task.title(cfg)),
                              DivergenceWatch(lambda: (info.initial or {}).get("loss"),
                                              on_diverged)]
    if cfg.leakage.enabled:
        hooks.append(task.observer(cfg, run, len(clients)))
    if cfg.memorization.enabled:
        from .memorization import ExposureMeter

        hooks.append(ExposureMeter(cfg, run.path, model_for(cfg)[0], task.title(cfg)))
    if selection is not None:
        hooks.append(selection)
    if cfg.results.checkpoint:
        hooks.append(CheckpointHook(run.path, runner, privacy, anonymization, info,
                                    resume_config(cfg)))
    if cfg.results.tracking in TRACKERS:  # last: it logs the plots the hooks above drew
        hooks.append(Tracking(cfg, run.path, initial=lambda: info.initial,
                              start=checkpoint.round + 1 if checkpoint is not None else 1))
    central = runner.central
    return Federation(
        task, runner, privacy, task.evaluator(cfg),
        RoundRecorder(run, info, privacy, anonymization), hooks, selection, initial,
        checkpoint.round + 1 if checkpoint is not None else 1,
        [central.stop_reason] if central is not None else [],
        [lambda r: privacy.stop_reason(r.round),
         target_accuracy_reached(cfg.federation.target_accuracy)],
        Tamper(cfg, task, runner.describe()) if cfg.leakage.server == "malicious" else None)


def federation_grid(grid: Grid, cfg: RunConfig, run: RunFolder, clients: list[ClientInfo],
                    info: RunInfo, checkpoint: Checkpoint | None,
                    cell: Mapping[str, Any] | None) -> FederationGrid:
    """The run's view of the grid; where each client keeps its state for a resume, and on a
    resume, that every client still has it (else its epsilon would restart from zero)."""
    state_dir = (str(run.path / CHECKPOINT / CLIENT_STATES)
                 if cfg.results.checkpoint and simulated(grid) else "")
    stateless = [] if state_dir else [c.partition_id for c in clients if not c.keeps_state]
    if checkpoint is not None and needs_client_state(cfg) and stateless:
        raise ResumeError(
            f"the SuperNodes of client(s) {', '.join(map(str, stateless))} keep no state "
            "(they were started without a state-dir), so resuming would reset their epsilon "
            "or CVAE; start every SuperNode with --state-dir to resume this run")
    info.client_state = state_dir or (None if stateless else "on each SuperNode (state-dir)")
    info.num_clients = len(clients)
    fed = cfg.federation
    view = FederationGrid(grid, {c.node_id: c.partition_id for c in clients},
                          assign=simulated(grid), cell=cell, state_dir=state_dir,
                          poll_interval=fed.reply_poll_interval,
                          min_nodes=min(fed.min_train_clients, len(clients)),
                          wait_limit=fed.round_timeout)
    if checkpoint is not None and needs_client_state(cfg):
        steps = {int(p): int(n) for p, n in checkpoint.privacy.get("steps", {}).items()}
        check_client_state(view, view.partition_of, cfg, steps,
                           state_dir or "on each SuperNode, under its state-dir")
    return view


def _say_federation(cfg: RunConfig, task: ServerTask, clients: list[ClientInfo],
                    grid: FederationGrid, info: RunInfo) -> None:
    sizes = [c.num_examples for c in clients if c.num_examples is not None]
    say(f"model: {task.model_name} ({info.parameters:,} parameters) · strategy "
        f"{cfg.federation.strategy} · {len(clients)} clients ({cfg.data.partitioner}, "
        + (f"sizes {min(sizes)}–{max(sizes)}" if len(sizes) == len(clients)
           else "partitions assigned by the server" if grid.assign
           else "sizes not disclosed") + f") · {cfg.federation.num_server_rounds} rounds")


def disclosure_of(cfg: RunConfig) -> Disclosure:
    """What clients may send in the clear (:mod:`privacy.dp.disclosure`), said once."""
    disclosure = policy(cfg.privacy.dp, cfg.secagg.enabled, cfg.privacy.report_client_metrics)
    if disclosure.restricted:
        say(f"clients send in the clear only: {', '.join(sorted(disclosure.allowed or ()))} "
            f"({disclosure.reason})")
    return disclosure


def build_runner(cfg: RunConfig, grid: FederationGrid, context: Context,
                 clients: list[ClientInfo], task: ServerTask, disclosure: Disclosure,
                 info: RunInfo) -> RoundRunner:
    """The run's round runner (:func:`strategies.build.build_runner`); run.json records how
    it aggregates."""
    sizes = [c.num_examples for c in clients if c.num_examples is not None]
    params = info.parameters or 0
    runner = runner_for(cfg, grid, grid.partition_of, num_parameters=params, context=context,
                        max_weight=max_weight(cfg, sizes, len(clients), len(task.data.y_train)))
    info.aggregation = {**runner.describe(), **disclosure.describe()}
    return runner


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def finish(cfg: RunConfig, run: RunFolder, info: RunInfo, fed: Federation,
           result: LoopOutcome, t0: float) -> RunInfo:
    """Record the outcome: which model is reported, the saved model, run.json, summary.md."""
    if result.stopped_early:
        info.stopped_early = result.stopped_early
        say(f"stopping early: {result.stopped_early}")
    _report_model(cfg, info, fed.evaluator, fed.selection, result.arrays)
    info.privacy = fed.privacy.summary()
    _audit_canary_clients(cfg, run, fed.runner, result.arrays)
    if cfg.results.save_model:  # the evaluator holds the final model
        task = fed.task
        torch.save({"model": task.model_name, "input-shape": list(feature_shape(cfg)),
                    "num-classes": task.data.num_classes, "mlp-hidden": cfg.training.mlp_hidden,
                    "state-dict": fed.evaluator.state_dict()}, run.file("model.pt"))
    records = read_ledger(run.path)
    target = cfg.federation.target_accuracy
    if target:
        info.target_reached_round = next((r.round for r in records if r.accuracy >= target),
                                         None)
    info.status, info.finished, info.wall_s = "finished", now(), time.perf_counter() - t0
    info.update(outcome(records))
    run.write_info(info)
    write_summary(run, cfg, info, records)
    return info


def _audit_canary_clients(cfg: RunConfig, run: RunFolder, runner: RoundRunner,
                          final: ArrayRecord) -> None:
    """With canary-clients: the audit of the final model against the run's client-level
    claim (Andrew et al. 2024), written as audit-canary-clients.json (summary.md says it)."""
    audit = getattr(runner.aggregation, "canaries", None)
    central = runner.central
    if audit is None or central is None:
        return
    if audit.rounds == 0:
        say("canary-client audit: no round was released, nothing to audit")
        return
    out = audit.result(final.to_numpy_ndarrays(), central.epsilon,
                       cfg.leakage.audit_confidence)
    run.write_json(CANARY_AUDIT, out)
    say(canary_audit_text(out).replace("**", ""))


def _report_model(cfg: RunConfig, info: RunInfo, evaluator: CentralEvaluator,
                  selection: ModelSelection | None, final: ArrayRecord) -> None:
    """Which model the run reports (the lowest validation loss, or the final one) and, with
    test-noise, how it scores on noisy test inputs; the evaluator is left on the final model
    (the one saved)."""
    reported = final
    if selection is not None and selection.record is not None:
        reported = selection.arrays or final
        info.model_selection = {
            "round": selection.record.round, "rule": "lowest validation loss",
            "validation-fraction": cfg.training.validation_fraction,
            "test": {k: v for k, v in selection.record.test.items()
                     if not k.startswith("validation-")}}
    if cfg.training.noise_sigmas:
        info.robustness = evaluator.robustness(reported, cfg.training.noise_sigmas,
                                                  cfg.training.seed)
        say("robustness (test inputs + Gaussian noise): " + ", ".join(
            f"sigma {r['sigma']:g}: acc {r['accuracy']:.3f}"
            + (f", AUROC {r['auroc']:.3f}" if r.get("auroc") is not None else "")
            for r in info.robustness))
    evaluator.model.load_state_dict(final.to_torch_state_dict())
