"""Benchmark: DP-SGD round time against plain SGD, for each Opacus grad-sample mode.

Views of the same workload (default: 10 clients x 400 embedded-MNIST images,
5 rounds, 1 local epoch, batch 32):

1. per client, in one process: one local epoch of plain SGD vs DP-SGD with ``hooks``,
   ``ghost`` and ``bookkeeping`` clipping (1 torch thread, as a simulated client runs),
   and plain SGD drawing DP-SGD's Gaussian noise in each step: the floor no clipping
   method goes below at this batch size without a spare core;
2. per round, through fedpriv (the in-process runtime): steady-state round time with
   ``dp = none`` and ``dp = local`` for each mode (fixed noise multiplier, so no
   calibration cost is included), and, where DP-SGD trains at a batch size or learning
   rate of its own (MNIST's DP-SGD settings), ``dp = none`` at those as well: the
   mechanism's cost apart from the settings' (the last rows);
3. with ``--client-rounds``, per client round in one process: client 0's whole round as
   its ClientApp runs it (``local_update``: DP set-up, epoch, ledger, epsilon, digest);
4. with ``--accounting ROUNDS``, the epsilon a client reports after each of the run's
   first ROUNDS rounds (its DP-SGD schedule, noise multiplier 1.0 unless set): fedpriv's
   PLD accountant against dp-accounting's own ``PLDAccountant`` on the same history (the
   floor, and the values must be equal), and Opacus' RDP beside them.

    python -m experiments.benchmarks.dp_overhead                   # small-cnn
    python -m experiments.benchmarks.dp_overhead --set model=cnn   # McMahan CNN
    python -m experiments.benchmarks.dp_overhead --federated-modes bookkeeping \
        --federated-repeats 3
    python -m experiments.benchmarks.dp_overhead --config shakespeare \
        --federated-modes bookkeeping --set num-server-rounds=4     # the GRU, 50 steps
    python -m experiments.benchmarks.dp_overhead --skip-federated --repeats 1 \
        --accounting 15                                            # each round's epsilon

Modes that cannot train the model (ghost on recurrent layers) are left out and named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from experiments.benchmarks.fedavg_overhead import DEFAULT_SET, bench_fedpriv, print_table
from experiments.configs import resolve
from privacy.dp.dpsgd import UnsupportedModelError, check_mode, make_private
from tasks.allocator import keep_freed_memory
from tasks.config import RunConfig
from tasks.splits import client_split, model_for
from tasks.training import (
    client_optimizer,
    convolutions_channels_last,
    make_loader,
    resolve_device,
    train_epochs,
)

MODES = ("hooks", "ghost", "bookkeeping")


def epoch_times(cfg: RunConfig, repeats: int = 5) -> dict[str, float]:
    """Median seconds for one local epoch of client 0 (at most ``local-steps`` steps) on the run's
    ``device``, plain and per DP mode that can train the model (and with ``secure-rng``: OS-
    seeded generator, Opacus' four-draw noise). The variants take turns within each repeat, so
    that a shared machine's load falls on all alike."""
    torch.set_num_threads(1)
    device = resolve_device(cfg.resources.device)
    split = client_split(cfg, 0, cfg.federation.num_clients)
    t = cfg.training
    modes = usable_modes(cfg)
    variants = ("none", "none+noise", *modes,
                *(f"{m}+secure-rng" for m in ("hooks", "bookkeeping") if m in modes))
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(repeats + 1):  # the first run warms up
        for variant in variants:
            mode = variant.split("+")[0]
            torch.manual_seed(r)
            model, _ = model_for(cfg)
            convolutions_channels_last(model.to(device), device)  # as a client trains
            # a plain client's SGD; Opacus wraps a torch Optimizer
            opt = client_optimizer(model, t, for_opacus=mode != "none")
            loader = make_loader(split.x, split.y, t.batch_size, r)
            criterion = None
            if variant == "none+noise":
                noise_draws(opt, list(model.parameters()), r + 1)
            elif mode != "none":
                p = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                 grad_sample_mode=mode, seed=r, secure=variant != mode,
                                 noise_seed=r + 1,  # a generator of its own, as a client's
                                 device=device)
                model, opt, loader, criterion = p.model, p.optimizer, p.loader, p.criterion
            t0 = time.perf_counter()
            train_epochs(model, loader, opt, 1, device, criterion=criterion,
                         max_steps=t.local_steps)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:
                times[variant].append(time.perf_counter() - t0)
    return {v: statistics.median(ts) for v, ts in times.items()}


def noise_draws(opt: Any, params: list[torch.Tensor], seed: int) -> None:
    """After each of ``opt``'s steps, draw the Gaussian noise DP-SGD adds to that step (one
    ``normal_`` per parameter, into buffers of its shapes, from a generator of its own, as
    :mod:`privacy.dp.bookkeeping` draws it): plain SGD plus this is the floor of any exact
    DP-SGD at this batch size when no core is spare (a federated round trains a client on
    every core), whatever the clipping costs; book-keeping draws the next step's noise on
    a spare core when there is one, as in this one-process view."""
    generator = torch.Generator(device=params[0].device).manual_seed(seed)
    buffers = [torch.empty_like(p) for p in params]
    step = opt.step

    def step_and_draw() -> None:
        step()
        for buf in buffers:
            buf.normal_(0, 1.0, generator=generator)

    opt.step = step_and_draw


def usable_modes(cfg: RunConfig) -> list[str]:
    """The grad-sample modes that can train ``cfg``'s model; the others are named."""
    model, _ = model_for(cfg)
    usable = []
    for mode in MODES:
        try:
            check_mode(mode, model)
            usable.append(mode)
        except UnsupportedModelError:
            print(f"grad-sample-mode {mode} cannot train model {cfg.training.model!r}: "
                  "left out", flush=True)
    return usable


def client_round_times(sets: list[str], modes: list[str], repeats: int = 7,
                       config: str | None = None) -> dict[str, float]:
    """Median seconds of client 0's whole round in one process, as its ClientApp runs it
    (``clients.update.local_update``: for DP-SGD make_private, the epoch, the ledger and
    epsilon, the release's digest), without DP and with each mode, taking turns."""
    from flwr.app import Context, RecordDict

    from clients.update import Client, local_update

    torch.set_num_threads(1)
    variants = {"none": ["dp=none"]}
    variants.update({m: ["dp=local", "noise-multiplier=1.0", f"grad-sample-mode={m}"]
                     for m in modes})
    setups = {}
    for name, extra in variants.items():
        cfg = resolve(config, sets + extra)
        client = Client(cfg, 0, cfg.federation.num_clients,
                        client_split(cfg, 0, cfg.federation.num_clients))
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
        setups[name] = (client, ctx, model_for(cfg)[0].state_dict())
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats + 1):  # the first round warms up
        for name, (client, ctx, state) in setups.items():
            t0 = time.perf_counter()
            local_update(client, ctx, state, {"server-round": r + 1})
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def accounting_times(cfg: RunConfig, rounds: int) -> list[dict[str, float]]:
    """Per round of the run's local DP-SGD schedule (its public sizes, the clients'
    ledger): the epsilon reported after it and the seconds each accountant takes for it,
    as a client computes it once the runtime has warmed the one-step PLDs (fedpriv's
    PLD, the default), as dp-accounting's ``PLDAccountant`` computes the same history
    from scratch on the same grid (the floor: the values must be equal to the bit), and
    Opacus' RDP."""
    import dp_accounting as dpa
    from dp_accounting.pld import PLDAccountant

    from clients.local_dp import public_ledger
    from privacy.dp.accounting import _grid, dp_relation, epsilon

    ledger, per_round = public_ledger(cfg, cfg.federation.num_clients)
    sigma, q, delta, relation = (ledger.noise_multiplier, ledger.sample_rate, ledger.delta,
                                 ledger.relation)
    ledger.warm(per_round, rounds)  # what the runtime computes before its workers fork
    out = []
    for r in range(1, rounds + 1):
        history = [(sigma, q, per_round * r)]
        t0 = time.perf_counter()
        ours = epsilon(history, delta, "pld", relation)
        t1 = time.perf_counter()
        # on the grid fedpriv chose (dp-accounting's default 1e-4 up to epsilon 10)
        acc = PLDAccountant(dp_relation(relation), value_discretization_interval=_grid(
            tuple(history), delta, relation))
        acc.compose(dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), per_round * r))
        theirs = float(acc.get_epsilon(delta))
        t2 = time.perf_counter()
        rdp = epsilon(history, delta, "rdp", relation) if relation == "add-remove" else \
            float("nan")
        t3 = time.perf_counter()
        if ours != theirs:
            raise RuntimeError(f"round {r}: fedpriv's PLD epsilon {ours!r} is not "
                               f"dp-accounting's {theirs!r}")
        out.append({"round": r, "steps": per_round * r, "epsilon": ours, "fedpriv-s": t1 - t0,
                    "dp-accounting-s": t2 - t1, "rdp-epsilon": rdp, "rdp-s": t3 - t2})
    return out


SAME_BATCH = "none@dp-settings"


def same_batch_sets(cfg: RunConfig, config: str | None, sets: list[str]) -> list[str]:
    """The ``KEY=VALUE`` settings a local-DP run of ``cfg`` trains at where plain SGD's
    differ (batch size and learning rate: :mod:`experiments.dp_defaults` gives DP-SGD its
    own on MNIST), so that plain SGD can be timed at DP-SGD's batches as well: the
    per-round ratio then holds the mechanism (clipping, noise, Poisson sampling) apart
    from the settings. Empty when they are the same."""
    dp = resolve(config, sets + ["dp=local", "noise-multiplier=1.0"]).training
    plain = cfg.training
    return [f"{key}={value}" for key, value, own in
            (("batch-size", dp.batch_size, plain.batch_size), ("lr", dp.lr, plain.lr))
            if value != own]


def main() -> None:
    parser = argparse.ArgumentParser(description="DP-SGD vs SGD round time per grad-sample mode")
    parser.add_argument("--config", help="a preset (without it, the MNIST default: "
                        f"{' '.join(DEFAULT_SET)})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--skip-federated", action="store_true")
    parser.add_argument("--repeats", type=int, default=5, help="timed epochs per variant")
    parser.add_argument("--federated-modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--federated-repeats", type=int, default=1,
                        help="fedpriv runs per variant (taking turns); median of their rounds")
    parser.add_argument("--client-rounds", action="store_true",
                        help="also time client 0's whole round (local_update) in this process")
    parser.add_argument("--accounting", type=int, default=0, metavar="ROUNDS",
                        help="also time the epsilon reported after each of the first ROUNDS "
                        "rounds against dp-accounting's PLDAccountant")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    keep_freed_memory()  # as a client's process allocates (the epochs and client rounds here)
    sets = args.set if args.config else DEFAULT_SET + args.set  # a preset brings its own
    cfg = resolve(args.config, sets)
    report: dict = {"args": sets, "config": args.config,
                    "epoch-s": epoch_times(cfg, args.repeats)}
    federated_modes = [m for m in args.federated_modes if m in report["epoch-s"]]
    rows = [("", "seconds", "ratio to SGD")]
    base = report["epoch-s"]["none"]
    names = {"none": "plain SGD", "none+noise": "plain SGD + DP-SGD's noise, drawn in the step"}
    for mode, t in report["epoch-s"].items():
        rows.append((f"one client epoch, {names.get(mode, mode)}", f"{t:.3f}",
                     f"{t / base:.2f}x"))
    if args.client_rounds:
        report["client-round-s"] = client_round_times(sets, federated_modes, args.repeats,
                                                      args.config)
        base = report["client-round-s"]["none"]
        for name, t in report["client-round-s"].items():
            rows.append((f"client 0's round (local_update), {name if name != 'none' else 'no DP'}",
                         f"{t:.3f}", f"{t / base:.2f}x"))
    if not args.skip_federated:
        report["round-s"] = {}
        variants = {"none": ["--set", "dp=none"]}
        same = same_batch_sets(cfg, args.config, sets)
        if same:  # DP-SGD trains at settings of its own: plain SGD at them too
            variants[SAME_BATCH] = ["--set", "dp=none", *(a for s in same for a in ("--set", s))]
        for mode in federated_modes:
            variants[mode] = ["--set", "dp=local", "--set", "noise-multiplier=1.0",
                              "--set", f"grad-sample-mode={mode}"]
        common = (["--config", args.config] if args.config else []) + \
            [a for s in sets for a in ("--set", s)]
        rounds: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.federated_repeats):  # the variants take turns
            for name, extra in variants.items():
                print(f"fedpriv run {r + 1}/{args.federated_repeats}, dp {name} ...",
                      flush=True)
                with tempfile.TemporaryDirectory() as tmp:
                    res = bench_fedpriv(common + extra, Path(tmp), memory=False)
                rounds[name] += res["rounds-s"][1:]  # steady state: after the first round
        report["round-s"] = {name: statistics.median(ts) for name, ts in rounds.items()}
        base = report["round-s"]["none"]
        labels = {"none": "no DP", SAME_BATCH: f"no DP at DP-SGD's {', '.join(same)}"}
        for name, t in report["round-s"].items():
            rows.append((f"federated round (fedpriv), {labels.get(name, name)}",
                         f"{t:.3f}", f"{t / base:.2f}x"))
        if same:
            rows += [(f"federated round, {name} against no DP at the same settings", "",
                      f"{report['round-s'][name] / report['round-s'][SAME_BATCH]:.2f}x")
                     for name in federated_modes]
    print_table(rows)
    if args.accounting > 0:
        dp_sets = ["dp=local"] + ([] if any(s.startswith("noise-multiplier=") for s in sets)
                                  else ["noise-multiplier=1.0"])
        report["accounting"] = accounting_times(resolve(args.config, sets + dp_sets),
                                                args.accounting)
        print("\nthe epsilon after each round (one thread of this process; fedpriv's equal "
              "to dp-accounting's, checked)")
        print_table([("round", "steps", "epsilon (PLD)", "fedpriv (s)", "dp-accounting (s)",
                      "ratio", "epsilon (RDP)", "RDP (s)")] + [
            (str(a["round"]), str(a["steps"]), f"{a['epsilon']:.3f}", f"{a['fedpriv-s']:.4f}",
             f"{a['dp-accounting-s']:.4f}", f"{a['fedpriv-s'] / a['dp-accounting-s']:.2f}x",
             f"{a['rdp-epsilon']:.3f}", f"{a['rdp-s']:.4f}") for a in report["accounting"]])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
