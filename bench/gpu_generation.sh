#!/usr/bin/env bash
# Issue 65's GPU row: greedy bytes/s of Spider 1b and a same-size dense Llama, both with static caches and compiled,
# in one device call of at most ~5 minutes. Prepared on a CPU; run it on one H100/H200 with the wheel folder of
# ../shared/gpu/wheels.sh carried as .whl:
#   device run, carry [".whl"], command: "bash bench/gpu_generation.sh", timeout_s 330
# Writes $OUT/generation.json (bench.gpu_check's `generation` entry: bytes_per_s, compile_s, spider_over_llama) and
# $OUT/generation.err. Commit the JSON as bench/gpu_generation_<gpu>.json and the row into the README's table.
set -u
OUT=${OUT:?the device tool sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
timeout 300 python3 -m bench.gpu_check --only generation --budget_s 290 --part_cap generation=290 \
  --out "$OUT/generation.json" 2> "$OUT/generation.err"
echo "generation: exit $?"
