#!/usr/bin/env bash
# Set up everything mountfs needs on a fresh Debian/Ubuntu machine (run as root):
# the FUSE 3 system packages, then a virtualenv at .venv with mountfs and its test tools.
# Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(fuse3 libfuse3-dev pkg-config gcc attr util-linux iproute2 rsync strace)
missing=()
for p in "${packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing system packages: ${missing[*]}"
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: need root to install ${missing[*]} (apt-get)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PYTHON" -m venv .venv
fi
echo "setup: installing mountfs into .venv"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# An editable install leaves the source uncompiled. Compiled now, every command starts from
# bytecode even where writing it is off (PYTHONDONTWRITEBYTECODE, set in many container
# images), which would have each start compile every module it loads again. Timestamp
# checked, as an import writes them, also where SOURCE_DATE_EPOCH would make them hashed;
# errors (a syntax error) are shown, and stop the setup.
PYTHONDONTWRITEBYTECODE= .venv/bin/python -m compileall -q --invalidation-mode timestamp \
    mountfs replicator daemon cmdline
echo "setup: done (.venv/bin/mountfs, .venv/bin/snapctl)"
