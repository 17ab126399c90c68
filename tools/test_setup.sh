#!/usr/bin/env bash
# Installs what `make test` needs when it is missing, as `make demo` does for the trainer, so the
# README's test command works on a fresh machine. .ci/run calls it too: the one list of what the
# project needs.
#   Debian packages (apt-get, as root): the build, the trainers' data, MPI, clang (the fuzz
#     targets), gnuplot, Debian's python3 with torch 1.13 and its headers (the backend for 1.13).
#   PyPI (pip, into the python3 on PATH when it is not Debian's own): torch==2.13.0 (always
#     pinned with ==: a bare or ranged torch makes pip fetch a CUDA build of several GB), numpy,
#     pytest, expecttest (torch.testing imports it: torch's distributed suite, tests/torch_suite/),
#     pytorch-lightning and deepspeed (python/tests/test_torch2_lightning.py, _deepspeed.py),
#     pinned, in the same pip command as torch so that pip never swaps torch for a CUDA build.
#   expecttest also for Debian's python3 (no Debian package has it; pip --break-system-packages,
#     as root, puts it in /usr/local).
# Not root, or offline: it says what is missing and how to install it, and returns 0; the tests
# that need a missing package skip and say why. DDP_SETUP=0 skips this script.
set -u
tag=test-setup

DEBIAN_PACKAGES="build-essential cmake pkg-config zlib1g-dev libopenblas-dev dataset-fashion-mnist
  libopenmpi-dev openmpi-bin iproute2 clang libclang-rt-14-dev gnuplot-nox python3-torch libtorch-dev
  pybind11-dev python3-dev python3-numpy python3-pytest python3-venv python3-pip fortunes"
TORCH_PIN="torch==2.13.0"
LIGHTNING_PIN="pytorch-lightning==2.6.6"
DEEPSPEED_PIN="deepspeed==0.19.8"
PYPI_PACKAGES="$TORCH_PIN numpy pytest expecttest $LIGHTNING_PIN $DEEPSPEED_PIN"

[ "${DDP_SETUP:-1}" = 0 ] && exit 0

root=0
[ "$(id -u)" = 0 ] && root=1

missing=""
if command -v dpkg-query >/dev/null 2>&1; then
    for p in $DEBIAN_PACKAGES; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
            missing="$missing $p"
    done
else
    echo "$tag: not a Debian-like system (no dpkg-query); the tests want: $DEBIAN_PACKAGES" >&2
fi
if [ -n "$missing" ]; then
    if [ $root = 1 ]; then
        echo "$tag: installing Debian packages:$missing"
        export DEBIAN_FRONTEND=noninteractive
        if ! { apt-get update -q && apt-get install -y -q --no-install-recommends $missing; }; then
            echo "$tag: apt-get failed; the tests that need these skip:$missing" >&2
        fi
    else
        echo "$tag: missing Debian packages:$missing" >&2
        echo "$tag: install them with: sudo apt-get update && sudo apt-get install -y$missing" >&2
        echo "$tag: the tests that need them skip" >&2
    fi
fi

# The python3 on PATH gets torch 2.x from PyPI; Debian's own /usr/bin/python3 has torch 1.13
# from python3-torch above and refuses pip (externally managed).
py=$(command -v python3 || true)
if [ -n "$py" ] && [ "$(readlink -f "$py")" != "$(readlink -f /usr/bin/python3 2>/dev/null)" ] &&
    "$py" -m pip --version >/dev/null 2>&1; then
    want=""
    # Any torch already there is kept (the backend builds against it); only none is installed.
    "$py" -c "import torch" 2>/dev/null || want="$want $TORCH_PIN"
    "$py" -c "import numpy" 2>/dev/null || want="$want numpy"
    "$py" -c "import pytest" 2>/dev/null || want="$want pytest"
    "$py" -c "import expecttest" 2>/dev/null || want="$want expecttest"
    "$py" -c "import pytorch_lightning" 2>/dev/null || want="$want $LIGHTNING_PIN"
    DS_ACCELERATOR=cpu "$py" -c "import deepspeed" 2>/dev/null || want="$want $DEEPSPEED_PIN"
    if [ -n "$want" ]; then
        # pip installs into this interpreter's own prefix; as root into a root-owned prefix,
        # otherwise where the user can write (a venv, pyenv).
        if [ $root = 1 ] || [ -w "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" ]; then
            echo "$tag: installing from PyPI for $py:$want"
            # One command, torch pinned: pip then never swaps in another torch for the others.
            "$py" -m pip install -q $PYPI_PACKAGES ||
                echo "$tag: pip failed; the tests that need$want skip" >&2
        else
            echo "$tag: $py lacks$want; install with: $py -m pip install $PYPI_PACKAGES" >&2
        fi
    fi
fi
# Debian's python3 (torch 1.13) for torch's distributed suite: expecttest only, from PyPI.
if [ -x /usr/bin/python3 ] && /usr/bin/python3 -c "import torch" 2>/dev/null &&
    ! /usr/bin/python3 -c "import expecttest" 2>/dev/null; then
    if [ $root = 1 ] && /usr/bin/python3 -m pip --version >/dev/null 2>&1; then
        echo "$tag: installing expecttest from PyPI for /usr/bin/python3"
        /usr/bin/python3 -m pip install -q --break-system-packages expecttest ||
            echo "$tag: pip failed; the torch 1.13 suite selection is not registered" >&2
    else
        echo "$tag: /usr/bin/python3 lacks expecttest (torch 1.13's suite selection is not" \
             "registered); as root: /usr/bin/python3 -m pip install --break-system-packages" \
             "expecttest" >&2
    fi
fi
exit 0
