"""The baseline: FedAvg as a plain single-process PyTorch loop doing exactly fedpriv's SGD work.

Same data, partitions, model init, per-client seeds, optimizer and central evaluation
as a `fedpriv run` with the same config, without Flower, Ray or any messaging. Prints
one JSON line with per-round times and test accuracies.

    python -m experiments.benchmarks.plain_fedavg --set num-clients=10 --set num-server-rounds=5
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
import torch

from experiments.configs import resolve
from privacy.dp.accounting import clients_per_round
from tasks.allocator import keep_freed_memory
from tasks.config import RunConfig
from tasks.seeding import derive_seed, sample_cohort, sampling_rng
from tasks.splits import client_split, heldout_split, model_for
from tasks.training import (
    client_optimizer,
    convolutions_channels_last,
    evaluate,
    make_loader,
    resolve_device,
    train_epochs,
)


def plain_fedavg(cfg: RunConfig, threads: int | None = None) -> dict:
    """Run FedAvg for ``cfg`` in this process; return timings and accuracies."""
    t0 = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    keep_freed_memory()  # as fedpriv's processes: the floor allocates alike
    fed, t = cfg.federation, cfg.training
    seed = t.seed
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    test = heldout_split(cfg)
    device = resolve_device(cfg.resources.device)
    model, _ = model_for(cfg)
    n = fed.num_clients
    per_round = clients_per_round(n, fed.fraction_train, fed.min_train_clients)
    setup_s = time.perf_counter() - t0
    rounds = []
    for rnd in range(1, fed.num_server_rounds + 1):
        start = time.perf_counter()
        # the same rule as fedpriv's rounds (tasks.seeding), over partition ids
        chosen = sorted(sample_cohort(range(n), sampling_rng(seed, rnd), per_round))
        global_state = {k: v.clone() for k, v in model.state_dict().items()}
        updates = []
        for pid in chosen:
            split = client_split(cfg, pid, n)
            client_seed = derive_seed(seed, rnd, pid)
            torch.manual_seed(client_seed)
            model.load_state_dict(global_state)
            opt = client_optimizer(convolutions_channels_last(model, device), t)
            train_epochs(model, make_loader(split.x, split.y, t.batch_size, client_seed), opt,
                         t.local_epochs, device, max_steps=t.local_steps)
            updates.append((len(split), {k: v.detach().cpu().numpy().copy()
                                         for k, v in model.state_dict().items()}))
        # Example-weighted mean in float32, in partition order: Flower's FedAvg arithmetic.
        total = sum(w for w, _ in updates)
        mean: dict[str, np.ndarray] = {}
        for w, state in updates:
            for k, v in state.items():
                mean[k] = v * (w / total) if k not in mean else mean[k] + v * (w / total)
        model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in mean.items()})
        convolutions_channels_last(model, device)  # as the server evaluates it
        loss, acc = evaluate(model, test.x, test.y, t.eval_batch_size, device)
        rounds.append({"round": rnd, "round-s": time.perf_counter() - start, "accuracy": acc,
                       "loss": loss})
    return {"setup-s": setup_s, "total-s": time.perf_counter() - t0, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="preset")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    print(json.dumps(plain_fedavg(resolve(args.config, args.set), args.threads)))


if __name__ == "__main__":
    main()
