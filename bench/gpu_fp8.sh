#!/usr/bin/env bash
# Issue 64's GPU figures for FP8 per GEMM shape, in one device call of at most ~8 minutes.
# Prepared on a CPU; run it on one H100/H200 with the wheel folder of ../shared/gpu/wheels.sh carried as .whl:
#   device run, carry [".whl"], command: "bash bench/gpu_fp8.sh", timeout_s 560
# Each part writes its own JSON under $OUT as it goes (a part cut by its timeout keeps the rows it finished):
#   gemm.json     the FP8 GEMM table of the 1b preset at 8 x 2048, 32 x 256 and 112 x 256 bytes
#                 (spider-measure-fp8-gemms):
#                 copy its checks[0].fp8_gemm_table.gpus entry into spider_training/fp8_gemm_table.json
#   steps.json    1b, 8 x 2048: spider_compiled against spider_fp8_compiled (target: FP8 >= 1.10x the bf16 bytes/s,
#                 or no layer pays and --precision fp8 trains bf16); run it again after committing the table
set -u
OUT=${OUT:?the device tool sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/spider-inductor-cache
G="python3 -m bench.gpu_check --step_repeats 5"
run() {  # name seconds args...
  local name=$1 seconds=$2; shift 2
  timeout "$seconds" $G --budget_s $((seconds - 10)) "$@" --out "$OUT/$name.json" 2> "$OUT/$name.err"
  echo "$name: exit $?"
}
run gemm 260 --only fp8_gemm --part_cap fp8_gemm=250 --fp8_gemm_presets 1b
run steps 270 --only step_table --part_cap step_table=260 --step_table_shapes 8x2048 \
  --step_table_models spider_compiled spider_fp8_compiled
