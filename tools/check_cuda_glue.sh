#!/usr/bin/env bash
# CI: the CUDA glue (csrc/cuda/*.cpp, and ops.cpp's CUDA block) compiles against torch's
# headers, where torch is a CPU build: a syntax-only compile, no GPU needed.
#
#   bash tools/check_cuda_glue.sh          # after `make setup` (uses $VENV, default .venv)
#
# A CPU wheel ships c10/cuda's headers but not the header its CUDA build generates
# (c10/cuda/impl/cuda_cmake_macros.h); a stub stands in for it. The .cu files are
# compiled by nvcc in .ci/run; this covers what includes torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
CUDA_INCLUDE=${CUDA_HOME:-/usr/local/cuda}/include
if [ ! -f "$CUDA_INCLUDE/cuda_runtime_api.h" ]; then
    echo "check_cuda_glue: SKIPPING: no CUDA headers in $CUDA_INCLUDE (set CUDA_HOME)"
    exit 0
fi
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
mkdir -p "$stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
includes=$("$PY" -c "
import sysconfig
from torch.utils.cpp_extension import include_paths
print(' '.join('-I' + p for p in include_paths() + [sysconfig.get_paths()['include']]))")
for src in csrc/cuda/*.cpp csrc/ops.cpp; do
    echo "check_cuda_glue: g++ -fsyntax-only -DMINDDP_WITH_CUDA $src"
    # shellcheck disable=SC2086
    "${CXX:-g++}" -std=c++20 -fsyntax-only -DMINDDP_WITH_CUDA -I"$stub" $includes \
        -I"$CUDA_INCLUDE" "$src"
done
