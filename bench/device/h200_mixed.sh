#!/usr/bin/env bash
# Mixed steps from CUDA graphs on the H200 (device tool), each part packed into one file of $OUT
# as it ends (a run cut short still returns what finished):
#   1. tests.tgz    the GPU tests of graphs against eager steps (tiny model)
#   2. mixed.tgz    bench/engine/mixed_step.py: 64 decode rows beside 0-1,024 prompt tokens, base,
#                   one and 32 rank-16 adapters (DISTINCTS), eager against graph (7B shape, 32
#                   layers); one adapter: long segments, where a mixed graph's padded segment
#                   count makes SGMV take its fused kernel and an eager step the split one
#   3. resident-*.tgz  bench/device/h200_serve.sh resident (closed loop and the prefill burst),
#                   for each EXTRA of CAPS (worker flags; "-" for none)
#   4. split.tgz    (PARTS=split) LORAFLEET_SPLIT_ATTENTION 0 against 1, interleaved, twice
# PARTS (default "tests mixed resident") picks which run. Carry .whl, services/common/gen and
# tmp/kcache (KCACHE as h200_serve.sh takes it).
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/tmp/triton-cache}
O=${OUT:-bench/results}; T=$PWD/tmp/mixed-run; mkdir -p "$T" "$TRITON_CACHE_DIR"
if [ -n "${KCACHE:-}" ] && [ -z "$(ls -A "$TRITON_CACHE_DIR")" ]; then
  cat "$KCACHE".part-* | tar xz -C "$TRITON_CACHE_DIR"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  2>/dev/null
export PYTHONPATH=/tmp/site
pack() { tar czf "$O/$1.tgz" -C "$2" . && rm -rf "$2"; ls -la "$O"; }
PARTS=${PARTS:-tests mixed resident}
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
if has tests; then
mkdir -p "$T/tests"
timeout "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k \
  "mixed_steps or graphs_match_eager or overlapped or sampling_params or greedy_matches" 2>&1 |
  tee "$T/tests/pytest.txt" | tail -25
pack tests "$T/tests"
fi
if has mixed; then
mkdir -p "$T/mixed"
timeout "${BENCH_S:-150}" python3 -m bench.engine.mixed_step --layers 32 --decode 64 \
  --chunks 0,64,128,256,512,1024 --distincts ${DISTINCTS:-0,1,32} --out "$T/mixed" --name mixed-step-h200 \
  ${COMMIT:+--commit "$COMMIT"} 2>&1 | grep -v -i warn | tail -20
pack mixed "$T/mixed"
fi
if has split; then                     # LORAFLEET_SPLIT_ATTENTION A/B, interleaved, twice
mkdir -p "$T/split"
for i in 1 2; do for S in 0 1; do
  LORAFLEET_SPLIT_ATTENTION=$S timeout "${BENCH_S:-150}" python3 -m bench.engine.mixed_step \
    --layers 32 --decode 64 --chunks 0,64,128,256 --distincts 0,32 --out "$T/split" \
    --name "mixed-step-split$S-run$i-h200" ${COMMIT:+--commit "$COMMIT"} 2>&1 | grep --line-buffered "graph:"
done; done
pack split "$T/split"
fi
has resident || exit 0
for C in ${CAPS:--}; do
  N=resident-${C//[^0-9a-z]/}; mkdir -p "$T/$N"
  X=""; [ "$C" != - ] && X="--worker-flag=$C"
  OUT="$T/$N" EXTRA="$X" BUDGET=${SERVE_S:-140} bash bench/device/h200_serve.sh resident 2>&1 |
    grep --line-buffered -E "^(resident|prefill|- prefill|worker: SERV|===)" 
  pack "$N" "$T/$N"
done
