#!/usr/bin/env bash
# Create the project's virtual environment in $1 and install minddp into it.
#
# Where `python3` can already import torch (the GPU machine: torch with CUDA,
# no network), the venv reuses that torch through a .pth file and installs
# offline, without the framework packages (their tests skip, saying so).
# Elsewhere it installs the CPU build torch==2.13.0+cpu (a wheel on the machine's
# disk) and the test/bench dependencies from PyPI, among them the frameworks
# minddp is tested inside (tests/test_frameworks.py), pinned to versions that
# work with torch 2.13. They go in the same pip command as torch, so pip never
# swaps the CPU torch for a CUDA build to satisfy them (a dry run resolves no
# nvidia-* or triton package). Nothing here may pull a CUDA build of torch.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
RUFF_VERSION=0.17.6  # the version pyproject.toml's [tool.ruff] settings were checked with
site_packages() { "$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }

if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "make_venv: reusing the torch that $PYTHON imports (offline install)"
    "$PYTHON" -m venv --without-pip "$VENV" 2>/dev/null || "$PYTHON" -m venv "$VENV"
    "$PYTHON" -c "import site, sys; print('\n'.join(p for p in sys.path if p.endswith('-packages')))" \
        > "$(site_packages)/_minddp_parent.pth"
    "$VENV/bin/python" -m pip install --no-build-isolation --no-deps --no-index -e . 
else
    echo "make_venv: installing torch==2.13.0+cpu and test dependencies"
    "$PYTHON" -m venv "$VENV"
    # The local version "+cpu" pins the CPU build: where pip knows no such wheel (plain
    # PyPI) it stops with an error instead of taking the CUDA build; README says what to set.
    "$VENV/bin/python" -m pip install -q torch==2.13.0+cpu numpy matplotlib pytest pytest-xdist expecttest ninja setuptools wheel \
        lightning==2.6.6 accelerate==1.15.0 transformers==5.24.0
    "$VENV/bin/python" -m pip install --no-build-isolation --no-deps -e .
fi
# The benchmarks and examples import their shared code (`from benchmarks.measure import ...`)
# from this checkout, which setup.py does not install: the venv gets it on its path instead.
pwd -P > "$(site_packages)/_minddp_checkout.pth"
# ruff for `make lint`, pinned so that the machines that install it lint alike (one the venv
# already reaches, the parent's, is used as it is). Optional: where pip cannot reach PyPI
# (the offline GPU machine) the venv is made without it and only `make lint` fails.
if "$VENV/bin/python" -m ruff --version >/dev/null 2>&1; then
    echo "make_venv: ruff: $("$VENV/bin/python" -m ruff --version)"
elif ! "$VENV/bin/python" -m pip install -q --retries 1 --timeout 10 "ruff==$RUFF_VERSION"; then
    echo "make_venv: SKIPPING ruff (pip could not install ruff==$RUFF_VERSION, offline?):" \
         "the venv works without it, make lint does not"
fi
"$VENV/bin/python" -c "import benchmarks, examples, minddp, torch
print('make_venv: minddp ready with torch', torch.__version__)"
