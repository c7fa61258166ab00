#!/usr/bin/env bash
# The GPU check (benchmarks/README.md, "GPU check"), run from the repository root of a copy of the checkout
# on a GPU host without network, with .gpu-check/ (`make gpu-pack`) beside it:
#   1. setup: the wheels the host lacks into a scratch --target folder, `infercept` linked from the source tree
#   1b. the machine's speed (probe.py), again after the last step: a slow host is told from a slow engine
#   2. models: random weights of the embedded model's shape (at the default model path) and of Llama-3-8B's
#   3. pytest -m gpu over the test files that hold gpu-marked tests
#   4. the 8B shape's measured profile beside the hand-written h100_llama3_8b()
#   5. engine vs transformers: decode at batch 1, 8, 32 and a 1,000-token prefill, 8B shape
#   5b. where a step's time goes (step_profile.py): step vs runner time, cProfile, torch.profiler
#   5c. the prefill kernel under a set of tilings beside SDPA (prefill_tiles.py)
#   6. benchmarks/engine_trace.py, policies prefix-cache and infercept, 1 GiB and 16 GiB device pools, each
#      beside the same trace simulated on step 4's profile (--simulate), and simulated again charging each
#      step the host's time fitted to the trace's own step logs (host_cost.py, --host-ms); a pool's trace that
#      fails runs again with --no-async-scheduling
# then summary.json / summary.md. Each step has its own time limit, all of them within BUDGET_S (480 s: the
# whole check); a failed step does not stop the next. Results: benchmarks/results/gpu-<card>-<date>/ under $OUT
# when it is set, else under the repository.
#
#   bash benchmarks/gpu/run.sh            # on the GPU host (what `make gpu-check` runs)
#   PYTHON=.venv/bin/python bash benchmarks/gpu/run.sh --dry
#       the same steps on a CPU: float32, a two-layer model instead of 8B, batches 1 and 2, a 5 s trace, no
#       pip install; results under /tmp/gpu-check-dry unless OUT is set
#
# Variables: PYTHON (python3), PACK (.gpu-check), OUT, DRY=1 (as --dry), INSTALL=1 (install the wheels in a
# dry run too: on a CPU machine whose Python lacks them, with a pack for its Python version), BUDGET_S (480),
# TRACE_UNTIL (seconds per policy, 40; shortened to fit the budget), TRACE_POOLS (device pools in GiB, "1 16"),
# TRACE_RATE (arrivals/s, 12), SKIP (steps not to run, a |-separated list of glob patterns of their names, e.g.
# SKIP='profile*|engine vs*|step profile': a rerun of some steps), GPU_TESTS (the test files pytest -m gpu
# runs; default: every file with a gpu-marked test), KEEP=1 (keep the scratch folder).
set -u
shopt -s extglob
cd "$(dirname "$0")/../.."
ROOT=$PWD
DRY=${DRY:-0}
[ "${1:-}" = --dry ] && DRY=1
INSTALL=${INSTALL:-$([ "$DRY" = 1 ] && echo 0 || echo 1)}  # INSTALL=1 with --dry: try the wheels' install too
PY=${PYTHON:-python3}
PACK=${PACK:-$ROOT/.gpu-check}
BUDGET_S=${BUDGET_S:-480}
RESERVE_S=45  # kept back: a step's 10 s grace to die after its limit, the machine probe at the end (15 s
              # at most), then the summary (15 s at most)
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET_S))
W=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")  # scratch: wheels, package links, models, caches

if [ "$DRY" = 1 ]; then
    NAME="gpu-dry-$($PY benchmarks/gpu/card.py --slug)-$(date +%Y-%m-%d)"
    RES=${OUT:-${TMPDIR:-/tmp}/gpu-check-dry}/benchmarks/results/$NAME
else
    NAME="gpu-$($PY benchmarks/gpu/card.py --slug)-$(date +%Y-%m-%d)"
    RES=${OUT:-$ROOT}/benchmarks/results/$NAME
fi
rm -rf "$RES" && mkdir -p "$RES"
exec > >(tee -a "$RES/log.txt") 2>&1
TEE=$!
echo "GPU check$([ "$DRY" = 1 ] && echo ' (dry run)'): results in $RES, scratch $W, budget $BUDGET_S s"

# step NAME CAP_S CMD...: CMD with a limit of CAP_S or what is left of the budget; records exit status and time.
# (A shell function runs as `bash -c NAME`, exported: `timeout` runs programs.)
FAILED=0
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - $(date +%s) - RESERVE_S))
    local limit=$((cap < left ? cap : left)) start rc
    if [ -n "${SKIP:-}" ] && [[ $name == @($SKIP) ]]; then
        echo
        echo "=== $name not run (SKIP)"
        return
    fi
    echo
    echo "=== $name [at $(($(date +%s) - T0)) s, limit $limit s]"
    if [ "$limit" -le 0 ]; then
        echo "=== $name skipped: the budget is spent"
        printf '%s\tskipped\t0\n' "$name" >>"$RES/steps.tsv"
        FAILED=1
        return
    fi
    start=$(date +%s)
    timeout -k 10 "$limit" "$@"
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" >>"$RES/steps.tsv"
    if [ "$rc" != 0 ]; then
        echo "=== $name FAILED: exit status $rc$([ "$rc" = 124 ] && echo ' (timed out)')"
        FAILED=1
    fi
}

export PYTHONPATH="$W/site:$W/pkg${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 INFERCEPT_CACHE="$W/cache"

setup() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    echo "cores: $(nproc); $($PY --version)"
    [ -d "$PACK/model" ] || { echo "no $PACK/model: run make gpu-pack on the development machine"; return 1; }
    if [ "$INSTALL" != 1 ]; then
        echo "no wheels installed (INSTALL=$INSTALL)"
    else
        local wheels
        wheels=$($PY benchmarks/gpu/select_wheels.py "$PACK/wheels") || return 1
        if [ -n "$wheels" ]; then
            # shellcheck disable=SC2086
            $PY -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$W/site" $wheels \
                || return 1
        fi
    fi
    $PY benchmarks/gpu/link_package.py "$W/pkg" || return 1
    $PY -c "import torch, transformers, infercept.engine as e
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(),
      '| transformers', transformers.__version__, '| infercept.engine from', e.__file__)"
}
export -f setup
export INSTALL PY PACK W RES
step setup 60 bash -c setup

if [ "$DRY" = 1 ]; then
    BIG_SHAPE=tiny DTYPE=float32 DEVICE=cpu BATCHES="1 2" STEP_BATCHES="1 2"
    PROFILE_POOLS="--kv-cache-gb 0.05 --host-kv-gb 0.05" DECODE_POOL="--kv-cache-gb 0.05"
    TRACE_UNTIL=${TRACE_UNTIL:-5} TRACE_POOLS="0.002 0.05" TRACE_OVERHEAD=5
    TRACE_ARGS="--rate 2 --window 3 --context-scale 0.05 --decode-scale 0.1 --interception-scale 0.02
        --max-interceptions 2 --max-context 256 --host-kv-gb 0.01 --max-num-batched-tokens 64 --max-num-seqs 16
        --threads 1"
else
    BIG_SHAPE=llama3-8b DTYPE=bfloat16 DEVICE=auto BATCHES="1 8 32" STEP_BATCHES="1 32"
    PROFILE_POOLS="--kv-cache-gb 16 --host-kv-gb 4" DECODE_POOL="--kv-cache-gb 4"
    TRACE_UNTIL=${TRACE_UNTIL:-40} TRACE_POOLS=${TRACE_POOLS:-1 16} TRACE_OVERHEAD=20  # per policy: load, profile, graphs
    # Paper-scale contexts, half the decode, interceptions x0.3: 191 requests arrive in 15 s at 12/s. The rate
    # is where the 1 GiB pool is under pressure on an H100 with CUDA graphs for every step: at 4/s (54
    # requests) both policies kept up there (2026-11-27), while the simulation on its measured profile puts
    # prefix-cache at 5x infercept's normalized latency at 12/s.
    TRACE_ARGS="--rate ${TRACE_RATE:-12} --window 15 --context-scale 1 --decode-scale 0.5 --interception-scale 0.3
        --max-interceptions 4 --max-context 4096 --host-kv-gb 8 --max-num-batched-tokens 512 --max-num-seqs 64
        --threads 8"
fi
BIG=$W/models/$BIG_SHAPE

# How fast this machine is before the steps (and again after them, below): probe.py.
step "probe at start" 30 $PY benchmarks/gpu/probe.py --label start --out "$RES" --device $DEVICE

models() {
    $PY benchmarks/gpu/make_models.py --src "$PACK/model" --shape embedded --json "$RES/model_small.json" &&
        $PY benchmarks/gpu/make_models.py --src "$PACK/model" --shape "$BIG_SHAPE" --dst "$BIG" \
            --json "$RES/model_big.json"
}
export -f models
export BIG_SHAPE BIG
step models 120 bash -c models

# Only the files that hold gpu-marked tests: collecting the others imports the server's dependencies
# (fastapi, openai, mcp, ...), which the host does not have.
GPU_TESTS=${GPU_TESTS:-$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')}
echo
echo "gpu-marked tests in: $GPU_TESTS"
# shellcheck disable=SC2086
step "pytest -m gpu" 150 $PY -m pytest -q -p no:cacheprovider -m gpu --junitxml="$RES/pytest.xml" $GPU_TESTS

# shellcheck disable=SC2086
step "profile vs hand-written" 90 $PY benchmarks/gpu/profile_vs_hand.py --model "$BIG" --out "$RES" \
    --dtype $DTYPE --device $DEVICE $PROFILE_POOLS

# shellcheck disable=SC2086
step "engine vs transformers" 120 $PY benchmarks/gpu/decode_vs_hf.py --model "$BIG" --out "$RES" \
    --dtype $DTYPE --device $DEVICE --batches $BATCHES $DECODE_POOL
if [ "$(tail -1 "$RES/steps.tsv" | cut -f2)" != 0 ]; then
    # Without CUDA graphs, so a failure of theirs still leaves the comparison (recorded as its own step).
    # shellcheck disable=SC2086
    step "engine vs transformers, eager" 120 $PY benchmarks/gpu/decode_vs_hf.py --model "$BIG" --out "$RES" \
        --dtype $DTYPE --device $DEVICE --batches $BATCHES $DECODE_POOL --enforce-eager
fi

# shellcheck disable=SC2086
step "step profile" 120 $PY benchmarks/gpu/step_profile.py --model "$BIG" --out "$RES" --dtype $DTYPE \
    --device $DEVICE $DECODE_POOL --batches $STEP_BATCHES --eager-too

# The prefill kernel's tilings beside SDPA (the interpreter and tiny shapes in a dry run).
if [ "$DRY" = 1 ]; then
    step "prefill tiles" 120 env TRITON_INTERPRET=1 $PY benchmarks/gpu/prefill_tiles.py --dry --out "$RES"
else
    step "prefill tiles" 120 $PY benchmarks/gpu/prefill_tiles.py --out "$RES"
fi

# Each pool runs two policies; the runs share what is left: each policy gets --until seconds plus its start-up.
LEFT=$((DEADLINE - $(date +%s) - RESERVE_S))
RUNS=$((2 * $(echo $TRACE_POOLS | wc -w)))
UNTIL=$(((LEFT - 20 * RUNS / 2) / RUNS - TRACE_OVERHEAD))  # 20 s a pool for its simulation
UNTIL=$((UNTIL < TRACE_UNTIL ? UNTIL : TRACE_UNTIL))
echo
echo "engine trace: --until $UNTIL s per policy ($LEFT s left)"
for KV in $TRACE_POOLS; do
    if [ "$UNTIL" -lt 5 ]; then
        echo "=== engine trace, $KV GiB skipped: the budget is spent"
        printf '%s\tskipped\t0\n' "engine trace $KV GiB" >>"$RES/steps.tsv"
        FAILED=1
        continue
    fi
    # shellcheck disable=SC2086
    step "engine trace $KV GiB" $((2 * (UNTIL + TRACE_OVERHEAD) + 30)) $PY benchmarks/engine_trace.py \
        --model "$BIG" --policies prefix-cache infercept --until "$UNTIL" --kv-cache-gb "$KV" $TRACE_ARGS \
        --out "$RES/engine_trace_kv${KV}gib.md" --json "$RES/engine_trace_kv${KV}gib.json" \
        --step-log "$RES/steps_kv${KV}gib"
    if [ "$(tail -1 "$RES/steps.tsv" | cut -f2)" != 0 ]; then
        # Again with each step planned after the last one's samples are read, so that a failure of the
        # asynchronous scheduling (the engine's default on a GPU) still leaves the pool's ratio, marked
        # as measured that way (recorded as its own step; the same result files).
        # shellcheck disable=SC2086
        step "engine trace $KV GiB, synchronous scheduling" $((2 * (UNTIL + TRACE_OVERHEAD) + 30)) $PY \
            benchmarks/engine_trace.py --model "$BIG" --policies prefix-cache infercept --until "$UNTIL" \
            --kv-cache-gb "$KV" $TRACE_ARGS --no-async-scheduling --out "$RES/engine_trace_kv${KV}gib.md" \
            --json "$RES/engine_trace_kv${KV}gib.json" --step-log "$RES/steps_kv${KV}gib"
    fi
    gzip -f "$RES/steps_kv${KV}gib/"*.jsonl 2>/dev/null
    # The same trace simulated on this run's profile: where the engine and the simulations part ways.
    if [ -f "$RES/profile.json" ]; then
        # shellcheck disable=SC2086
        step "engine trace $KV GiB, simulated" 60 $PY benchmarks/engine_trace.py --simulate "$RES/profile.json" \
            --policies prefix-cache infercept --until "$UNTIL" --kv-cache-gb "$KV" $TRACE_ARGS \
            --out "$RES/engine_trace_kv${KV}gib.simulated.md" --json "$RES/engine_trace_kv${KV}gib.simulated.json"
        # And charged the host's time a step, fitted to the engine's step logs just written (host_cost.py):
        # what the engine loses to the host beside what the device does.
        HOST_MS=$(timeout 30 $PY benchmarks/gpu/host_cost.py "$RES/steps_kv${KV}gib" | tail -n 1)
        if [[ $HOST_MS == --host-ms* ]]; then
            # shellcheck disable=SC2086
            step "engine trace $KV GiB, simulated with the host's time" 60 $PY benchmarks/engine_trace.py \
                --simulate "$RES/profile.json" --policies prefix-cache infercept --until "$UNTIL" --kv-cache-gb "$KV" \
                $TRACE_ARGS $HOST_MS --out "$RES/engine_trace_kv${KV}gib.simulated_host.md" \
                --json "$RES/engine_trace_kv${KV}gib.simulated_host.json"
        fi
    fi
done

echo
echo "=== probe at end [at $(($(date +%s) - T0)) s]"
timeout -k 5 15 $PY benchmarks/gpu/probe.py --label end --out "$RES" --device $DEVICE || echo "=== probe at end FAILED"

echo
echo "=== summary [at $(($(date +%s) - T0)) s]"
timeout 15 $PY benchmarks/gpu/summary.py "$RES" --seconds $(($(date +%s) - T0)) $([ "$DRY" = 1 ] && echo --dry) ||
    FAILED=1
[ "${KEEP:-0}" = 1 ] && echo "scratch kept: $W" || rm -rf "$W"
echo "GPU check done in $(($(date +%s) - T0)) s; results in $RES$([ "$FAILED" = 1 ] && echo '; some steps failed')"
exec >&- 2>&-
wait "$TEE" 2>/dev/null  # log.txt complete before the caller collects the results
exit $FAILED
