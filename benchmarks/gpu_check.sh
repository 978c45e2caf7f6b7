#!/usr/bin/env bash
# The GPU check in five parts, each finishing within 8 minutes on the H100/H200 test machine, whose limit is
# 10 minutes per command (../shared/gpu/README.md). Run ../shared/gpu/prepare.sh here first, then there (carry .whl):
#
#     bash benchmarks/gpu_check.sh a     # doctor (the varlen attention self-test included), pytest -m gpu (the real
#                                        # train() on CUDA: token batching, compile, guards, a forced OOM split, a
#                                        # checkpoint, a kill and an exact resume), one profiled training step
#     bash benchmarks/gpu_check.sh b     # the bench suite on the Qwen2.5-0.5B shape: hf-best and rocktune
#     bash benchmarks/gpu_check.sh c     # the 1.5B shape: hf-best and rocktune
#     bash benchmarks/gpu_check.sh d     # the 0.5B shape's other configurations (hf-seed, rt-examples, rt-no-compile),
#                                        # the planner's peak vs the measured one
#     bash benchmarks/gpu_check.sh e     # the compiled step: the host's share of it, graph breaks, recompiles; the
#                                        # loss chunk eager against compiled
#
# Sized from the first run on an H200 (2026-11-26, docs/benchmarks.md): the train() test's first run alone took 99 s
# (48 s of it compiling), rocktune's bench configuration on the 0.5B shape about 80 s, and hf-best did not finish
# within 100 s, so it gets 200 s (0.5B) and 180 s (1.5B) here.
# Each stage runs under its own timeout; a part's timeouts add to at most 450 s, plus at most 30 s of wheel install.
# Each stage writes into $OUT as it goes (stages.txt says when each began and how it ended), so a stage cut short
# loses nothing before it. Dry run on a CPU (tiny model, the same stages and commands): add --dry-run (or DRY=1);
# GPU_CHECK_CONFIGS and GPU_CHECK_POINTS shrink parts b, c and d further (the default test suite does).
set -u
PART=${1:-}
case "${2:-}" in --dry-run) DRY=1 ;; "") ;; *) echo "usage: gpu_check.sh {a|b|c|d|e} [--dry-run]" >&2; exit 2 ;; esac
case "$PART" in a|b|c|d|e) ;; *) echo "usage: gpu_check.sh {a|b|c|d|e} [--dry-run]" >&2; exit 2 ;; esac
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

if [ -n "${DRY:-}" ]; then
  PY=${PY:-python3}; DEVICE=cpu; SMALL=tiny; LARGE=tiny; PROFILE="--rows 2 --max-length 256"; DOCTOR="--no-perf"
  LOSS="--dtype fp32 --rows 300 --chunk 128 --vocab 512 --hidden 64 --repeat 1"
  SHORT="--max-length 256 --dry-run"
else
  if [ -d .whl ]; then
    echo "$(date -u +%H:%M:%S) install begins (timeout 30s)" >> "$OUT/stages.txt"
    timeout 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/*.whl > "$OUT/install.txt" 2>&1 || { echo "wheel install failed" >> "$OUT/stages.txt"; exit 1; }
    export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
  PY=${PY:-python3}; DEVICE=cuda; SMALL=qwen2.5-0.5b-shape; LARGE=qwen2.5-1.5b-shape; PROFILE=""; DOCTOR=""; SHORT=""
  LOSS="--dtype bf16 --chunk 2048 --rows 8192 --repeat 5"
fi

case "$PART" in
  a)
    stage machine 10 machine.txt sh -c 'nvidia-smi || echo "no nvidia-smi"'
    stage doctor 50 doctor.json $PY -m rocktune doctor --json $DOCTOR
    stage pytest-gpu 300 pytest-gpu.txt $PY -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests
    stage profile 60 profile-stdout.json $PY benchmarks/profile_step.py --device $DEVICE --model $SMALL \
      --out "$OUT/profile" $PROFILE
    ;;
  b)
    # hf-best and rocktune at the suite's workload: at most 200 s each, plus building the 0.5B shape (seconds)
    stage suite-0.5b 440 suite-0.5b.json $PY -m rocktune bench --suite gpu --device $DEVICE --model $SMALL \
      --out /tmp/rt-suite --timeout 200 --json --configs ${GPU_CHECK_CONFIGS:-hf-best,rocktune}
    mkdir -p "$OUT/results-0.5b" && cp /tmp/rt-suite/$SMALL/results/*.json "$OUT/results-0.5b/" 2>/dev/null
    ;;
  c)
    # building the 1.5B shape takes about a minute; then hf-best and rocktune, at most 180 s each
    stage suite-1.5b 440 suite-1.5b.json $PY -m rocktune bench --suite gpu --device $DEVICE --model $LARGE \
      --out /tmp/rt-suite --timeout 180 --json --configs ${GPU_CHECK_CONFIGS:-hf-best,rocktune}
    mkdir -p "$OUT/results-1.5b" && cp /tmp/rt-suite/$LARGE/results/*.json "$OUT/results-1.5b/" 2>/dev/null
    ;;
  d)
    # the rest of the 0.5B suite (the seed recipe and the switches that explain rocktune's figure, 95 s each), then
    # benchmarks/auto_peak.py: the planner's peak against the real loop's, reusing the shape and data cached above
    stage suite-0.5b-rest 300 suite-0.5b-rest.json $PY -m rocktune bench --suite gpu --device $DEVICE \
      --model $SMALL --out /tmp/rt-suite --timeout 95 --json \
      --configs ${GPU_CHECK_CONFIGS:-hf-seed,rt-examples,rt-no-compile}
    mkdir -p "$OUT/results-0.5b-rest" && cp /tmp/rt-suite/$SMALL/results/*.json "$OUT/results-0.5b-rest/" 2>/dev/null
    stage auto-peak 140 auto_peak.jsonl $PY benchmarks/auto_peak.py --device $DEVICE --model $SMALL \
      --points ${GPU_CHECK_POINTS:-2} $SHORT
    ;;
  e)
    # The first H200 run left one question open: the host waited on the device for only 7% of a step. The compiled
    # step's enqueue time against its finish time, with what Dynamo did, answers it; then the loss chunk alone,
    # eager against compiled (its first GPU figure)
    stage profile-compiled 240 profile-compiled-stdout.json $PY benchmarks/profile_step.py --device $DEVICE \
      --model $SMALL --compile --out "$OUT/profile-compiled" $PROFILE
    stage profile-loss 150 profile-loss.json $PY benchmarks/profile_loss.py --device $DEVICE $LOSS
    ;;
esac
ls -la "$OUT" >> "$OUT/stages.txt"
cat "$OUT/stages.txt"
