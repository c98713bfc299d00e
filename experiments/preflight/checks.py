"""The pre-flight checks themselves: they load the data, the model and the privacy stack.

Run as ``python -m experiments.preflight.checks`` by
:func:`experiments.preflight.isolated.preflight_isolated` (a config as JSON on stdin, the
answer as JSON on the last line of stdout), so the CLI process never imports torch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import psutil
import torch

from clients.anonymized import released_data
from clients.local_dp import LocalDPError, new_ledger, schedule
from clients.update import observed_rows
from privacy.anonymize import AnonymizationError, dp_sgd_unit
from privacy.anonymize.registry import ANONYMIZERS
from privacy.attacks.imprint import cnn_trunk, trap_layers
from privacy.attacks.registry import attacks_scored_as
from privacy.dp.accounting import ACCOUNTANT_NAMES
from privacy.dp.dpfedavg import DPFedAvgParams, default_central_delta
from privacy.dp.dpsgd import (
    UnsupportedModelError,
    check_mode,
    check_model,
    private_layers,
    resolve_mode,
)
from privacy.registry import Registry
from strategies.central_dp import central_params
from tasks.config import ConfigError, RunConfig, validate
from tasks.config.plugins import registered_by
from tasks.models import count_parameters
from tasks.progress import track
from tasks.registry import DATASETS, MODELS, PARTITIONERS
from tasks.seeding import derive_seed
from tasks.splits import (
    client_split,
    dataset_for,
    expected_partition_size,
    feature_shape,
    heldout_split,
    model_for,
    model_name,
    partitions_for,
)
from tasks.training import resolve_device

from ..configs import check_registered
from .isolated import Preflight


def writable(folder: Path, key: str) -> None:
    """ConfigError unless ``folder`` exists or can be made, and a file can be written in
    it (a read-only mount, a folder of another user, a full disk): checked by writing."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key} {str(folder)!r} cannot be created: "
                          f"{exc.strerror or exc}. Choose a folder you can write to.") from None
    try:
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(b"fedpriv")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise ConfigError(f"{key} {str(folder)!r} cannot be written to: "
                          f"{exc.strerror or exc}. Choose a folder you can write to (and "
                          "that has free space).") from None


RAY_PROBE_S = 5.0  # how long a Ray head may take to accept a TCP connection


@functools.lru_cache(maxsize=16)  # a sweep's cells share one address: probed once
def ray_head_answers(address: str) -> None:
    """ConfigError unless something accepts a TCP connection at ``address`` (a Ray head's
    HOST:PORT; empty: a private Ray, nothing to check) within :data:`RAY_PROBE_S` s:
    Flower's simulation would otherwise wait for that head forever."""
    if not address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_PROBE_S):
            pass
    except (OSError, ValueError) as exc:
        why = ("no answer within " f"{RAY_PROBE_S:g} s" if isinstance(exc, TimeoutError)
               else exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))
        raise ConfigError(
            f"ray-address = {address!r}: nothing answers there ({why}), so Flower's "
            "simulation would wait for that Ray head forever. Start the cluster's head "
            f"there (`ray start --head --port {port}` on {host}), check the address and that "
            "this machine can reach that port, or leave ray-address empty to run on a "
            "private Ray on this machine.") from None


CELL_KEYS = {"index": int, "label": str, "config": dict}  # what the ServerApp reads of a cell


def sweep_cells(path: str) -> None:
    """ConfigError unless ``path`` (run-config key sweep-cells; empty: one run) is a cells
    file as `fedpriv sweep` writes it, which the ServerApp reads only once it has started."""
    if not path:
        return
    fix = ("sweep-cells is written by `fedpriv sweep` (the cells it runs in one "
           "simulation): leave it empty to run one configuration, or run a sweep with "
           "`fedpriv sweep FILE`.")
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except OSError as exc:
        raise ConfigError(f"sweep-cells = {path!r} cannot be read ({exc.strerror or exc}). "
                          f"{fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"sweep-cells = {path!r} is not JSON ({exc}). {fix}") from None
    cells = data.get("cells") if isinstance(data, dict) else None
    bad = not isinstance(cells, list) or not cells or any(
        not isinstance(c, dict) or any(not isinstance(c.get(k), t) for k, t in CELL_KEYS.items())
        for c in cells)
    if bad:
        raise ConfigError(f"sweep-cells = {path!r} is not a sweep's cells file: it must hold "
                          "{\"cells\": [...]}, each cell with an index, a label and its "
                          f"config. {fix}")


def preflight(cfg: RunConfig) -> Preflight:
    """Load the dataset, build the model and partition the data exactly as the run will.

    Raises :class:`ConfigError` for anything that would make the run fail: missing
    data, a model that does not fit the data, an infeasible partitioning, an
    unwritable results folder. The partitioning is cached on disk for the clients.
    """
    check_registered(cfg)
    writable(Path(cfg.results.results_dir), "results-dir")
    ray_head_answers(cfg.resources.ray_address)
    sweep_cells(cfg.results.sweep_cells)
    resolve_device(cfg.resources.device)
    cores = os.cpu_count() or 1
    if cfg.resources.client_cpus > cores and not cfg.resources.ray_address:
        raise ConfigError(
            f"client-cpus = {cfg.resources.client_cpus} but this machine has {cores} CPU "
            f"cores: Ray could never place a client, and the run would stall. Use "
            f"client-cpus <= {cores}.")
    with plugin_code(DATASETS, cfg.data.dataset, "dataset"):
        data = dataset_for(cfg)
    _mlp_fits(cfg)
    model, name = _model(cfg)
    with plugin_code(PARTITIONERS, cfg.data.partitioner, "partitioner"):
        parts = partitions_for(cfg, cfg.federation.num_clients)
    sizes = [len(p) for p in parts]
    lk = cfg.leakage
    observed = ((lk.clients(len(parts)) or range(len(parts))) if lk.enabled else [])
    membership = [a for a in lk.attack_list() if a in attacks_scored_as("membership")]
    heldout = 0
    for pid in observed:
        trained = observed_rows(cfg, pid, len(parts), sizes[pid])
        if membership and trained == sizes[pid]:
            raise ConfigError(
                f"attacks include {', '.join(membership)} but observed client {pid} trains on "
                f"all its {sizes[pid]} records, so none is left as a non-member to score the "
                f"attack on. Use observed-examples below {sizes[pid]} or leakage-holdout > 0.")
        heldout += sizes[pid] - trained
        sizes[pid] = trained
    if membership and lk.mia_nonmembers > heldout:
        raise ConfigError(
            f"mia-nonmembers = {lk.mia_nonmembers}, but the observed client(s) keep back only "
            f"{heldout} records that they never train on (the non-members). Lower "
            f"mia-nonmembers to at most {heldout} (TPR at 0.1% FPR needs 1,000), or leave "
            "more rows out of training: a smaller observed-examples, fewer clients (larger "
            "partitions) or a larger dataset.")
    _canaries_fit(cfg, model)
    _trap_fits(cfg, model, name)
    labels = [np.bincount(data.y_train[p], minlength=data.num_classes).tolist() for p in parts]
    if cfg.embeddings.enabled:  # train/load the backbone, embed every partition once
        splits = [client_split(cfg, pid, len(parts)) for pid in range(len(parts))]
        heldout_split(cfg)
        _anonymizer_check(cfg, splits)
    return Preflight(data.summary(), name, count_parameters(model), sizes,
                     torch.cuda.is_available(), _privacy_check(cfg, model, name, sizes), labels)


@contextlib.contextmanager
def plugin_code(registry: Registry, name: str, key: str) -> Iterator[None]:
    """An exception from what a plugin registered as ``name`` (its model factory, its
    dataset's reader...) as a ConfigError naming the plugin; fedpriv's own code raising is
    a bug, and keeps its traceback."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        plugin = registered_by(registry, name)
        if plugin is None:
            raise
        first = (str(exc).splitlines() or [""])[0]
        raise ConfigError(
            f"{key} = {name!r}, which the plugin {plugin!r} registers, failed in the "
            f"pre-flight check: it raised {type(exc).__name__}{': ' + first if first else ''}."
            f" A {registry.kind} in {registry.where} must be {registry.signature}. Fix it "
            f"in {plugin}, or choose another {key}.") from None


def _model(cfg: RunConfig) -> tuple[torch.nn.Module, str]:
    """The run's model, built as the clients will (a plugin's factory that raises or
    returns something other than a torch module is refused, naming the plugin)."""
    name = model_name(cfg)
    with plugin_code(MODELS, name, "model"):
        model, name = model_for(cfg)
    if not isinstance(model, torch.nn.Module):
        plugin = registered_by(MODELS, name) or MODELS.module(name)
        got = repr(model)
        got = got if len(got) <= 60 else got[:57] + "..."
        raise ConfigError(
            f"model = {name!r}, which the plugin {plugin!r} registers, returned "
            f"{type(model).__name__} {got} instead of a torch.nn.Module. A model in "
            f"{MODELS.where} must be {MODELS.signature}. Fix its factory in {plugin}, or "
            "choose another model.")
    return model, name


def _canaries_fit(cfg: RunConfig, model: torch.nn.Module) -> None:
    """The audit places each Dirac canary on a coordinate of its own: refuse more canaries
    than the model has parameters, before any training."""
    params = sum(p.numel() for p in model.parameters())
    if cfg.leakage.canaries > params:
        raise ConfigError(
            f"canaries = {cfg.leakage.canaries}, but the model has only {params} parameters: "
            "each audit canary is a Dirac gradient on a coordinate of its own, so there can "
            f"be at most one per parameter. Use canaries <= {params} (a few thousand make "
            "a tight whole-run audit; see docs/LEAKAGE.md) or a larger model.")


def _trap_fits(cfg: RunConfig, model: torch.nn.Module, name: str) -> None:
    """A malicious server needs a layer its trap can sit in: refuse a model without one."""
    if cfg.leakage.server != "malicious":
        return
    try:
        trap = trap_layers(model)
        if not trap.raw:
            cnn_trunk(model, model.state_dict())
    except ValueError as exc:
        raise ConfigError(
            f"server = 'malicious' with model = {name!r}: {exc}, so its weights cannot be "
            "tampered with that way. Use model = 'mlp', 'cnn' or 'small-cnn'.") from None


def _mlp_fits(cfg: RunConfig) -> None:
    """Refuse hidden widths whose weights alone would not fit in a quarter of this
    machine's memory (every client and the server hold a copy), before allocating."""
    if model_name(cfg) != "mlp":
        return
    widths = [int(np.prod(feature_shape(cfg))), *cfg.training.hidden,
              dataset_for(cfg).num_classes]
    params = sum((a + 1) * b for a, b in zip(widths, widths[1:], strict=False))
    budget = psutil.virtual_memory().total // 4
    if params * 4 > budget:
        raise ConfigError(
            f"mlp-hidden = {cfg.training.mlp_hidden!r} gives an MLP of {params:,} weights "
            f"({params * 4 / 2**30:,.1f} GiB in float32), more than a quarter of this "
            f"machine's {psutil.virtual_memory().total / 2**30:.0f} GiB; every client and "
            "the server hold a copy. Use narrower layers, e.g. mlp-hidden = '200,200'.")


def _anonymizer_check(cfg: RunConfig, splits: list) -> None:
    """Run the anonymizer for every client now (results are cached for the run), so bad
    parameters — k above a client's size, DBSCAN finding no cluster — stop the run before
    it starts. The CVAEs are trained by the clients themselves, in parallel."""
    a = cfg.anonymization
    if a.anonymizer in ("none", "cvae", "cvae-online", "cvae-federated"):
        return
    for pid, split in enumerate(track(splits, f"pre-flight: {a.anonymizer} on each client")):
        try:
            with plugin_code(ANONYMIZERS, a.anonymizer, "anonymizer"):
                released_data(a, split, derive_seed(cfg.training.seed, pid))
        except AnonymizationError as exc:
            raise ConfigError(f"anonymizer = {a.anonymizer!r}, client {pid} "
                              f"({len(split)} records): {exc}") from None


def _privacy_check(cfg: RunConfig, model, name: str, sizes: list[int]) -> str:
    """Check the DP settings against the model and every client's data size; describe them."""
    if cfg.privacy.dp == "local":
        return _local_dp_check(cfg, model, name, sizes)
    if cfg.privacy.dp == "central":
        return _central_dp_check(cfg, len(sizes), count_parameters(model))
    if cfg.privacy.dp == "distributed":
        return _distributed_dp_check(cfg, len(sizes),
                                     sum(int(v.numel()) for v in model.state_dict().values()))
    return ""


def _distributed_dp_check(cfg: RunConfig, n: int, dim: int) -> str:
    """The bit width against the cohort, clip and noise (the modular sum must not wrap),
    delta against the population, and the noise against what a round can learn."""
    from tasks.distributed_dp import plan_for

    p = cfg.privacy
    try:
        plan = plan_for(cfg, dim)
    except ValueError as exc:
        raise ConfigError(f"dp = 'distributed': {exc}") from None
    delta = p.delta or default_central_delta(n)
    if delta >= 1.0 / n:
        raise ConfigError(f"dp = 'distributed': delta = {delta:g} is not below 1/N = "
                          f"{1 / n:g} for N = {n} clients. Use delta = 0 (automatic).")
    ratio = p.noise_multiplier * dim ** 0.5 / plan.cohort
    if p.max_noise_to_signal and ratio > p.max_noise_to_signal:
        raise ConfigError(
            f"dp = 'distributed' with noise-multiplier = {p.noise_multiplier} on a model of "
            f"{dim:,} weights and {plan.cohort} clients a round: the noise on the averaged "
            f"update is expected to be {ratio:.1f}x longer than the longest averaged update "
            f"(z * sqrt(weights) / clients), over max-noise-to-signal = "
            f"{p.max_noise_to_signal:g}, so the model cannot learn. Train more clients a "
            f"round ({ratio / p.max_noise_to_signal * plan.cohort:.0f} or more), lower "
            f"noise-multiplier (to {p.max_noise_to_signal / ratio * p.noise_multiplier:.2g} "
            "or less), or set max-noise-to-signal = 0 to run it anyway.")
    return (f"distributed DP: Skellam shares inside SecAgg+, noise multiplier "
            f"{p.noise_multiplier} on the sum of {plan.cohort} updates clipped to "
            f"{p.clipping_norm}, {plan.bits}-bit modular sum at scale {plan.scale:.4g}, "
            f"{plan.colluding} colluding client(s) assumed, delta {delta:.3g}, no "
            "amplification (the server picks the cohorts); neighbours: one client's update "
            "zeroed")


def _local_dp_check(cfg: RunConfig, model, name: str, sizes: list[int]) -> str:
    try:
        model = copy.deepcopy(model)
        mode = resolve_mode(cfg.privacy.grad_sample_mode, name)
        private_layers(model, mode)  # as make_private trains it (recurrent layers swapped)
        check_model(model)
        check_mode(mode, model)
    except UnsupportedModelError as exc:
        raise ConfigError(str(exc)) from None
    p = cfg.privacy
    public = (p.public_records or expected_partition_size(cfg, len(sizes))
              if p.dp_relation == "add-remove" else 0)
    ledgers = {}
    for n in sorted(set(sizes)):
        plan = schedule(cfg, public, n)
        try:
            ledgers[plan] = new_ledger(cfg, plan, len(sizes))
        except LocalDPError as exc:
            raise ConfigError(f"dp = 'local', client with {n} records: {exc}") from None
    sigmas = [s.noise_multiplier for s in ledgers.values()]
    lo, hi = min(sigmas), max(sigmas)
    first = next(iter(ledgers))
    origin = "dp-public-records" if p.public_records else "the expected partition size"
    schedule_text = (f"public N = {public} records ({origin}): q = {first.sample_rate:.4g}, "
                     f"{first.steps_per_epoch} steps an epoch" if public
                     else "n public (replace-one): q = B / n per client")
    budget = f"target-epsilon {p.target_epsilon} per client" if p.target_epsilon else "no budget"
    unit = dp_sgd_unit(cfg.anonymization.anonymizer, p.dp_train_data)
    caveat = ("; NOTE: epsilon per released row, not per original record (see dp-train-data)"
              if unit != "record" else "")
    return (f"local DP-SGD ({unit}-level): noise multiplier {lo:.3f}"
            + (f"–{hi:.3f}" if hi > lo else "")
            + f", clipping {p.max_grad_norm}, {budget}, {p.dp_relation} neighbours, "
            f"{schedule_text}, accountant {ACCOUNTANT_NAMES[p.accountant]}, grad-sample mode "
            f"{_trained_mode(cfg, name)}{caveat}")


def _trained_mode(cfg: RunConfig, name: str) -> str:
    """The grad-sample mode the clients train with: hooks for the audited clients of a run
    with canaries (their per-sample gradients are written before clipping)."""
    mode = resolve_mode(cfg.privacy.grad_sample_mode, name)
    lk = cfg.leakage
    if lk.enabled and lk.canaries and mode != "hooks":
        return f"{mode} (hooks for the audited clients: their canaries need per-sample gradients)"
    return mode


def _central_dp_check(cfg: RunConfig, n: int, weights: int) -> str:
    p = cfg.privacy
    try:
        params = central_params(cfg, n)
    except ValueError as exc:  # a target-epsilon no noise multiplier reaches
        raise ConfigError(
            f"dp = 'central' with target-epsilon = {p.target_epsilon}: {exc}. Raise "
            "target-epsilon, or give a noise-multiplier (target-epsilon = 0).") from None
    delta = params.target_delta
    if delta >= 1.0 / n:
        raise ConfigError(f"dp = 'central': delta = {delta:g} is not below 1/N = {1 / n:g} "
                          f"for N = {n} clients. Use delta = 0 (automatic min(1e-5, N^-1.1)).")
    if params.adaptive:
        try:
            params.update_multiplier  # noqa: B018  (raises when the noise cannot split)
        except ValueError:
            z, d = params.noise_multiplier, params.denominator
            raise ConfigError(
                f"adaptive clipping with noise-multiplier = {z} and {d:g} clients per round: "
                f"the clipped-count noise (std d/20 = {d / 20:g}, Andrew et al.'s "
                f"recommendation) must exceed z/2. Use more clients per round (d > "
                f"{10 * z:g}), a smaller noise-multiplier, or fixed clipping.") from None
    z = params.noise_multiplier
    how = (f"noise-multiplier = {z:.4g} (calibrated for target-epsilon = {p.target_epsilon})"
           if p.target_epsilon else f"noise-multiplier = {z}")
    ratio = noise_to_signal(params, weights)
    if p.max_noise_to_signal and ratio > p.max_noise_to_signal:
        fewer = (f"lower noise-multiplier (to {p.max_noise_to_signal / ratio * z:.2g} or "
                 "less, a larger epsilon)" if not p.target_epsilon else
                 "raise target-epsilon")
        raise ConfigError(
            f"dp = 'central' with {how} on a model of "
            f"{weights:,} weights, divided by {params.denominator:g} clients a round: the "
            f"noise on the averaged update is expected to be {ratio:.1f}x longer than the "
            f"longest averaged update can be (z * sqrt(weights) / clients), over "
            f"max-noise-to-signal = {p.max_noise_to_signal:g}, so the model cannot learn. "
            f"Train more clients a round (num-clients, fraction-train: "
            f"{ratio / p.max_noise_to_signal * params.denominator:.0f} or more), {fewer}, "
            "or set max-noise-to-signal = 0 to run it anyway (to study accounting or attacks "
            "rather than accuracy).")
    note = (f" (client-level epsilon with N = {n} clients needs much noise; DP-FedAvg is "
            "meant for hundreds of clients per round or more)" if n < 100 else "")
    mechanism = ("" if params.matrix is None else
                 f", {params.matrix.describe()}")
    return (f"central DP-FedAvg: noise multiplier {z:.4g}{mechanism}, {p.central_clipping} "
            f"clipping at {p.clipping_norm}, {p.client_sampling} sampling, sum divided by "
            f"{params.denominator:g} (noise {ratio:.1f}x the longest averaged update), delta "
            f"{delta:.3g}; neighbours: one client added or removed{note}")


def noise_to_signal(params: DPFedAvgParams, weights: int) -> float:
    """Expected L2 norm of DP-FedAvg's noise on the averaged update over the longest the
    average of clipped updates can be: z C sqrt(d) / m over C (McMahan et al. 2018); for
    correlated noise z is scaled by the model's noise relative to independent noise."""
    scale = params.matrix.model_noise_scale() if params.matrix is not None else 1.0
    return params.update_multiplier * scale * math.sqrt(weights) / params.denominator


def _answer(values: dict) -> dict:
    try:
        return {"result": asdict(preflight(validate(values)))}
    except ConfigError as exc:
        return {"error": str(exc)}


def answer(given: dict | list) -> dict:
    """The answer to one config (a dict: its result or error; anything else it raises
    propagates) or several (a list, a sweep's cells: one answer each, a crash included)."""
    if not isinstance(given, list):
        return _answer(given)
    answers = []
    # a broken cell must not hide the others' answers
    for values in track(given, "pre-flight: checking cells"):
        try:
            answers.append(_answer(values))
        except Exception as exc:
            answers.append({"crash": f"{type(exc).__name__}: {exc}"})
    return {"results": answers}


def main() -> None:
    """One config (a JSON object) or several (a JSON list, a sweep's cells) on stdin."""
    print(json.dumps(answer(json.loads(sys.stdin.read()))))


if __name__ == "__main__":
    from experiments.runtime.procs import exit_now

    main()
    exit_now(0)
