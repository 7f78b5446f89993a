#!/usr/bin/env bash
# meshlab's GPU pass: one script, one device call, every part bounded in time.
#
# Parts (each its own step under `timeout`; a failure is recorded and the next part runs):
#   device      nvidia-smi, torch/triton/nccl versions, the two measured ceilings
#               (device-to-device copy GB/s, bf16 8192^3 matmul TFLOP/s)
#   notebook    an nbclient-executed notebook: %load_ext meshlab, %mesh start (one rank per
#               GPU, NCCL), %mesh init, a %%mesh all_reduce + training cell, %%mesh --comms,
#               %mesh status, %mesh memory, %mesh stop; checks device cuda and backend nccl
#   calibrate   %mesh calibrate's code on a live 1-rank NCCL cluster, then the planner's
#               predicted step beside the measured one (ratio)
#   tests_gpu   pytest tests/gpu (torch's ring attention at cp=1, FP8 through torchao, chunked
#               attention's HBM peak, fp16 loss scaling, 8-bit AdamW beside torchao's, the
#               fused attention kernels calibrate times, a training step's CUDA allocator
#               history for pytorch.org/memory_viz)
#   tests_rank  pytest tests/rank/test_offload_gpu.py tests/rank/test_kernel_bench.py
#   kernels     benchmarks/kernels.py: meshlab's Triton kernels beside eager, torch.compile
#               and Liger-Kernel, % of HBM peak
# Logs: $OUT/<part>.log, $OUT/summary.txt, $OUT/extras.tar.gz (JSON results, the executed
# notebook, the calibrated profile): 8 files at most come back.
#
# On the device: bash benchmarks/gpu_pass.sh        (wheels from .whl/, carried)
# Here (CPU, a check of the script itself): OUT=/tmp/out PY=/tmp/venv/bin/python3 \
#   SITE=/tmp/site ML=/tmp/ml BACKEND=gloo RANKS=2 bash benchmarks/gpu_pass.sh
set -u
export PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 1
OUT=${OUT:-/tmp/gpu_pass_out}
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}              # the carried wheels, installed here
ML=${ML:-/tmp/meshlab_src}           # meshlab as setuptools lays it out (magics/ inside)
BUDGET=${BUDGET:-465}                # seconds for the whole pass, setup included
BACKEND=${BACKEND:-nccl}             # the notebook's and calibration's backend
RANKS=${RANKS:-}                     # empty: one rank per visible GPU
export GPU_PASS_RESULTS=${GPU_PASS_RESULTS:-/tmp/gpu_pass_results}
mkdir -p "$OUT" "$GPU_PASS_RESULTS"
START=$SECONDS

# -- setup: carried wheels, meshlab from this tree -----------------------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" | tail -5
fi
# pyproject's package-dir: magics/, extension/ and clusters/ install inside meshlab. A copy
# laid out the same way (no build, no setuptools needed); PYTHONSAFEPATH keeps the tree's own
# meshlab/ (without magics) off sys.path when a command runs from the repo root.
rm -rf "$ML" && mkdir -p "$ML"
cp -r meshlab "$ML/meshlab" && cp -r magics "$ML/meshlab/magics" \
    && cp -r extension "$ML/meshlab/extension" && cp -r clusters "$ML/meshlab/clusters"
export PYTHONPATH="$SITE:$ML" PYTHONSAFEPATH=1
export IPYTHONDIR=/tmp/gpu_pass_ipython JUPYTER_PLATFORM_DIRS=1 MPLBACKEND=Agg
export TORCHINDUCTOR_CACHE_DIR=/tmp/gpu_pass_inductor TRITON_CACHE_DIR=/tmp/gpu_pass_triton
echo "setup $((SECONDS - START)) s; meshlab from $("$PY" -c 'import meshlab; print(meshlab.__file__)')"

PARTS=()
declare -A STATUS SECS

free_gpu() {  # processes a timed-out part left on the GPU (this pass's own, by pid)
    command -v nvidia-smi >/dev/null || return 0
    local pids
    pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
    for pid in $pids; do
        echo "free_gpu: ending pid $pid ($(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null | cut -c1-80))"
        kill -9 "$pid" 2>/dev/null
    done
}

part() {  # part NAME LIMIT_S COMMAND...: run under timeout, log to $OUT/NAME.log
    local name=$1 limit=$2 rc t0
    shift 2
    PARTS+=("$name")
    if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then  # ONLY="notebook kernels"
        STATUS[$name]="not asked for"; SECS[$name]=0
        return
    fi
    local left=$((BUDGET - (SECONDS - START)))
    if ((left < 25)); then
        STATUS[$name]="skipped: pass budget spent"; SECS[$name]=0
        echo "=== $name: skipped (${left}s of the budget left)"
        return
    fi
    ((limit > left - 10)) && limit=$((left - 10))
    echo "=== $name (limit ${limit}s, $((SECONDS - START))s into the pass) ==="
    t0=$SECONDS
    set -o pipefail
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=$?
    set +o pipefail
    SECS[$name]=$((SECONDS - t0))
    case $rc in
        0) STATUS[$name]="ok" ;;
        124|137) STATUS[$name]="TIMEOUT after ${limit}s"; free_gpu ;;
        *) STATUS[$name]="FAILED rc=$rc" ;;
    esac
}

H=benchmarks/gpu_pass
# estimates on an H100 (limits): device 15 s (40), notebook 45 s (90), calibrate 60 s (100),
# tests_gpu 60 s (100), tests_rank 45 s (80), kernels 200 s on an H200 (220); the parts'
# limits shrink to what is left of BUDGET, so the pass ends by ~BUDGET + 15 s whatever hangs
part device 40 "$PY" $H/device.py
part notebook 90 "$PY" $H/notebook_pass.py --backend "$BACKEND" ${RANKS:+--ranks $RANKS} \
    --executed "$GPU_PASS_RESULTS/gpu_pass_executed.ipynb"
part calibrate 100 "$PY" $H/calibrate_pass.py --backend "$BACKEND" ${RANKS:+--ranks $RANKS} \
    --profile "$GPU_PASS_RESULTS/calibrated.toml"
part tests_gpu 150 "$PY" -m pytest tests/gpu/test_ring_attention_gpu.py tests/gpu/test_fp8_gpu.py \
    tests/gpu/test_long_context_gpu.py tests/gpu/test_attention_gpu.py \
    tests/gpu/test_memory_history_gpu.py \
    -q --timeout 120 -p no:cacheprovider -s \
    --junitxml "$GPU_PASS_RESULTS/tests_gpu.xml" -rs
part tests_rank 80 "$PY" -m pytest tests/rank/test_offload_gpu.py tests/rank/test_kernel_bench.py \
    -x -q --timeout 120 -p no:cacheprovider --junitxml "$GPU_PASS_RESULTS/tests_rank.xml" -rs
part kernels ${KERNELS_LIMIT:-220} "$PY" benchmarks/kernels.py ${KERNEL_ARGS:---sizes 4096,16384 --vocab 131072 --rows 8192} \
    --json "$GPU_PASS_RESULTS/kernels.json"

# -- summary ---------------------------------------------------------------------------------
{
    for name in "${PARTS[@]}"; do echo "$name|${STATUS[$name]}|${SECS[$name]}"; done
} >"$GPU_PASS_RESULTS/status.txt"
"$PY" $H/summary.py "$GPU_PASS_RESULTS" "$OUT" | tee "$OUT/summary.txt"
tar -czf "$OUT/extras.tar.gz" -C "$GPU_PASS_RESULTS" . 2>/dev/null
echo "pass: $((SECONDS - START)) s in all; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
