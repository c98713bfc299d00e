#!/usr/bin/env bash
# The main job: set up ./.venv if needed, then `fedpriv run` (10 simulated clients on the
# embedded MNIST, FedAvg, 10 rounds). Extra arguments go to `fedpriv run`, e.g. --set num-clients=20.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fedpriv run "$@"
