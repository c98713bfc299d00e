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
