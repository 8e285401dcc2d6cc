#!/usr/bin/env bash
# make gpu-check: everything a session with a GPU must verify, in one command.
#
#   make gpu-check                                  # log in results/gpu-check.log
#   make gpu-check GPU_CHECK_LOG=$OUT/gpu-check.log # the log somewhere else, written as it goes
#   make gpu-check GPU_CHECK_COMMIT=<hash>          # where the copy has no .git to ask
#   make gpu-check GPU_CHECK_PACK=$OUT/results.tgz  # also the outputs' .json files, packed
#                                                   # (small enough to come back from a device
#                                                   # machine: no checkpoints or plots)
#
# Steps, each with a header, a time limit and a PASS/FAIL line, then a summary:
#   1    build minddp._C as `make setup` does; torch.ops.minddp.compress must
#        have a CUDA kernel (an existing build without one is rebuilt once,
#        verbosely, so the log shows why)
#   2    tools/check_int8_division.cu (every int8 quotient decompress computes without a
#        division, bit for bit), then the CUDA cases of tests/test_compression_ops.py
#   3    tests/test_gpu.py (2 ranks over gloo on one GPU, 1 rank over NCCL)
#        and tests/test_train.py's AMP test
#   4a-e compare.py --device cuda on 2 ranks (gloo, 12 steps: where auto and the backend's
#        all-reduce part, 6 gave intervals too wide to say) and 1 rank (NCCL, 6 steps),
#        kernels.py --device cuda, train.py --amp on 2 ranks and on 1
#   4f   short steps on 1 NCCL rank: compare.py narrow and transformer (30 steps),
#        overhead.py (where the wrapper's time goes)
#   4g   benchmarks/compress_variants.cu: the compress kernels against candidates
#        (fails only if their outputs differ)
# A pytest step fails if anything in it is skipped: on a GPU machine nothing
# may be. After a failed step the others still run (a GPU session is short:
# it should report all it can), unless step 1 left no virtual environment.
# All steps share GPU_CHECK_BUDGET seconds (default 480; a passing run should
# take about 5 minutes on one H100, an estimate not yet measured), so the run
# ends, summary included, within the device's 10-minute limit per command even
# when something hangs: a step over its limit or the budget fails.
#
# Exit status: 0 every step passed, 1 some step failed, 2 no CUDA device here
# (said at once; nothing is built or run, and no log is written).
set -uo pipefail
cd "$(dirname "$0")/.."

SELF=tools/gpu_check.sh
export VENV=${VENV:-.venv}
export PY=$VENV/bin/python
export RESULTS=${GPU_CHECK_RESULTS:-results/gpu-check}  # benchmark outputs
PYTHON=${PYTHON:-python3}  # what tools/make_venv.sh builds the venv from
LOG=${GPU_CHECK_LOG:-results/gpu-check.log}
PACK=${GPU_CHECK_PACK:-}
BUDGET=${GPU_CHECK_BUDGET:-480}

# -- the steps (each runs as `bash tools/gpu_check.sh --step NAME ARGS`, under timeout) ------

# Whether the built extension serves CUDA tensors, and bit for bit like the reference.
check_cuda_kernels() {
    "$PY" - <<'EOF'
import sys

import torch
from torch.utils.cpp_extension import CUDA_HOME

print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) from {torch.__file__}; "
      f"CUDA_HOME {CUDA_HOME}")
try:
    import minddp._C as ext
except ImportError as e:
    sys.exit(f"gpu-check: minddp._C does not import ({e}): the build failed or was skipped")
print(f"minddp._C: {ext.__file__}")
if not torch._C._dispatch_has_kernel_for_dispatch_key("minddp::compress", "CUDA"):
    sys.exit("gpu-check: minddp._C has NO CUDA kernels: the build fell back to CPU-only. "
             "setup.py compiles csrc/cuda only where torch.cuda.is_available(), torch.version.cuda "
             "and CUDA_HOME (nvcc) are all there, and skips a failed compile with a WARNING "
             "(see the build output above)")
from minddp.compression import reference

x = torch.randn(1 << 20, device="cuda") * 1e3
for dtype in (torch.float16, torch.int8):
    packed, scale = torch.ops.minddp.compress(x, dtype)
    want_packed, want_scale = reference.compress(x, dtype)
    if not (packed.is_cuda and torch.equal(scale, want_scale) and torch.equal(packed, want_packed)):
        sys.exit(f"gpu-check: torch.ops.minddp.compress to {dtype} on CUDA differs from the "
                 f"pure-torch reference")
print(f"torch.ops.minddp.compress has a CUDA kernel on {torch.cuda.get_device_name()}, "
      f"bitwise equal to the reference on 1M elements (fp16 and int8)")
EOF
}

step_build() {
    "${MAKE:-make}" --no-print-directory setup VENV="$VENV" || return 1
    check_cuda_kernels && return 0
    # The stamp may predate this machine (a CPU-only build): rebuild, showing
    # the compiler's output that pip otherwise hides.
    echo "gpu-check: rebuilding minddp._C with pip -v (make_venv.sh's install command)"
    "$PY" -m pip install -v --no-build-isolation --no-deps --no-index -e . || return 1
    check_cuda_kernels
}

# pytest that also fails when anything was skipped (a skip on a GPU machine hides a failure).
pytest_nothing_skipped() {
    local out rc
    out=$(mktemp)
    "$PY" -m pytest -p no:cacheprovider "$@" 2>&1 | tee "$out"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ] && tail -n 1 "$out" | grep -q "skipped"; then
        echo "gpu-check: tests were skipped on a machine with CUDA (reasons above)"
        rc=1
    fi
    rm -f "$out"
    return "$rc"
}

# A standalone CUDA program (no torch), built with torch's nvcc for this GPU, then run.
run_cuda_program() {
    local home nvcc dir rc
    home=$("$PY" -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or '')")
    nvcc=${home:+$home/bin/nvcc}
    nvcc=${nvcc:-$(command -v nvcc)}
    if [ -z "$nvcc" ]; then
        echo "gpu-check: no nvcc (torch finds no CUDA_HOME, and none is on PATH)"
        return 1
    fi
    dir=$(mktemp -d)
    "$nvcc" -O3 -std=c++17 -arch=native "$1" -o "$dir/program" && "$dir/program"
    rc=$?
    rm -rf "$dir"
    return "$rc"
}

step_kernel_tests() {
    run_cuda_program tools/check_int8_division.cu || return 1
    pytest_nothing_skipped tests/test_compression_ops.py -k cuda
}

step_gpu_tests() {
    pytest_nothing_skipped tests/test_gpu.py tests/test_train.py::test_amp_on_cuda
}

# compare.py on `ranks` ranks; init_distributed picks the backend (NCCL when
# every rank has a GPU of its own, else gloo), checked against `backend`.
step_compare() {
    local ranks=$1 backend=$2 steps=$3 out="$RESULTS/compare-$1rank-$2" printed rc
    printed=$(mktemp)
    "$PY" -m torch.distributed.run --standalone --nproc_per_node="$ranks" benchmarks/compare.py \
        --device cuda --steps "$steps" --warmup 2 --out "$out" 2>&1 | tee "$printed"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ] && ! grep -q "backend $backend" "$printed"; then
        echo "gpu-check: compare.py did not run on $backend (its first line names the backend)"
        rc=1
    fi
    rm -f "$printed"
    [ "$rc" -eq 0 ] || return "$rc"
    "$PY" - "$out/compare.json" <<'EOF'
import json
import math
import sys

with open(sys.argv[1]) as f:
    data = json.load(f)
rows = data["rows"]
absent = [r for r in rows if r.get("absent")]
measured = [r for r in rows if not r.get("absent")]
broken = [r["name"] for r in measured if not math.isfinite(r.get("step_ms", math.nan))]
for r in absent:
    print(f"gpu-check: note: {r['workload']}/{r['name']} absent: {r['absent']}")
if not data["meta"]["device"].startswith("cuda"):
    sys.exit(f"gpu-check: compare.json says device {data['meta']['device']}, not cuda")
if broken or not any(r["name"].startswith("minddp") for r in measured):
    sys.exit(f"gpu-check: compare.json has rows without a step time ({broken}) or no minddp row")
print(f"gpu-check: {sys.argv[1]}: {len(measured)} rows measured on {data['meta']['device']}")
EOF
}

# Short steps on one NCCL rank (many small parameters, and the transformer), with enough steps
# for a usable interval, then where the wrapper's time goes (benchmarks/overhead.py).
step_short_steps() {
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/compare.py \
        --device cuda --workloads narrow,transformer --steps 30 --warmup 5 \
        --configs torch_ddp,torch_ddp_batched,minddp_native,minddp_auto \
        --out "$RESULTS/short-steps-1rank-nccl" &&
        "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/overhead.py \
            --device cuda --steps 200 --out "$RESULTS/overhead-1rank-nccl"
}

step_compress_candidate() {
    run_cuda_program benchmarks/compress_variants.cu
}

step_kernels_bench() {
    mkdir -p "$RESULTS"
    "$PY" benchmarks/kernels.py --device cuda --json "$RESULTS/kernels.json" &&
        "$PY" benchmarks/kernels.py --device cuda --dtype int8 --json "$RESULTS/kernels_int8.json"
}

# train.py --amp, briefly: 1 rank runs as a plain script (a world of one, NCCL).
step_train() {
    local ranks=$1 backend=$2 out="$RESULTS/train-amp-$1rank-$2"
    local args=(examples/train.py --amp --device cuda --samples 128 --val-samples 32
                --epochs 1 --out "$out")
    if [ "$ranks" -eq 1 ]; then
        "$PY" "${args[@]}" || return 1
    else
        "$PY" -m torch.distributed.run --standalone --nproc_per_node="$ranks" "${args[@]}" ||
            return 1
    fi
    "$PY" - "$out/history.json" <<'EOF'
import json
import math
import sys

with open(sys.argv[1]) as f:
    history = json.load(f)
losses = [s["loss"] for s in history["train"]] + [v["loss"] for v in history["val"]]
if not losses or not all(math.isfinite(x) for x in losses):
    sys.exit(f"gpu-check: {sys.argv[1]}: losses missing or not finite: {losses}")
print(f"gpu-check: {history['label']}: {len(history['train'])} steps, final val loss "
      f"{history['val'][-1]['loss']:.4f}")
EOF
}

if [ "${1:-}" = "--step" ]; then
    shift
    "step_$1" "${@:2}"
    exit $?
fi

# -- no CUDA: say so at once ------------------------------------------------------------

has_cuda() {
    "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
}

describe_torch() {
    "$1" -c "import torch; print(f'torch {torch.__version__}, built with CUDA \
{torch.version.cuda}, {torch.cuda.device_count()} CUDA devices visible')" 2>/dev/null ||
        echo "no importable torch"
}

if [ -x "$PY" ] && has_cuda "$PY"; then
    :
elif has_cuda "$PYTHON"; then
    if [ -x "$PY" ]; then
        echo "gpu-check: $PYTHON sees a CUDA device but $VENV's torch does not" \
             "($(describe_torch "$PY"))."
        echo "gpu-check: $VENV was made elsewhere or holds a CPU build of torch;" \
             "remove it (make clean) and rerun."
        exit 1
    fi
else
    probed=$([ -x "$PY" ] && echo "$PY" || echo "$PYTHON")
    gpus=$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | head -n 2) ||
            echo "no nvidia-smi")
    echo "gpu-check: NO CUDA DEVICE here ($probed: $(describe_torch "$probed"); $gpus)."
    echo "gpu-check: this check needs a machine with an NVIDIA GPU and a CUDA build of torch;" \
         "nothing was run."
    exit 2
fi

# -- the run ----------------------------------------------------------------------------

SUMMARY=()
FAILED=()

run_step() {  # id, title, time limit (s), step name and its arguments
    local id=$1 title=$2 limit=$3 left verdict note="" start rc
    shift 3
    left=$((BUDGET - SECONDS))
    echo
    echo "=== step $id: $title"
    if [ "$id" != 1 ] && [ ! -x "$PY" ]; then
        verdict=FAIL note=" (not run: step 1 left no $VENV)"
    elif [ "$left" -lt 20 ]; then
        verdict=FAIL note=" (not run: the ${BUDGET}s budget is spent)"
    else
        [ "$limit" -gt "$left" ] && limit=$left
        echo "=== limit ${limit}s, started $(date +%H:%M:%S), ${SECONDS}s into the run"
        start=$SECONDS
        timeout --kill-after=15 "$limit" bash "$SELF" --step "$@"
        rc=$?
        verdict=PASS
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            verdict=FAIL note=" (timed out after ${limit}s)"
        elif [ "$rc" -ne 0 ]; then
            verdict=FAIL note=" (exit status $rc)"
        fi
        note=" $((SECONDS - start))s$note"
    fi
    echo "=== step $id: $verdict$note"
    SUMMARY+=("$(printf '%-3s %s  %s%s' "$id" "$verdict" "$title" "$note")")
    [ "$verdict" = PASS ] || FAILED+=("$id")
}

header() {
    local commit=${GPU_CHECK_COMMIT:-}
    if [ -z "$commit" ]; then
        if commit=$(git rev-parse HEAD 2>/dev/null); then
            local changed
            changed=$(git status --porcelain 2>/dev/null | wc -l)
            [ "$changed" -eq 0 ] || commit="$commit + uncommitted changes in $changed files"
        else
            commit="unknown (no git repository here; set GPU_CHECK_COMMIT)"
        fi
    fi
    local py=$PY
    [ -x "$py" ] || py=$PYTHON
    echo "minddp gpu-check, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "machine: $(uname -n), $(nproc) CPUs, $(uname -srm)"
    if command -v nvidia-smi >/dev/null; then
        # compute_mode: two ranks can share the GPU only in "Default" mode.
        echo "gpu:     $(nvidia-smi --format=csv,noheader \
            --query-gpu=name,memory.total,driver_version,compute_mode 2>&1 | paste -sd ';')"
    fi
    "$py" - <<'EOF'
import platform

import torch


def ask(what):
    try:
        return what()
    except Exception as e:  # noqa: BLE001 - a header line, not a check
        return f"? ({type(e).__name__})"


print(f"torch:   {torch.__version__} from {torch.__file__}; Python {platform.python_version()}")
print(f"cuda:    {ask(lambda: torch.version.cuda)}, cuDNN {ask(torch.backends.cudnn.version)}, "
      f"NCCL {ask(lambda: '.'.join(map(str, torch.cuda.nccl.version())))}, "
      f"{ask(torch.cuda.device_count)} x {ask(lambda: torch.cuda.get_device_name(0))}")
EOF
    echo "nvcc:    $( (command -v nvcc >/dev/null && nvcc --version | grep release) ||
                      echo "not on PATH")"
    echo "commit:  $commit"
    echo "budget:  ${BUDGET}s for all steps; log $LOG; benchmark outputs in $RESULTS/"
}

main() {
    header
    run_step 1  "build minddp._C with CUDA kernels (make setup)"            300 build
    run_step 2  "CUDA kernel checks (int8 division, test_compression_ops)"  150 kernel_tests
    run_step 3  "multi-process GPU tests (tests/test_gpu.py, AMP test)"     270 gpu_tests
    run_step 4a "compare.py --device cuda, 2 ranks on one GPU (gloo)"       150 compare 2 gloo 12
    run_step 4b "compare.py --device cuda, 1 rank (NCCL)"                   120 compare 1 nccl 6
    run_step 4c "kernels.py --device cuda"                                   90 kernels_bench
    run_step 4d "train.py --amp, 2 ranks on one GPU (gloo)"                 120 train 2 gloo
    run_step 4e "train.py --amp, 1 rank (NCCL)"                              90 train 1 nccl
    run_step 4f "short steps, 1 rank (NCCL): compare.py narrow, overhead.py" 120 short_steps
    run_step 4g "compress kernels against candidates (compress_variants.cu)" 60 compress_candidate
    echo
    echo "=== summary: ${SECONDS}s in all"
    printf '%s\n' "${SUMMARY[@]}"
    if [ "${#FAILED[@]}" -eq 0 ]; then
        echo "gpu-check: PASS (${#SUMMARY[@]} steps)"
    else
        echo "gpu-check: FAIL (steps ${FAILED[*]} of ${#SUMMARY[@]} failed)"
        return 1
    fi
}

mkdir -p "$(dirname "$LOG")" "$RESULTS"
main 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
if [ -n "$PACK" ]; then
    (cd "$RESULTS" && find . -name '*.json' -print0 | tar czf - --null -T -) > "$PACK" &&
        echo "gpu-check: the outputs' .json files packed into $PACK"
fi
exit "$status"
