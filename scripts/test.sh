#!/usr/bin/env bash
# The test suite: set up ./.venv with the dev tools if needed, lint, then run every test,
# including the end-to-end runs of the real Flower simulation runtime (marked slow).
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not slow". Tests run in
# FEDPRIV_TEST_WORKERS pytest-xdist workers (default 3: the end-to-end runs spend much of
# their time waiting on process start-up and polling; -n 0 runs them one by one),
# handed out two at a time so that the end-to-end runs, collected first, spread over all
# workers instead of queueing on one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -n "${FEDPRIV_TEST_WORKERS:-3}" --dist load --maxschedchunk 2 "$@"
