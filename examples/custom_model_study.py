"""A model of your own in a study: ``tiny-mlp`` (examples/custom_model.py) against the
built-in ``small-cnn`` on the same federation, accuracy round by round.

From the repository root::

    python examples/custom_model_study.py --rounds 5

The model is a plugin: the ``plugins`` key makes every fedpriv process (the pre-flight
check, the ServerApp, every ClientApp) import ``examples.custom_model``, which registers
``tiny-mlp`` (docs/EXTENDING.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# the repository root first, here and in every process fedpriv starts: they must find
# this examples package, not the one Opacus installs under the same name
ROOT = str(Path(__file__).resolve().parent.parent)
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                           if p)

import fedpriv  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args()
    common = {"num_server_rounds": args.rounds, "num_clients": args.clients,
              "results_dir": args.results_dir, "echo": None}
    mine = fedpriv.run(plugins="examples.custom_model", model="tiny-mlp", **common)
    builtin = fedpriv.run(model="small-cnn", **common)
    both = fedpriv.concat([mine, builtin])
    print(both.pivot(index="round", columns="model", values="test_accuracy").round(4))
    print(f"parameters: tiny-mlp {mine.info.get('parameters'):,}, small-cnn "
          f"{builtin.info.get('parameters'):,}")


if __name__ == "__main__":
    main()
