#!/usr/bin/env bash
# The GPU checks and benchmarks, as run on the H200 through the device tool (results in $OUT),
# from the repository's root as `bash bench/device/h200_run.sh MODE`, MODE one of:
#   quick       smoke: GPU tests + small benchmark shapes
#   full        the benchmarks of bench/results/*-h200.* (the default for any other MODE)
#   check       GPU tests, a decode profile, batch-64 end to end
#   final       GPU tests, end to end with PEFT, kernels vs vLLM
#   gemm        decode GEMM layouts (more args passed to it: --model gemma-3-12b --name NAME),
#               then batch-64 end to end
#   sweep       SGMV tile sweep (python -m bench.kernels.sgmv_sweep; more args passed to it)
#   ab-kernels  GPU tests, decode kernel shapes with and without PDL
#   ab-e2e      batch 64 end to end: PDL on/off, weight layouts (or the variants of $2)
#   ab-build    OLD=tmp/ab-old: an older build against this one
#   fp8gemm     issue 46: the FP8 GEMM's GPU tests, then its microbenchmark (7B/8B/70B decode
#               GEMMs against _scaled_mm and bf16; more args passed to it), ~3 min on an H100
#   fp8sweep    the FP8 GEMM's config sweep (default --models 7b; more args passed to it)
#   fp8         issue 46: the 7B decode step, bf16 against FP8 weights, base and 32 adapters
#               (python -m bench.engine.fp8; more args passed to it, e.g. --models llama-70b on
#               an H200 with FP8_S=420), then the FP8 GEMM's microbenchmark, ~6 min
#   families    issue 47: the families' GPU test, then Qwen3-8B and Gemma-3-12B at full size
#               (python -m bench.engine.families, one process a model; Gemma's with --profile),
#               then decode attention's launch scan at both models' heads, ~7 min on an H100
#               (MODELS="gemma-3-12b" HEADS=16:2:256: Gemma's alone; TEST_LAST=S: the test last,
#               S seconds at most)
#   structured  issue 45: batch-64 decode steps with 0 / 50 / 100% of rows under a JSON schema
#               (needs the wheels in .whl, llguidance's among them: README, the device notes)
# Needs models/ (make model), .whl (carried: llguidance's wheel) and, for the vLLM side of the
# kernel bench, .peers/vllm_lora_ops.
set -u
MODE=${1:-quick}
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/tmp/triton-cache}  # kept between warm calls
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" \
  | tee -a "$OUT/gpu.txt"
step() {   # the last line names the command: its first two words, three for python3 -m MODULE
  echo "=== $*"; local t=$SECONDS; "$@"; local rc=$? what="$1 $2"
  [ "$2" = -m ] && what="$what $3"
  echo "=== rc=$rc in $((SECONDS - t))s: $what"; }
# the worker's factory imports llguidance (structured outputs), which the image lacks: its wheel
# from .whl (carried) wherever the engine is built
if ls .whl/llguidance*.whl >/dev/null 2>&1 && ! python3 -c "import llguidance" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-llg \
    .whl/llguidance*.whl && export PYTHONPATH=/tmp/site-llg${PYTHONPATH:+:$PYTHONPATH}
fi
VLLM=()
[ -d .peers/vllm_lora_ops ] && VLLM=(--vllm-src .peers/vllm_lora_ops)
if [ "$MODE" = final ]; then
  step timeout 200 python3 -m pytest -q --tb=line -p no:cacheprovider -m gpu tests/test_gpu.py \
       tests/test_pdl.py tests/test_sgmv_split.py tests/test_sgmv.py 2>&1 | tail -8
  step python3 -m bench.engine.e2e --out "$OUT" 2>&1 | tail -30
  step python3 -m bench.kernels.sgmv "${VLLM[@]}" --budget-s 200 --out "$OUT" 2>&1 | tail -40
elif [ "$MODE" = check ]; then
  step timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_sgmv.py \
       tests/test_sgmv_split.py tests/test_gpu.py 2>&1 | tail -15
  step python3 -m bench.engine.profile_decode --layers 4 --batch 64 --distinct 32 2>&1 | tail -32
  step python3 -m bench.engine.e2e --no-peft --batches 64 --distincts 1,32 --new 64 \
       --out "$OUT/e2e" 2>&1 | tail -12
elif [ "$MODE" = gemm ]; then
  step python3 -m bench.kernels.gemm_layouts --out "$OUT" "${@:2}" 2>&1 | tail -70
  step python3 -m bench.engine.e2e --no-peft --batches 64 --distincts 1,32 --new 64 \
       --out "$OUT/e2e" 2>&1 | tail -12
elif [ "$MODE" = ab-kernels ]; then
  step timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
       tests/test_sgmv_split.py tests/test_sgmv.py tests/test_attention.py tests/test_pdl.py \
       2>&1 | tail -8
  step python3 -m bench.kernels.sgmv "${VLLM[@]}" --shapes \
       16:1:1,16:16:8,16:64:8,16:64:32,16:256:8,16:256:32,64:16:8,64:64:8,64:256:8,64:256:32 \
       --out "$OUT/kernels" 2>&1 | tail -14
elif [ "$MODE" = ab-e2e ]; then
  step python3 -m bench.engine.e2e --no-peft --no-waited --batches 64 --distincts 1,32 \
       --new 64 --variants "${2:-;pdl=0;pdl=0,layout=nk}" --out "$OUT/e2e" 2>&1 | tail -16
elif [ "$MODE" = ab-build ]; then   # an older build (OLD: its tree, e.g. from `git archive`)
  # against this one, interleaved, batch 64 with 32 adapters (issue 24), then this build with
  # logprobs off and on (issue 25); prepare OLD here: see bench/PERF_NOTES.md, Next on the card
  cp -r services/common/gen "$OLD/services/common/" 2>/dev/null
  E2E=(--no-peft --no-waited --batches 64 --distincts 32 --new 64)
  # OLD's e2e bench: the module, or the flat script of a tree from before bench/engine/
  OLD_E2E="python3 -m bench.engine.e2e"
  [ -f "$OLD/bench/e2e_gpu_bench.py" ] && OLD_E2E="python3 bench/e2e_gpu_bench.py"
  for i in 1 2; do
    step bash -c "cd '$OLD' && $OLD_E2E ${E2E[*]} --out '$OUT/ab-old-$i'" \
         2>&1 | tail -6
    step python3 -m bench.engine.e2e "${E2E[@]}" --out "$OUT/ab-new-$i" 2>&1 | tail -6
  done
  step python3 -m bench.engine.e2e "${E2E[@]}" --variants ";logprobs=5" \
       --out "$OUT/ab-logprobs" 2>&1 | tail -8
elif [ "$MODE" = structured ]; then       # llguidance is not in the device image: .whl's
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site
  step python3 -m bench.engine.structured --out "$OUT" 2>&1 | tail -25
elif [ "$MODE" = fp8gemm ]; then
  step timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_gemm.py \
       2>&1 | tail -15
  step python3 -m bench.kernels.fp8_gemm --out "$OUT" "${@:2}" 2>&1 | tail -70
elif [ "$MODE" = fp8 ]; then
  step timeout "${FP8_S:-300}" python3 -m bench.engine.fp8 --out "$OUT" "${@:2}" 2>&1 | tail -14
  step timeout 240 python3 -m bench.kernels.fp8_gemm --out "$OUT" 2>&1 | tail -40
elif [ "$MODE" = families ]; then
  [ -z "${TEST_LAST:-}" ] && step timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
       tests/test_gpu_families.py -o addopts="" 2>&1 | tail -12
  for m in ${MODELS:-qwen3-8b gemma-3-12b}; do     # Gemma's kernels by GPU time: $OUT/gemma-3-12b/profile-*
    PROF=(); [ "$m" = gemma-3-12b ] && PROF=(--profile)
    step timeout 240 python3 -m bench.engine.families --models "$m" "${PROF[@]}" --out "$OUT/$m" \
         2>&1 | tail -8
  done                                 # decode attention's launches at Gemma's and Qwen3's heads
  SCAN="16,1,2;32,4,2;32,2,2;64,4,2;32,8,2;64,8,2;16,1,2,4;32,4,2,2;32,4,2,4;64,4,2,4"
  for hd in ${HEADS:-16:2:256 32:4:128}; do IFS=: read -r hq g d <<< "$hd"
    step timeout 150 python3 -m bench.kernels.attn_launch_scan --out "$OUT/scan" --q-heads "$hq" \
         --groups "$g" --head-dim "$d" --batches 64 --ctxs 192,1024 --configs "$SCAN" 2>&1 | tail -5
  done
  [ -n "${TEST_LAST:-}" ] && step timeout "$TEST_LAST" python3 -m pytest -q -p no:cacheprovider \
       -m gpu tests/test_gpu_families.py -o addopts="" 2>&1 | tail -12
elif [ "$MODE" = fp8sweep ]; then
  step python3 -m bench.kernels.fp8_gemm --sweep --models 7b --budget-s 480 --out "$OUT" \
       "${@:2}" 2>&1 | tail -50
elif [ "$MODE" = sweep ]; then
  step python3 -m bench.kernels.sgmv_sweep --out "$OUT" "${@:2}" 2>&1 | tail -60
elif [ "$MODE" = quick ]; then
  step python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_gpu.py tests/test_sgmv.py \
       tests/test_attention.py 2>&1 | tail -40
  step python3 -m bench.kernels.sgmv --quick "${VLLM[@]}" --out "$OUT" 2>&1 | tail -30
  step python3 -m bench.engine.e2e --quick --out "$OUT" 2>&1 | tail -30
  step python3 -m bench.stack.cold_load --gpu --counts 10,100 --reps 20 --out "$OUT" 2>&1 | tail -20
else
  step python3 -m bench.kernels.sgmv "${VLLM[@]}" --out "$OUT" 2>&1 | tail -60
  step python3 -m bench.engine.e2e --out "$OUT" 2>&1 | tail -40
  step python3 -m bench.stack.cold_load --gpu --counts 10,100,1000 --reps 50 --out "$OUT" 2>&1 | tail -20
fi
