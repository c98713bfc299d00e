"""Benchmark: what the leakage study costs.

1. The attacks, in one process, at the default settings (2,000 iterations x 2
   restarts): Inverting Gradients and DLG on a one-image update of the untrained small
   CNN, Inverting Gradients on an 8-image update; each against the plain-PyTorch cost
   of the client's own local step on the same data (the baseline), as a ratio.
   Threads: the machine's (``--threads`` to change); the attacks use the GPU when
   ``--device cuda`` is given and one is present.
2. Observation, through fedpriv (Flower + Ray): the steady round time of the rounds
   that are *not* observed, with leakage off and with ``leakage-rounds = 1`` (client 0
   observed in round 1 only), so the hook's cost on other rounds shows.

    python -m experiments.benchmarks.leakage
    python -m experiments.benchmarks.leakage --skip-runs     # attacks only
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from flwr.app import Context, RecordDict

from clients.update import Client, local_update, training_data
from experiments.benchmarks.fedavg_overhead import bench_fedpriv, print_table
from privacy.attacks.inversion import InversionConfig, dlg, invert
from privacy.attacks.observation import LocalTraining
from tasks.config import validate
from tasks.splits import client_split, dataset_for, model_for
from tasks.training import make_loader, sgd, train_epochs

RUN_SET = ["num-clients=5", "num-server-rounds=5", "local-epochs=1"]


def _update(examples: int, device: torch.device):
    """Client 0's real update (fedpriv's local step) on ``examples`` images, its data,
    and the plain-PyTorch seconds of that local step."""
    cfg = validate({"leakage-rounds": "1", "observed-examples": examples,
                    "batch-size": examples})
    client = Client(cfg, 0, 10, client_split(cfg, 0, 10))
    ctx = Context(run_id=1, node_id=1, state=RecordDict(), run_config={},
                  node_config={"partition-id": 0, "num-partitions": 10})
    torch.manual_seed(0)
    model, _ = model_for(cfg)
    sent = {k: v.clone() for k, v in model.state_dict().items()}
    new, _ = local_update(client, ctx, sent, {"server-round": 1})
    x, y, _ = training_data(client, ctx)
    plain = []
    for r in range(6):  # the baseline: the client's own step, plain PyTorch
        torch.manual_seed(r)
        m, _ = model_for(cfg)
        t0 = time.perf_counter()
        train_epochs(m, make_loader(x, y, examples, r), sgd(m, cfg.training.lr), 1, device)
        plain.append(time.perf_counter() - t0)
    t = cfg.training
    training = LocalTraining(t.lr, t.momentum, t.weight_decay, t.local_epochs, t.batch_size)
    update = {k: (new[k] - sent[k]).to(device) for k in sent}
    sent = {k: v.to(device) for k, v in sent.items()}
    return cfg, model.to(device), sent, update, x.to(device), y.to(device), training, \
        statistics.median(plain[1:])


def bench_attacks(device: torch.device) -> list[tuple[str, ...]]:
    rows = [("attack", "update", "seconds", "client step (s)", "ratio")]
    data = None
    for examples in (1, 8):
        cfg, model, sent, update, x, y, training, step = _update(examples, device)
        data = data or dataset_for(cfg)
        t0 = time.perf_counter()
        invert(model, sent, update, torch.sort(y).values, training, tuple(x.shape[1:]),
               InversionConfig(2000, 2, 0.1, 0.01, 0), mean=data.mean, std=data.std)
        s = time.perf_counter() - t0
        rows.append(("Inverting Gradients 2000x2", f"{examples} image(s), 1 step", f"{s:.1f}",
                     f"{step:.4f}", f"{s / step:,.0f}x"))
        if examples == 1:
            t0 = time.perf_counter()
            dlg(model, sent, update, 1, data.num_classes, training, tuple(x.shape[1:]),
                iterations=300, restarts=2)
            s = time.perf_counter() - t0
            rows.append(("DLG 300x2 (L-BFGS)", "1 image, 1 step", f"{s:.1f}", f"{step:.4f}",
                         f"{s / step:,.0f}x"))
    return rows


def bench_observation(repeats: int) -> list[tuple[str, ...]]:
    rows = [("leakage", "unobserved rounds: median round s", "runs")]
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in (("off", []), ("rounds 1 (client 0)",
                                           ["leakage-rounds=1", "attacks=labels"])):
            times = []
            for i in range(repeats):
                out = Path(tmp) / f"{label[:3]}-{i}"
                out.mkdir()
                res = bench_fedpriv([a for kv in RUN_SET + extra for a in ("--set", kv)], out)
                times += res["rounds-s"][1:]  # rounds 2..5: never observed
            rows.append((label, f"{statistics.median(times):.3f}", str(repeats)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per observation setting")
    parser.add_argument("--skip-runs", action="store_true", help="attacks only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device == "cpu" or torch.cuda.is_available()
                          else "cpu")
    print(f"attacks on {device} ({torch.get_num_threads()} threads)")
    print_table(bench_attacks(device))
    if not args.skip_runs:
        print_table(bench_observation(args.repeats))


if __name__ == "__main__":
    main()
