#!/usr/bin/env bash
# vattn's GPU run, in stages ordered by what is most at risk (issue 33).
#
#   bash benchmarks/gpu_suite.sh OUTDIR          # call 1: the suite (at most 7.5 minutes)
#   bash benchmarks/gpu_suite.sh OUTDIR --fa4    # call 2: FlashAttention 4 (at most 3 minutes)
#
# On a lent GPU machine (the device tool's `run`; docs/gpu.md "The next run" has the exact calls):
#   VATTN_COMMIT=<hash> bash benchmarks/gpu_suite.sh "$OUT"    (carry [".whl", ".fa4/a"])
#   VATTN_COMMIT=<hash> bash benchmarks/gpu_suite.sh "$OUT" --fa4    (carry [".fa4/b"], right after)
# (write the hash into the command: the copied tree there has no .git). `bash
# benchmarks/gpu_wheels.sh --fa4` puts the wheels in .whl/ and .fa4/ first (git-ignored).
#
# Call 1's stages, each with its own timeout, capped by what is left of VATTN_SUITE_BUDGET
# (default 450 s; --fa4 170 s); a stage that fails is recorded and the next one runs; a stage that would
# start with under 20 s left is skipped and recorded so. Results are written after every stage.
#   install      the carried wheels into /tmp/site (vattn serve's web stack; their Requires-Dist
#                checked against what is installed), .fa4/a kept in /tmp/fa4 for call 2, vattn's
#                C extension, versions and the device
#   1. tests     GPU tests of what never ran on a GPU, each pytest in a process of its own (a
#                GPU fault poisons its process), every test under pytest-timeout:
#                windows_kernel (FlashAttention's local attention next to pages given back),
#                layer_kinds (windows, recurrent states and the coordinator in the engine),
#                serve_cuda (`vattn serve --device cuda`), compile_graphs (the compiled forward
#                under CUDA graphs), gpu_rest (every other `gpu` test: the backends, kernels,
#                graphs, the scratch page when the tree has it, the shared budget)
#   2. multi_server  two `vattn serve` on one shared budget against two static halves, bursts
#                (benchmarks/multi_server.py --device cuda): TTFT p50/p99, memory, equal answers
#   3. offload   the offload tier's restore bandwidth and multi-turn TTFT (`vattn bench offload`,
#                when the tree has it)
#   4. step      async scheduling (when the tree has it) and the compiled step: the engine's time
#                outside the forward, the decode step against its bandwidth bound, end to end at
#                the 1B and 8B shapes, batch 32 (vattn/bench/_e2e.py --compile --engine-overhead)
#   5. sanitizer compute-sanitizer memcheck on windows and states (benchmarks/gpu_sanitize.py)
#   6. scratch_cost  the scratch page under server tensors on the driver (`vattn bench alloc
#                --scratch-gib`: a large reservation's start-up, a page turn), if time is left
# Call 2 (--fa4): install (FlashAttention 4: the two halves of its cu13 libraries joined and
# checked, its wheels), the FlashAttention 4 GPU tests (the kernel on the VMM cache, rows after
# a context, the engine), then `vattn bench kernel --kernel flash_attn_4` (on the vattn cache,
# on contiguous memory and in its own page_table mode).
#
# OUTDIR gets at most 8 files, flat: suite.log (every stage's output), summary.md (stages,
# environment, key figures; printed at the end), results.json (every JSON a stage wrote), and
# each benchmark's PNG. Exit code: 0 when every stage that ran passed, 1 otherwise.
#
# Environment: PYTHON (default python3), VATTN_SUITE_BUDGET (seconds), VATTN_COMMIT (recorded
# when the tree has no .git), VATTN_SITE (default /tmp/site: where carried wheels go; call 1
# empties it), VATTN_SUITE_FORCE_PIP=1 (pip install -e even without CUDA), VATTN_SUITE_CPU_CHECKS=1
# (without CUDA, run every stage's CPU variant: the tests collect and skip, the benchmarks run
# their host versions; the rehearsal of the GPU run on the CPU, docs/gpu.md).
set -u -o pipefail

OUT=${1:?usage: bash benchmarks/gpu_suite.sh OUTDIR [--fa4]}
MODE=main
if [ "${2:-}" = "--fa4" ]; then MODE=fa4; elif [ -n "${2:-}" ]; then echo "unknown option $2" >&2; exit 2; fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/suite.log
: >"$LOG"
rm -f "$OUT/results.json" "$OUT/summary.md"  # a rerun into the same OUTDIR starts afresh
PY=${PYTHON:-python3}
BUDGET=${VATTN_SUITE_BUDGET:-$([ $MODE = fa4 ] && echo 170 || echo 450)}
SITE=${VATTN_SITE:-/tmp/site}
FA4_KEEP=/tmp/fa4  # call 1 leaves the first half of FlashAttention 4's cu13 libraries here for call 2
T0=$(date +%s)
if [ -z "${VATTN_COMMIT:-}" ]; then
    VATTN_COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
fi
export VATTN_COMMIT PYTHONUNBUFFERED=1 VATTN_BENCH_OUT=$OUT MPLBACKEND=Agg
# the carried wheels first (the device tool's notes), FlashAttention 4's CuTe DSL packages (what
# its .pth file adds in a site directory; --target installs do not read .pth files), this tree
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$REPO${PYTHONPATH:+:$PYTHONPATH}
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
    if [ -n "${VATTN_SUITE_STAGES:-}" ] && [[ $name != install* && $name != versions ]] \
            && [[ ",$VATTN_SUITE_STAGES," != *",$name,"* ]]; then
        skip "$name" "not in VATTN_SUITE_STAGES"
        return
    fi
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

say "vattn GPU suite ($MODE): repo $REPO, commit $VATTN_COMMIT, output $OUT, budget ${BUDGET}s, python $(command -v "$PY")"

# ------------------------------------------------------------------ what is there ----
HAVE_CUDA=0
if timeout 90 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >>"$LOG" 2>&1; then
    HAVE_CUDA=1
fi
CPU_CHECKS=0
[ $HAVE_CUDA = 0 ] && [ -n "${VATTN_SUITE_CPU_CHECKS:-}" ] && CPU_CHECKS=1
RUN=0  # whether the stages after the install run: on CUDA, or their CPU variants
{ [ $HAVE_CUDA = 1 ] || [ $CPU_CHECKS = 1 ]; } && RUN=1
DEV=$([ $HAVE_CUDA = 1 ] && echo cuda || echo cpu)
SAN=$(command -v compute-sanitizer 2>/dev/null || true)
if [ -z "$SAN" ]; then
    for f in /usr/local/cuda*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer \
             /opt/nvidia/*/compute-sanitizer /opt/nvidia/*/*/compute-sanitizer; do
        if [ -x "$f" ]; then SAN=$f; break; fi
    done
fi
if [ $HAVE_CUDA = 1 ]; then say "CUDA: yes"
elif [ $CPU_CHECKS = 1 ]; then say "CUDA: no: every stage's CPU variant runs (VATTN_SUITE_CPU_CHECKS)"
else say "CUDA: no (torch.cuda.is_available() is False): the GPU stages are skipped"; fi
say ""
if [ $MODE = main ]; then
    say "stages (estimate / timeout on an H100, seconds; the timeout capped by the budget left), budget ${BUDGET}s:"
    say "  install (wheels, extension, versions)   40 / 150+60"
    say "  1. tests_windows_kernel                  20 /  90   (own process; the first that could fault)"
    say "  1. tests_layer_kinds                     70 / 180"
    say "  1. tests_serve_cuda                      30 / 120"
    say "  1. tests_compile_graphs                  60 / 180"
    say "  1. tests_gpu_rest                        60 / 150"
    say "  2. multi_server                          90 / 150"
    say "  3. offload (if the tree has it)          45 /  90"
    say "  4. step (e2e 1B/8B batch 32, compiled)  120 / 180"
    say "  5. compute_sanitizer                     45 /  90"
    say "  6. scratch_cost (if time is left)        60 /  90"
    say "  7. paper (Figs. 2 3 7 11, quick)         90 / 240"
    say "  the estimates add up to about 600 s (540 without offload), over the budget: the tail (scratch_cost,"
    say "  then the sanitizer) is skipped, not overrun, when the stages before it run as estimated or longer"
else
    say "stages: install (FlashAttention 4) 60 / 150, tests_fa4 60 / 150, kernel_fa4 60 / the budget left"
fi
say ""

# ------------------------------------------------------------------------ install ----
if [ $MODE = main ]; then
    # the wheels vattn serve needs (benchmarks/gpu_wheels.sh), and the first half of FA4's libraries
    step install_wheels 10 90 "installed|PROBLEM|Error|error" bash -c '
        site=$1
        rm -rf "$site" && mkdir -p "$site"
        if compgen -G ".fa4/a/*.part1" >/dev/null; then
            mkdir -p '"$FA4_KEEP"' && cp .fa4/a/*.part1 '"$FA4_KEEP"'/ && echo "kept $(ls .fa4/a) in '"$FA4_KEEP"' for the FlashAttention 4 call"
        fi
        if ! compgen -G ".whl/*.whl" >/dev/null; then
            echo "no .whl/ here: nothing to install (vattn serve needs fastapi, uvicorn, pydantic and openai: bash benchmarks/gpu_wheels.sh)"
            exit 0
        fi
        "$0" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
        echo "installed $(ls .whl/*.whl | wc -l) wheels into $site"
        "$0" benchmarks/gpu_summary.py --check-requirements "$site"' "$PY" "$SITE"
else
    step install_fa4 60 150 "imported|PROBLEM|missing|Error|error" bash -c '
        site=$1 keep=$2
        mkdir -p "$site"
        part1=$(ls "$keep"/*.part1 .fa4/a/*.part1 2>/dev/null | head -n 1)
        part2=$(ls .fa4/b/*.part2 2>/dev/null | head -n 1)
        if [ -z "$part1" ] || [ -z "$part2" ]; then
            echo "FlashAttention 4 is missing a half: part1 ${part1:-missing} (kept by call 1 in $keep: gone if the machine was given back between the calls), part2 ${part2:-missing} (carry .fa4/b)"
            exit 1
        fi
        want=$(cat .fa4/b/*.sha256)
        got=$(cat "$part1" "$part2" | sha256sum | cut -c1-64)
        [ "$want" = "$got" ] || { echo "the joined archive is damaged: sha256 $got, want $want"; exit 1; }
        # the wheels first: pip --target --upgrade replaces a package folder whole, and the cu13
        # files go into nvidia_cutlass_dsl/ beside -libs-base and -libs-core
        "$0" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .fa4/b/*.whl || exit 1
        cat "$part1" "$part2" | tar -xJ -C "$site" || exit 1
        "$0" benchmarks/gpu_summary.py --check-requirements "$site"
        "$0" -c "import time; t = time.time(); import flash_attn.cute as f; print(\"flash_attn.cute imported in %.1f s from\" % (time.time() - t), f.__file__)"' \
        "$PY" "$SITE" "$FA4_KEEP"
fi

if [ $HAVE_CUDA = 1 ] || [ -n "${VATTN_SUITE_FORCE_PIP:-}" ]; then
    INSTALL='"$0" -m pip install -e . --no-deps --no-build-isolation \
             || { echo "pip install -e failed: building the extension in place instead"; "$0" setup.py build_ext --inplace; }'
else
    INSTALL='echo "no CUDA: building the extension in place (pip install -e is skipped here so that this machine'"'"'s environment is not repointed)"; "$0" setup.py build_ext --inplace'
fi
step install 30 150 "vattn\._C|Successfully|error" bash -c "$INSTALL"'
    rc=$?
    if ! "$0" -c "import vattn, vattn._C as C; print(\"import ok: vattn from\", vattn.__file__, \"; vattn._C from\", C.__file__)"; then
        echo "FATAL: import vattn._C FAILED: the C extension did not build for this Python (python3-dev? a C compiler?)"
        exit 3
    fi
    exit $rc' "$PY"

step versions 5 60 "^(device|torch) " bash -c '
    echo "python: $("$0" --version 2>&1) at $(command -v "$0")"
    if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; else echo "nvidia-smi: not found"; fi
    echo "compute-sanitizer: ${1:-not found}"
    "$0" - <<'"'"'EOF'"'"'
import importlib.metadata as md
import torch
for pkg in ("torch", "transformers", "triton", "cuda-bindings", "flash-attn", "flash-attn-4", "nvidia-cutlass-dsl",
            "fastapi", "uvicorn", "pydantic", "openai", "pytest", "pytest-timeout", "nvidia-ml-py"):
    try:
        print(f"{pkg} {md.version(pkg)}")
    except md.PackageNotFoundError:
        print(f"{pkg} not installed")
print(f"torch {torch.__version__}, CUDA runtime {torch.version.cuda}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    print(f"free GPU memory {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
    print(f"device {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}, "
          f"{p.multi_processor_count} SMs, CUDA {torch.version.cuda}, torch {torch.__version__}")
EOF
' "$PY" "$SAN"
timeout 120 "$PY" benchmarks/gpu_summary.py "$OUT" --env "$DEV" >>"$LOG" 2>&1 || say "  (could not record the environment)"

# pytest in a process of its own per stage; every test under pytest-timeout (in the image);
# a module that cannot be imported here fails alone (--continue-on-collection-errors)
pytest_stage() {  # NAME ESTIMATE TIMEOUT PER_TEST_TIMEOUT PYTEST_ARGS...
    local name=$1 est=$2 limit=$3 per=$4
    shift 4
    step "$name" "$est" "$limit" "passed|failed|error|no tests ran|skipped" \
        "$PY" -m pytest -q -p no:cacheprovider -rfEs -o faulthandler_timeout=$((per + 30)) -o timeout="$per" \
        --durations=5 --continue-on-collection-errors -m gpu "$@"
}
gated() {  # NAME REASON: a stage that does not run here
    if [ $RUN = 0 ]; then skip "$1" "no CUDA"; else skip "$1" "$2"; fi
}

if [ $MODE = fa4 ]; then
    # ------------------------------------------------------------- FlashAttention 4 ----
    if [ $RUN = 1 ]; then
        pytest_stage tests_fa4 60 150 120 -k "flash_attn_4" tests/vmem/test_gpu.py tests/engine/test_attention.py
        if [ $HAVE_CUDA = 1 ]; then
            KB=(--device cuda --kernel flash_attn_4 --layouts per-layer --batches 8 32 --contexts 4096 16384
                --blocks 16 128 256 --prefill-max-tokens 32768)
        else
            KB=(--device cpu --kernel flash_attn_4 --layouts per-layer --batches 2 --contexts 64 200)
        fi
        kb_budget=$((BUDGET - $(elapsed) - 60))
        [ $kb_budget -lt 20 ] && kb_budget=20
        step kernel_fa4 60 $((kb_budget + 50)) "virtual/contiguous|paged|gather|FAILED|Error" \
            "$PY" -m vattn bench kernel "${KB[@]}" --out "$OUT" --budget-s $kb_budget
    else
        skip tests_fa4 "no CUDA"
        skip kernel_fa4 "no CUDA"
    fi
else
    # ------------------------------------------------------------------ 1. tests ----
    if [ $RUN = 1 ]; then
        pytest_stage tests_windows_kernel 20 90 60 tests/engine/test_gpu_kinds.py -k "flash_local"
        pytest_stage tests_layer_kinds 70 180 150 tests/engine/test_gpu_kinds.py -k "not flash_local"
        pytest_stage tests_serve_cuda 30 120 90 tests/integrations/test_serve.py
        pytest_stage tests_compile_graphs 60 180 170 tests/engine/test_compile.py
        pytest_stage tests_serve_vattn 30 120 100 tests/integrations/test_serve_vattn.py
        pytest_stage tests_gpu_rest 60 150 90 tests --ignore=tests/engine/test_gpu_kinds.py \
            --ignore=tests/engine/test_compile.py --ignore=tests/integrations/test_serve.py \
            --ignore=tests/integrations/test_serve_vattn.py
    else
        for s in tests_windows_kernel tests_layer_kinds tests_serve_cuda tests_compile_graphs tests_serve_vattn \
                 tests_gpu_rest; do
            skip $s "no CUDA"
        done
    fi

    # ------------------------------------------ 1b. vattn serve against its engine in process ----
    if [ $RUN = 1 ] && grep -q -- "--device" benchmarks/serve_overhead.py; then
        if [ $HAVE_CUDA = 1 ]; then
            SO=(--device cuda --requests 128 --concurrency 32 --max-tokens 128 --max-batch-tokens 4096 --rounds 1)
        else
            SO=(--device cpu --model tiny --requests 16 --concurrency 8 --max-tokens 16 --rounds 1)
        fi
        step serve_overhead 90 180 "geometric mean|round|Error|expected" "$PY" benchmarks/serve_overhead.py "${SO[@]}"
    else
        gated serve_overhead "the tree's serve_overhead.py has no --device"
    fi

    # ----------------------------------------------------------- 2. multi_server ----
    if [ $RUN = 1 ]; then
        if [ $HAVE_CUDA = 1 ]; then MS=(--device cuda --cycles 2 --gap-s 0.5); else MS=(--device cpu --quick --gap-s 0.5); fi
        step multi_server 90 150 "same greedy answers|shared_over_static|peak of A|Error|exited" \
            "$PY" benchmarks/multi_server.py "${MS[@]}"
    else
        skip multi_server "no CUDA"
    fi

    # ---------------------------------------------------------------- 3. offload ----
    if [ $RUN = 1 ] && timeout 60 "$PY" -m vattn bench offload --help >/dev/null 2>&1; then
        step offload 45 90 "GB/s|TTFT|FAILED|Error" "$PY" -m vattn bench offload --device "$DEV" --quick --out "$OUT"
    else
        gated offload "the tree has no \`vattn bench offload\` (issue 31, branch offload)"
    fi

    # ------------------------------------------------ 4. async and the compiled step ----
    if [ $RUN = 1 ]; then
        E2E_HELP=$(timeout 60 "$PY" -m vattn.bench._e2e --help 2>/dev/null || true)
        ASYNC=()
        for flag in --compare-async --async-scheduling --async; do  # issue 32: asynchronous (the default on CUDA) against synchronous
            if grep -q -- "$flag\b" <<<"$E2E_HELP"; then ASYNC=("$flag"); break; fi
        done
        [ ${#ASYNC[@]} = 0 ] && say "  (no async scheduling in this tree's e2e benchmark: the step stage measures the compiled step)"
        if [ $HAVE_CUDA = 1 ]; then
            E2E=(--device cuda --quick --models ${VATTN_E2E_MODELS:-llama-3.2-1b llama-3-8b} --batches 32 --compile
                 --engine-overhead --skip-hf)
        else  # compiling takes minutes on the host: the harness alone
            E2E=(--device cpu --quick --models llama-3.2-1b --batches 2 --engine-overhead --skip-hf)
        fi
        e2e_budget=$((BUDGET - $(elapsed) - ${VATTN_STEP_RESERVE:-110}))  # the seconds kept for the stages after it
        [ $e2e_budget -lt 30 ] && e2e_budget=30
        step step 120 180 "^(llama|vattn)|step_over_bound|tok/s|FAILED|Error" \
            "$PY" -m vattn.bench._e2e "${E2E[@]}" "${ASYNC[@]}" --file-name e2e_step --out "$OUT" --budget-s $e2e_budget
    else
        skip step "no CUDA"
    fi

    # ------------------------------------------------------ 5. compute-sanitizer ----
    if [ $HAVE_CUDA = 1 ] && [ -n "$SAN" ]; then
        # memory access errors fail the stage; API errors are left out (vattn checks every driver
        # call itself, and torch's polling calls would be counted)
        step compute_sanitizer 45 90 "ERROR SUMMARY|windows:|states:|Error" "$SAN" --tool memcheck \
            --report-api-errors no --error-exitcode 99 --print-limit 20 --target-processes all \
            "$PY" benchmarks/gpu_sanitize.py --device cuda
    elif [ $HAVE_CUDA = 1 ]; then
        skip compute_sanitizer "compute-sanitizer not found (PATH, /usr/local/cuda*/bin, /opt/nvidia)"
    elif [ $CPU_CHECKS = 1 ]; then  # the script itself, without the sanitizer
        step compute_sanitizer 10 90 "windows:|states:|Error" "$PY" benchmarks/gpu_sanitize.py --device cpu
    else
        skip compute_sanitizer "no CUDA"
    fi

    # ------------------------------------------------------ 6. the scratch page's cost ----
    # (last: the scratch page's correctness is a GPU test of stage 1; this times it on the
    # driver: the start-up of a large reservation backed by one page, a page turn)
    if [ $RUN = 1 ] && timeout 60 "$PY" -m vattn bench alloc --help 2>/dev/null | grep -q -- "--scratch-gib"; then
        if [ $HAVE_CUDA = 1 ]; then SG=(--device cuda --quick --scratch-gib 8 64); else SG=(--device cpu --quick --scratch-gib 0.25); fi
        step scratch_cost 60 90 "scratch|GB/s|FAILED|Error" "$PY" -m vattn bench alloc "${SG[@]}" --out "$OUT"
    else
        gated scratch_cost "the tree has no scratch backing (\`vattn bench alloc --scratch-gib\`)"
    fi

    # ------------------------------------------------- 7. the vAttention paper's figures ----
    # (issue 40: Figs. 2, 3, 7, 11 with the paper's axes at quick sizes; the kernels on FlashAttention 4's
    # page_table when installed; one JSON and one PNG, the suite's few files)
    if [ $RUN = 1 ] && timeout 60 "$PY" -m vattn bench paper --help >/dev/null 2>&1; then
        if [ $HAVE_CUDA = 1 ]; then PF=(--device cuda --quick --figure 2 3 7 11); else PF=(--device cpu --quick --figure 2 3 7 11 --no-paged-engine); fi
        step paper 90 240 "Fig\\. [0-9]+:|FAILED|Error" "$PY" -m vattn bench paper "${PF[@]}" --one-png --out "$OUT"
    else
        gated paper "the tree has no \`vattn bench paper\` (issue 40)"
    fi
fi

# ------------------------------------------------------------------------- done ----
timeout 120 "$PY" benchmarks/gpu_summary.py "$OUT" >>"$LOG" 2>&1 || true
say ""
say "suite ($MODE) finished in $(elapsed)s: $PASSED passed, $FAILED failed, $SKIPPED skipped; files in $OUT:"
ls -la "$OUT" | tee -a "$LOG"
echo
cat "$OUT/summary.md"
[ $FAILED -eq 0 ]
