"""A privacy-utility trade-off study: local DP-SGD at several epsilons against no DP.

From the repository root::

    python examples/dp_tradeoff.py                       # epsilon 1, 5, 10 and no DP, 10 rounds
    python examples/dp_tradeoff.py --epsilons 2 8 --rounds 5

Every setting runs as one cell of a sweep given from Python (``fedpriv.sweep``), in one
simulation; the script prints each cell's final accuracy and the epsilon it spent, and
draws accuracy against epsilon (``tradeoff.png`` in the sweep's folder). Epsilon is per
client and per record (record-level DP, add/remove one record), as docs/PRIVACY.md states.
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import fedpriv  # noqa: E402

# DP-SGD wants larger batches, tighter clipping and a larger step than plain SGD here
# (the settings of the bundled dp-epsilon-mnist sweep)
DP_SGD = {"batch_size": 64, "max_grad_norm": 0.5, "lr": 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 5.0, 10.0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args()

    study = fedpriv.sweep(
        grid={"target_epsilon": args.epsilons},
        fixed={"dp": "local", **DP_SGD, "num_server_rounds": args.rounds,
               "num_clients": args.clients, "results_dir": args.results_dir},
        cells=[{"dp": "none", "batch_size": 32, "lr": 0.05}],
        name="dp-tradeoff")
    rounds = study.frame()
    final = rounds[rounds["round"] == rounds["round"].max()]
    table = final[["cell", "dp", "target_epsilon", "epsilon", "test_accuracy"]]
    print(table.to_string(index=False))

    private = final[final["dp"] == "local"].sort_values("epsilon")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(private["epsilon"], private["test_accuracy"], "o-", label="local DP-SGD")
    for none in final[final["dp"] == "none"]["test_accuracy"]:
        ax.axhline(none, color="gray", ls="--", label="no DP")
    ax.set(xlabel="epsilon spent (per client, delta = 1/(10 n))", ylabel="test accuracy",
           title=f"Privacy-utility trade-off ({args.clients} clients, {args.rounds} rounds)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(study.folder / "tradeoff.png", dpi=150)
    print(f"plot: {study.folder / 'tradeoff.png'}")


if __name__ == "__main__":
    main()
