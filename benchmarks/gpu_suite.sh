#!/usr/bin/env bash
# vattn's GPU suite: install, GPU tests (both CUDA drivers), benchmarks, compute-sanitizer.
#
#   bash benchmarks/gpu_suite.sh OUTDIR
#
# On a lent GPU machine (the device tool's `run`, timeout_s=600, files come back from $OUT):
#   VATTN_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_suite.sh "$OUT"
# (write the hash into the command: the copied tree there has no .git)
#
# Run from anywhere (it works in the repository root). One invocation on a bare GPU
# machine does everything within VATTN_SUITE_BUDGET seconds (default 540): each step has
# its own timeout, capped by what is left of the budget; a failing step is recorded and
# the suite goes on. Without CUDA the GPU steps say "skipped: no CUDA" and the suite ends
# in seconds. OUTDIR gets at most 8 files, flat:
#   suite.log     every step's output
#   summary.md    steps, environment and the key figures (also printed at the end)
#   results.json  every benchmark's JSON (environment, arguments, raw numbers)
#   *.png         one plot per benchmark (`vattn bench gpu`: kernel_cuda, alloc_cuda,
#                 overlap_cuda, e2e_cuda)
# Exit code: 0 when every step that ran passed, 1 otherwise.
#
# Environment: PYTHON (default python3), VATTN_SUITE_BUDGET (seconds),
# VATTN_COMMIT (recorded when the tree has no .git), VATTN_SUITE_FORCE_PIP=1 (pip
# install -e even without CUDA; without CUDA the extension is built in place instead, so
# a shared environment is not repointed), VATTN_SUITE_CPU_CHECKS=1 (without CUDA, run
# `vattn bench gpu --device cpu`: the benchmarks' tiny CPU versions).
set -u -o pipefail

OUT=${1:?usage: bash benchmarks/gpu_suite.sh OUTDIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/suite.log
: >"$LOG"
rm -f "$OUT/results.json" "$OUT/summary.md"  # a rerun into the same OUTDIR starts afresh
PY=${PYTHON:-python3}
BUDGET=${VATTN_SUITE_BUDGET:-540}
T0=$(date +%s)
if [ -z "${VATTN_COMMIT:-}" ]; then
    VATTN_COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
fi
export VATTN_COMMIT PYTHONUNBUFFERED=1 VATTN_BENCH_OUT=$OUT MPLBACKEND=Agg
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
export TQDM_DISABLE=1

FAILED=0
PASSED=0
SKIPPED=0

say() { echo "$*" | tee -a "$LOG"; }
elapsed() { echo $(( $(date +%s) - T0 )); }

record() {  # NAME STATUS SECONDS TIMEOUT NOTE: results.json + summary.md (never fails the suite)
    timeout 120 "$PY" benchmarks/gpu_summary.py "$OUT" --step "$1" --status "$2" --seconds "$3" \
        --timeout "$4" --note="$5" >>"$LOG" 2>&1 || say "  (gpu_summary.py could not record step $1)"
}

skip() {  # NAME REASON
    SKIPPED=$((SKIPPED + 1))
    say "[$(elapsed)s] $1: skipped: $2"
    record "$1" skipped 0 0 "$2"
}

# step NAME ESTIMATE TIMEOUT NOTE_PATTERN CMD...: run CMD under `timeout`, log its output.
# NOTE_PATTERN: an extended regex; the last output line matching it goes into the summary.
step() {
    local name=$1 est=$2 limit=$3 pattern=$4
    shift 4
    local left=$((BUDGET - $(elapsed)))
    if [ "$left" -lt 20 ]; then
        skip "$name" "the suite's time budget (${BUDGET}s) is spent"
        return
    fi
    [ "$limit" -gt $((left - 5)) ] && limit=$((left - 5))
    local start_line
    start_line=$(wc -l <"$LOG")
    {
        echo
        echo "===== $name (estimate ${est}s, timeout ${limit}s) at $(elapsed)s: $*"
    } >>"$LOG"
    echo "[$(elapsed)s] $name: running (estimate ${est}s, timeout ${limit}s)"
    local t=$SECONDS
    timeout -k 15 "$limit" "$@" >>"$LOG" 2>&1 </dev/null
    local rc=$? status note
    local dt=$((SECONDS - t))
    if [ $rc -eq 0 ]; then status=passed; PASSED=$((PASSED + 1))
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=timeout; FAILED=$((FAILED + 1))
    else status=failed; FAILED=$((FAILED + 1)); fi
    note=$(tail -n +$((start_line + 1)) "$LOG" | grep -aE "$pattern" | tail -n 1 | cut -c1-200 | tr -d '|')
    [ $rc -ne 0 ] && note="rc=$rc${note:+; $note}"
    say "[$(elapsed)s] $name: $status in ${dt}s${note:+ ($note)}"
    echo "===== $name: $status (rc=$rc) in ${dt}s" >>"$LOG"
    record "$name" "$status" "$dt" "$limit" "$note"
}

say "vattn GPU suite: repo $REPO, commit $VATTN_COMMIT, output $OUT, budget ${BUDGET}s, python $(command -v "$PY")"

# ------------------------------------------------------------------ what is there ----
HAVE_CUDA=0
if timeout 90 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >>"$LOG" 2>&1; then
    HAVE_CUDA=1
fi
SAN=$(command -v compute-sanitizer 2>/dev/null || true)
if [ -z "$SAN" ]; then
    for f in /usr/local/cuda*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer \
             /opt/nvidia/*/compute-sanitizer /opt/nvidia/*/*/compute-sanitizer; do
        if [ -x "$f" ]; then SAN=$f; break; fi
    done
fi
# The estimate of each step (seconds) on an H100/H200; the timeout is capped by the budget left.
say ""
say "time budget (estimate / timeout, seconds), total budget ${BUDGET}s:"
say "  install + import check     30 /  150"
say "  versions                    5 /   60"
say "  pytest -m gpu (cext)       60 /  150"
say "  allocator suite cuda-python 40 / 120"
say "  vattn bench gpu --quick   330 /  budget left - 100 (kernel, alloc, overlap, e2e: each in a process of its own)"
say "  compute-sanitizer demo     75 /  150"
say "  expected total            ~550 (the tail is skipped, not overrun, if earlier steps run long)"
if [ $HAVE_CUDA = 1 ]; then say "CUDA: yes"; else say "CUDA: no (torch.cuda.is_available() is False): GPU steps are skipped"; fi
say ""

# --------------------------------------------------------------------- 1. install ----
if [ $HAVE_CUDA = 1 ] || [ -n "${VATTN_SUITE_FORCE_PIP:-}" ]; then
    INSTALL='"$0" -m pip install -e . --no-deps --no-build-isolation \
             || { echo "pip install -e failed: building the extension in place instead"; "$0" setup.py build_ext --inplace; }'
else
    INSTALL='echo "no CUDA: building the extension in place (pip install -e is skipped here so that this machine'"'"'s environment is not repointed)"; "$0" setup.py build_ext --inplace'
fi
step install 30 150 "vattn\._C|Successfully|error" bash -c "$INSTALL"'
    rc=$?
    if ! "$0" -c "import vattn, vattn._C as C; print(\"import ok: vattn from\", vattn.__file__, \"; vattn._C from\", C.__file__)"; then
        echo "################################################################"
        echo "FATAL: import vattn._C FAILED: the C extension did not build for this Python."
        echo "       Nothing on CUDA can work: both CUDA drivers (cext and cuda-python) make their"
        echo "       tensors with vattn._C.dlpack. Is Python.h there (python3-dev), and a C compiler?"
        echo "################################################################"
        exit 3
    fi
    exit $rc' "$PY"

# -------------------------------------------------------------------- versions ----
step versions 5 60 "^(device|torch) " bash -c '
    echo "python: $("$0" --version 2>&1) at $(command -v "$0")"
    if command -v nvidia-smi >/dev/null; then nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; else echo "nvidia-smi: not found"; fi
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
    echo "compute-sanitizer: ${1:-not found}"
    "$0" - <<'"'"'EOF'"'"'
import importlib.metadata as md
import torch
for pkg in ("torch", "transformers", "triton", "cuda-python", "cuda-bindings", "flash-attn", "hypothesis", "pytest", "matplotlib", "numpy"):
    try:
        print(f"{pkg} {md.version(pkg)}")
    except md.PackageNotFoundError:
        print(f"{pkg} not installed")
print(f"torch {torch.__version__}, CUDA runtime {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    print(f"free GPU memory {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
    print(f"device {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}, "
          f"{p.multi_processor_count} SMs, CUDA {torch.version.cuda}, torch {torch.__version__}")
    from vattn import _C
    print(f"cuMemCreate granularity {_C.cuda_load().granularity(torch.cuda.current_device()) >> 20} MiB")
EOF
' "$PY" "$SAN"
timeout 120 "$PY" benchmarks/gpu_summary.py "$OUT" --env "$([ $HAVE_CUDA = 1 ] && echo cuda || echo cpu)" >>"$LOG" 2>&1 \
    || say "  (could not record the environment)"

# ----------------------------------------------------------------------- 2. tests ----
# --continue-on-collection-errors: a test module that cannot be imported on this image (a
# package or API missing) fails on its own instead of stopping every GPU test.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o faulthandler_timeout=90 --durations=5 --continue-on-collection-errors)
TESTS_PAT="passed|failed|error|no tests ran"
if [ $HAVE_CUDA = 1 ]; then
    step pytest_gpu_cext 60 150 "$TESTS_PAT" env VATTN_CUDA_DRIVER=cext "${PYTEST[@]}" -m gpu tests
    step pytest_alloc_cuda_python 40 120 "$TESTS_PAT" env VATTN_CUDA_DRIVER=cuda-python "${PYTEST[@]}" -m gpu \
        tests/alloc/test_allocator.py tests/alloc/test_fences.py tests/alloc/test_state_machine.py
else
    skip pytest_gpu_cext "no CUDA"
    skip pytest_alloc_cuda_python "no CUDA"
fi

# ------------------------------------------------------------------ 3. benchmarks ----
left() { echo $((BUDGET - $(elapsed))); }
if [ $HAVE_CUDA = 1 ]; then
    # every GPU benchmark in one run; ~100 s are left for compute-sanitizer. Each part writes
    # <part>_cuda.json/.png into OUTDIR and starts only while --budget-s is not spent.
    GPU_LIMIT=$(( $(left) - 100 > 60 ? $(left) - 100 : 60 ))
    step bench_gpu 300 $GPU_LIMIT "^(kernel|alloc|overlap|e2e) +\||wrote|Error" "$PY" -m vattn bench gpu --quick \
        --out "$OUT" --budget-s $(( GPU_LIMIT - 40 > 20 ? GPU_LIMIT - 40 : 20 ))
else
    skip bench_gpu "no CUDA"
    if [ -n "${VATTN_SUITE_CPU_CHECKS:-}" ]; then  # the benchmarks' tiny CPU versions (harness checks)
        step bench_gpu_cpu 60 240 "^(kernel|alloc|overlap|e2e) +\||wrote|Error" "$PY" -m vattn bench gpu --device cpu \
            --quick --out "$OUT"
    fi
fi

# ------------------------------------------------------------- 4. compute-sanitizer ----
if [ $HAVE_CUDA = 0 ]; then
    skip compute_sanitizer "no CUDA"
elif [ -z "$SAN" ]; then
    skip compute_sanitizer "compute-sanitizer not found (PATH, /usr/local/cuda*/bin, /opt/nvidia)"
else
    # memcheck on a short engine run: the demo's tiny model, 4 requests of at most 64 + 32 tokens
    # (greedy and top-p sampling), the CUDA backend (cext driver): `vattn demo` with shorter requests,
    # as every instrumented kernel launch is slow.
    # API errors are left out (--report-api-errors no): vattn checks every driver call itself,
    # and torch's polling calls would be counted; memory access errors fail the step.
    step compute_sanitizer 75 150 "ERROR SUMMARY|Error" "$SAN" --tool memcheck --report-api-errors no \
        --error-exitcode 99 --print-limit 20 --target-processes all \
        "$PY" -c "import sys; from vattn.engine.demo import run_demo
r = run_demo(num_requests=4, device='cuda', max_prompt=64, max_output=32, show_progress=False)
print('vattn demo under memcheck:', r['num_requests'], 'requests,', r['num_errors'], 'errors', r['errors'][:2])
sys.exit(1 if r['num_errors'] else 0)"
fi

# ------------------------------------------------------------------------- done ----
timeout 120 "$PY" benchmarks/gpu_summary.py "$OUT" >>"$LOG" 2>&1 || true
say ""
say "suite finished in $(elapsed)s: $PASSED passed, $FAILED failed, $SKIPPED skipped; files in $OUT:"
ls -la "$OUT" | tee -a "$LOG"
echo
cat "$OUT/summary.md"
[ $FAILED -eq 0 ]
