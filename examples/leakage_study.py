"""A leakage study of one defence: what an honest-but-curious server learns from a
client's update with and without it.

From the repository root::

    python examples/leakage_study.py --defence dp-local
    python examples/leakage_study.py --defence secagg --attacks labels,invert,mia

The server keeps what it holds of an observed client (``leakage-rounds``); after the run
the attacks read those observations and are scored against the client's real records,
which the attacker never sees (docs/LEAKAGE.md). Each defence names the adversary it
stands against; the table says what each attack still achieved.
"""

from __future__ import annotations

import argparse

import pandas as pd

import fedpriv

# defence -> (the settings without it, the settings with it)
DEFENCES = {
    # record-level DP-SGD on every client, against the server and everyone downstream
    "dp-local": ({"dp": "none"}, {"dp": "local", "target_epsilon": 5.0}),
    # SecAgg+: an honest-but-curious server sees only the sum of the cohort's updates
    "secagg": ({"secure_aggregation": "off"},
               {"secure_aggregation": "secagg+", "leakage_clients": "aggregate"}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--defence", choices=sorted(DEFENCES), default="dp-local")
    parser.add_argument("--attacks", default="labels,mia",
                        help="attacks to run (invert adds image reconstruction, minutes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args()

    without, with_it = DEFENCES[args.defence]
    study = fedpriv.sweep(
        cells=[without, with_it],
        fixed={"num_clients": args.clients, "num_server_rounds": args.rounds,
               "leakage_rounds": str(args.rounds), "attacks": args.attacks,
               "results_dir": args.results_dir},
        name=f"leakage-{args.defence}")
    rows = []
    for cell in study.cells:
        run = study.runs.get(cell["index"])
        scores = (run.leakage or {}) if run else {}
        row = {"defence": "on" if cell["index"] == 2 else "off",
               "accuracy": run.accuracy if run else None}
        for attack, values in scores.items():
            if isinstance(values, dict):
                row.update({f"{attack} {k}": v for k, v in values.items()})
        rows.append(row)
    print(pd.DataFrame(rows).to_string(index=False))
    print(f"details: {study.folder / 'sweep.md'} and each cell's summary.md")


if __name__ == "__main__":
    main()
