#!/usr/bin/env bash
# The Debian packages fedpriv's optional data and its tests use, installed when missing:
#   dataset-fashion-mnist  Fashion-MNIST (60,000 + 10,000) for `dataset = "fashion-mnist"`
#                          without a data-dir (/usr/share/datasets/fashion-mnist)
# As root it installs them (apt-get update first; .ci/run does this); otherwise, or with
# --check, it only says what to run, and the tests that need them say they were skipped
# for that reason. Usage: scripts/system-packages.sh [--check]
set -euo pipefail
CHECK=${1:-}
PACKAGES=(dataset-fashion-mnist)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
  echo "note: optional data ${missing[*]} not installed (no apt-get here); fashion-mnist then needs" \
       "data-dir with torchvision's files, and the tests that need it are skipped." >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || [ "$CHECK" = --check ]; then
  echo "note: optional data not installed: ${missing[*]}. To add it, as root: apt-get update &&" \
       "apt-get install -y ${missing[*]} (or give fashion-mnist a data-dir with torchvision's" \
       "files); until then the tests that need it are skipped." >&2
  exit 0
fi
echo "installing Debian packages: ${missing[*]} ..."
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
         --no-install-recommends "${missing[@]}" >/dev/null; }; then
  echo "note: apt-get could not install ${missing[*]} (see above); the tests that need it" \
       "are skipped, and say so." >&2
fi
