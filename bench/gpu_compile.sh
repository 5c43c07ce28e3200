#!/usr/bin/env bash
# Issue 63's GPU figures for --compile (one graph per layer kind), in one device call of at most ~8 minutes.
# Prepared on a CPU; run it on one H100/H200 with the wheel folder of ../shared/gpu/wheels.sh carried as .whl:
#   device run, carry [".whl"], command: "bash bench/gpu_compile.sh", timeout_s 560
# Each part writes its own JSON under $OUT as it goes (a part cut by its timeout keeps the rows it finished):
#   cold.json   1b, 8 x 2048: spider_compiled with an empty inductor cache (warmup_step_s[0] is the cold compile)
#   warm.json   the same row again on the same cache (warmup_step_s[0]: the warm compile; target <= 10 s)
#   small.json  1b, 32 x 256: deepseek_v3 and spider_compiled (target <= 1.15x, GPU busy >= 85%)
#   graphs.json 1b, 32 x 256: spider_compiled under --compile_mode reduce-overhead (CUDA graphs per layer call)
# Commit the JSON files into bench/gpu_check_<gpu>.json's runs and the table into docs/results.md.
set -u
OUT=${OUT:?the device tool sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
export TORCHINDUCTOR_CACHE_DIR=/tmp/spider-inductor-cache
rm -rf "$TORCHINDUCTOR_CACHE_DIR"
G="python3 -m bench.gpu_check --only step_table --step_repeats 3"
run() {  # name seconds args...
  local name=$1 seconds=$2; shift 2
  timeout "$seconds" $G --budget_s $((seconds - 10)) --part_cap step_table=$((seconds - 10)) "$@" \
    --out "$OUT/$name.json" 2> "$OUT/$name.err"
  echo "$name: exit $?"
}
run cold 150 --step_table_shapes 8x2048 --step_table_models spider_compiled
run warm 70 --step_table_shapes 8x2048 --step_table_models spider_compiled
run small 150 --step_table_shapes 32x256 --step_table_models deepseek_v3 spider_compiled
run graphs 110 --step_table_shapes 32x256 --step_table_models spider_compiled --compile_mode reduce-overhead
