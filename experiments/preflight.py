"""Checks that need the data, run by the CLI before any SuperLink or Ray process starts.

They run in a short-lived child process (:func:`preflight_isolated`): importing torch
costs about 0.5 GB, which the CLI would otherwise hold for the whole run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.config import ConfigError


@dataclass
class Preflight:
    dataset: str
    model: str
    parameters: int
    sizes: list[int]
    cuda: bool
    privacy: str = ""
    label_counts: list[list[int]] | None = None  # ground truth, per client


def absolutize(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Make folder keys absolute: the ServerApp runs in another process."""
    out = dict(cfg)
    for key in ("data-dir", "results-dir", "run-dir"):
        if out.get(key):
            out[key] = str(Path(str(out[key])).expanduser().resolve())
    return out


def preflight(cfg: Mapping[str, Any]) -> Preflight:
    """Load the dataset, build the model and partition the data exactly as the run will.

    Raises :class:`ConfigError` for anything that would make the run fail: missing
    data, a model that does not fit the data, an infeasible partitioning, an
    unwritable results folder. The partitioning is cached on disk for the clients.
    """
    import numpy as np
    import torch

    from tasks.models import count_parameters, model_for
    from tasks.splits import client_split, dataset_for, partitions_for, test_split
    from tasks.training import resolve_device

    results = Path(str(cfg["results-dir"]))
    try:
        results.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"results-dir {str(results)!r} cannot be created: {exc}.") from exc
    resolve_device(str(cfg["device"]))
    data = dataset_for(cfg)
    model, name = model_for(cfg)
    parts = partitions_for(cfg, int(cfg["num-clients"]))
    sizes = [len(p) for p in parts]
    labels = [np.bincount(data.y_train[p], minlength=data.num_classes).tolist() for p in parts]
    if cfg["features"] == "embeddings":  # train/load the backbone, embed every partition once
        splits = [client_split(cfg, pid, len(parts)) for pid in range(len(parts))]
        test_split(cfg)
        _anonymizer_check(cfg, splits)
    return Preflight(data.summary(), name, count_parameters(model), sizes,
                     torch.cuda.is_available(), _privacy_check(cfg, model, name, sizes), labels)


def _anonymizer_check(cfg: Mapping[str, Any], splits: list) -> None:
    """Run the anonymizer for every client now (results are cached for the run), so bad
    parameters — k above a client's size, DBSCAN finding no cluster — stop the run before
    it starts. The CVAEs are trained by the clients themselves, in parallel."""
    if cfg["anonymizer"] in ("none", "cvae", "cvae-federated"):
        return
    from clients.anonymized import released_data
    from clients.app import derive_seed
    from privacy.anonymizers import AnonymizationError

    for pid, split in enumerate(splits):
        try:
            released_data(cfg, split, derive_seed(int(cfg["seed"]), pid))
        except AnonymizationError as exc:
            raise ConfigError(f"anonymizer = {cfg['anonymizer']!r}, client {pid} "
                              f"({len(split)} records): {exc}") from None


def _privacy_check(cfg: Mapping[str, Any], model: Any, name: str, sizes: list[int]) -> str:
    """Check the DP settings against the model and every client's data size; describe them."""
    if cfg["dp"] == "local":
        from clients.local_dp import LocalDPError, new_ledger
        from privacy.anonymizers import dp_sgd_unit
        from privacy.dpsgd import check_model, resolve_mode

        check_model(model)
        sigmas = {}
        for n in sorted(set(sizes)):
            try:
                sigmas[n] = new_ledger(cfg, n, len(sizes))
            except LocalDPError as exc:
                raise ConfigError(f"dp = 'local', client with {n} records: {exc}") from None
        lo, hi = min(s.noise_multiplier for s in sigmas.values()), max(
            s.noise_multiplier for s in sigmas.values())
        budget = (f"target-epsilon {cfg['target-epsilon']} per client" if
                  cfg["target-epsilon"] else "no budget")
        unit = dp_sgd_unit(str(cfg["anonymizer"]), str(cfg["dp-train-data"]))
        caveat = ("; NOTE: epsilon per released row, not per original record (see "
                  "dp-train-data)" if unit != "record" else "")
        return (f"local DP-SGD ({unit}-level): noise multiplier {lo:.3f}"
                + (f"–{hi:.3f}" if hi > lo else "")
                + f", clipping {cfg['max-grad-norm']}, {budget}, grad-sample mode "
                f"{resolve_mode(str(cfg['grad-sample-mode']), name)}{caveat}")
    if cfg["dp"] == "central":
        from strategies.central_dp import central_params

        n = len(sizes)
        params = central_params(cfg, n)
        delta = params.target_delta
        if delta >= 1.0 / n:
            raise ConfigError(f"dp = 'central': delta = {delta:g} is not below 1/N = {1 / n:g} "
                              f"for N = {n} clients. Use delta = 0 (automatic min(1e-5, "
                              "N^-1.1)).")
        if params.adaptive:
            try:
                params.update_multiplier  # noqa: B018  (raises when the noise cannot split)
            except ValueError:
                z, d = params.noise_multiplier, params.denominator
                raise ConfigError(
                    f"adaptive clipping with noise-multiplier = {z} and {d:g} clients per "
                    f"round: the clipped-count noise (std d/20 = {d / 20:g}, Andrew et al.'s "
                    f"recommendation) must exceed z/2. Use more clients per round (d > "
                    f"{10 * z:g}), a smaller noise-multiplier, or fixed clipping.") from None
        note = (f" (client-level epsilon with N = {n} clients needs much noise; DP-FedAvg is "
                "meant for hundreds of clients per round or more)" if n < 100 else "")
        return (f"central DP-FedAvg: noise multiplier {cfg['noise-multiplier']}, "
                f"{cfg['central-clipping']} clipping at {cfg['clipping-norm']}, "
                f"{cfg['client-sampling']} sampling, sum divided by {params.denominator:g}, "
                f"delta {delta:.3g}; neighbours: one client added or removed{note}")
    return ""


def preflight_isolated(cfg: Mapping[str, Any]) -> Preflight:
    """:func:`preflight` in a child process; a ConfigError there is raised here."""
    # stderr goes straight to the terminal: progress such as backbone training shows live
    proc = subprocess.run([sys.executable, "-m", "experiments.preflight"], text=True,
                          input=json.dumps(dict(cfg)), stdout=subprocess.PIPE)
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if "error" in answer:
        raise ConfigError(answer["error"])
    if proc.returncode != 0 or "result" not in answer:
        raise RuntimeError(f"the pre-flight check crashed (exit code {proc.returncode}); its "
                           "error is printed above")
    return Preflight(**answer["result"])


def _main() -> None:
    cfg = json.loads(sys.stdin.read())
    try:
        print(json.dumps({"result": asdict(preflight(cfg))}))
    except ConfigError as exc:
        print(json.dumps({"error": str(exc)}))


if __name__ == "__main__":
    _main()
