#!/usr/bin/env bash
# The GPU check for a session's 15 minutes of device time (../shared/gpu/README.md: start-up, every command and idle
# waits count; at most 10 minutes a command). Two commands answer the most; run ../shared/gpu/prepare.sh here first,
# then there (carry .whl):
#
#     bash benchmarks/gpu_check.sh 1   # <= 9 min: the Qwen2.5-0.5B shape at the GPU suite's workload, one bench
#                                      # configuration per stage, most important first: rocktune (compile, Inductor's
#                                      # own fusion), rt-no-compile, rt-liger (compile with Liger), hf-best. Each
#                                      # rocktune row carries the real step's device account: a profiled step
#                                      # (compiled where the run compiles)
#                                      # with its kernels per class, busy share and top kernels, the CUDA-event span
#                                      # of every step, forwards per step, every step's peak and the planner's.
#     bash benchmarks/gpu_check.sh 2   # <= 4.5 min: the 1.5B shape, rocktune (MFU target 40%, the planner's peak
#                                      # against the measured one); hf-best there needs a later session; then
#                                      # 30 s of the soak (benchmarks/soak.py: GPU memory flat over steps)
#     bash benchmarks/gpu_check.sh extra   # not in the 15-minute plan: what the first run settled (doctor with the
#                                      # varlen self-test, pytest -m gpu), the loss chunk alone, eager vs compiled,
#                                      # and one compiled LoRA layer's kernels (benchmarks/compiled_layer.py)
#
# Sized from the first H200 run (2026-11-26, docs/benchmarks.md): rocktune's configuration took about 80 s with
# 5 steps (48 s of it compiling), hf-best did not finish in 100 s; building the 1.5B shape takes about a minute.
# Each stage runs under its own timeout and writes into $OUT as it goes (stages.txt says when each began and how it
# ended), so a stage cut short loses nothing before it; tests/test_gpu_check.py adds the timeouts up. Dry run on a CPU
# (tiny model, the same stages and commands): add --dry-run (or DRY=1).
set -u
PART=${1:-}
USAGE="usage: gpu_check.sh {1|2|extra} [--dry-run]"
case "${2:-}" in --dry-run) DRY=1 ;; "") ;; *) echo "$USAGE" >&2; exit 2 ;; esac
case "$PART" in 1|2|extra) ;; *) echo "$USAGE" >&2; exit 2 ;; esac
OUT=${OUT:-/tmp/rocktune-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # rocktune runs from the source tree there
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

# stage NAME SECONDS FILE COMMAND...: stdout to $OUT/FILE, stderr to $OUT/NAME.err, under its own timeout
stage() {
  local name=$1 secs=$2 file=$3
  shift 3
  echo "$(date -u +%H:%M:%S) $name begins (timeout ${secs}s)" >> "$OUT/stages.txt"
  timeout "$secs" "$@" > "$OUT/$file" 2> "$OUT/$name.err"
  local rc=$?  # before anything else resets it
  echo "$(date -u +%H:%M:%S) $name ends: exit status $rc$([ $rc = 124 ] && echo ' (timed out)')" >> "$OUT/stages.txt"
}

# bench NAME SECONDS SHAPE CONFIG BUILD: one configuration of the GPU suite. The shape and data are built once into
# /tmp/rt-suite and reused; the configuration's own timeout leaves the stage BUILD seconds for building them and 10 s
# to write its report. GPU_CHECK_CONFIGS (comma list) runs only those configurations (the CPU dry run's tests).
bench() {
  local name=$1 secs=$2 shape=$3 config=$4 build=$5
  case ",${GPU_CHECK_CONFIGS:-$config}," in *",$config,"*) ;; *) echo "$name skipped (GPU_CHECK_CONFIGS)" \
    >> "$OUT/stages.txt"; return ;; esac
  stage "$name" "$secs" "$name.json" $PY -m rocktune bench --suite gpu --device $DEVICE --model "$shape" \
    --out /tmp/rt-suite --timeout $((secs - build - 10)) --json --configs "$config"
  mkdir -p "$OUT/results" && cp /tmp/rt-suite/"$shape"/results/*.json "$OUT/results/" 2>/dev/null
}

if [ -n "${DRY:-}" ]; then
  PY=${PY:-python3}; DEVICE=cpu; SMALL=tiny; LARGE=tiny; DOCTOR="--no-perf"
  LOSS="--dtype fp32 --rows 300 --chunk 128 --vocab 512 --hidden 64 --repeat 1"
else
  if [ -d .whl ]; then
    echo "$(date -u +%H:%M:%S) install begins (timeout 30s)" >> "$OUT/stages.txt"
    timeout 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/*.whl > "$OUT/install.txt" 2>&1 || { echo "wheel install failed" >> "$OUT/stages.txt"; exit 1; }
    export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
  PY=${PY:-python3}; DEVICE=cuda; SMALL=qwen2.5-0.5b-shape; LARGE=qwen2.5-1.5b-shape; DOCTOR=""
  LOSS="--dtype bf16 --chunk 2048 --rows 8192 --repeat 5"
fi

case "$PART" in
  1)
    stage machine 10 machine.txt sh -c 'nvidia-smi || echo "no nvidia-smi"'
    # rocktune rows: compile (~50 s), 10 steps, an 11th under the profiler (reading its trace takes seconds too)
    bench rocktune-0.5b 150 "$SMALL" rocktune 20         # also builds the shape and the data (seconds)
    bench rt-no-compile-0.5b 80 "$SMALL" rt-no-compile 0 # eager: what compile buys
    bench rt-liger-0.5b 120 "$SMALL" rt-liger 0          # compiled with Liger: the pair of rocktune's Inductor fusion
    bench hf-best-0.5b 140 "$SMALL" hf-best 0            # the yardstick of the 1.5x target; longest, so last
    ;;
  2)
    bench rocktune-1.5b 210 "$LARGE" rocktune 70         # builds the 1.5B shape (~60 s), compiles, 11 steps
    # the soak (issue 39): allocated/reserved over as many steps as 30 s allow, under the knowledge's allocator
    # settings; its timeout's SIGTERM makes it print what it saw (cut_short). The CPU runs it in tests/test_soak.py.
    if [ -z "${DRY:-}" ]; then
      stage soak 30 soak.json $PY benchmarks/soak.py --device $DEVICE --steps 1500 --every 0.2
    else echo "soak skipped (dry run)" >> "$OUT/stages.txt"; fi
    ;;
  extra)
    stage doctor 50 doctor.json $PY -m rocktune doctor --json $DOCTOR
    stage pytest-gpu 300 pytest-gpu.txt $PY -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests
    stage profile-loss 100 profile-loss.json $PY benchmarks/profile_loss.py --device $DEVICE $LOSS
    # one LoRA decoder layer under Inductor: graph breaks, graphs, Triton kernels generated, matmul calls
    stage compiled-layer 120 compiled-layer.json $PY benchmarks/compiled_layer.py --device $DEVICE
    ;;
esac
ls -la "$OUT" >> "$OUT/stages.txt"
cat "$OUT/stages.txt"
