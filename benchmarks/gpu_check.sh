#!/usr/bin/env bash
# The whole GPU check of issue 9 as ONE script for the H100/H200 test machine (../shared/gpu/README.md).
# Run ../shared/gpu/prepare.sh here first, then on the device (carry .whl):
#     bash benchmarks/gpu_check.sh            # writes at most 8 files under $OUT
# Dry run on a CPU (every stage, tiny model):   DRY=1 OUT=/tmp/gpucheck bash benchmarks/gpu_check.sh
# Each stage has its own timeout and writes its result as soon as it ends, so one hang or crash loses nothing else.
set -u
OUT=${OUT:-/tmp/rocktune-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # rocktune runs from the source tree there
if [ -d .whl ] && [ -z "${DRY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ -n "${DRY:-}" ] && [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; fi
PY=${PY:-python3}
if [ -n "${DRY:-}" ]; then DEVICE=cpu; MODEL="--model tiny"; SHAPE=tiny; else DEVICE=cuda; MODEL=""; SHAPE=qwen2.5-1.5b-shape; fi

# 1. The machine, and what rocktune's doctor concludes about it (1 file).
{ nvidia-smi 2>&1 || echo "no nvidia-smi"; timeout 90 $PY -m rocktune doctor --json 2>&1; } > "$OUT/machine.txt"

# 2. The GPU-marked tests: planner peak within 10% of max_memory_allocated, and the rest (1 file).
timeout 180 $PY -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/pytest-gpu.txt" 2>&1

# 3. The bench suite: both Qwen2.5 shapes, hf-seed / hf-best / rocktune and the switches (3 files).
timeout 480 $PY -m rocktune bench --suite gpu --device $DEVICE $MODEL --out /tmp/rt-suite --json \
  > "$OUT/suite.json" 2> "$OUT/suite.err"
cp /tmp/rt-suite/report-*.json "$OUT/" 2>/dev/null

# 4. The real training loop with --auto on the 1.5B shape: planner's predicted peak vs the measured one (1 file).
timeout 240 $PY benchmarks/auto_peak.py --device $DEVICE --model $SHAPE > "$OUT/auto_peak.txt" 2>&1
ls -la "$OUT"
