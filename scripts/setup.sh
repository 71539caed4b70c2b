#!/usr/bin/env bash
# One-time set-up on a Debian machine: the system packages the tests and the
# demo use, a virtualenv in .venv, PyTorch (CPU build, installed first so that
# nothing resolves a multi-GB CUDA build), and this project with its dev extras.
# Safe to run again: what is already there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

apt_packages=()
"$PY" -c "import venv, ensurepip" 2>/dev/null || apt_packages+=(python3-venv python3-pip)
command -v mount >/dev/null || apt_packages+=(mount)
# Real servers the tests start: etcd for multi-node rendezvous, openssl for its TLS test.
command -v etcd >/dev/null || apt_packages+=(etcd-server)
command -v openssl >/dev/null || apt_packages+=(openssl)
# Prometheus (with promtool) and Alertmanager (with amtool) for the metrics, alert and dashboard tests.
command -v prometheus >/dev/null || apt_packages+=(prometheus)
command -v prometheus-alertmanager >/dev/null || apt_packages+=(prometheus-alertmanager)
if ((${#apt_packages[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}"
fi

# --system-site-packages reuses a torch that the machine already has.
[ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
