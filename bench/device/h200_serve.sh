#!/usr/bin/env bash
# The serving benchmark on the H200 through the device tool (results in $OUT, plots drawn later
# with `python -m bench.serve.bench --replot OUT/serve-h200.json` where matplotlib is), run from
# the repository's root as `bash bench/device/h200_serve.sh MODE`, MODE one of:
#   check      the cold path's GPU tests (SKIP_TESTS=1: not), then the resident, cold and engine
#              suites (32 + 64 rank-16 adapters; SUITE= picks; REPEAT=N: N stacks in turn)
#   slora      the S-LoRA sweep: 5, 100, 1,000, 2,000 rank-8 adapters
#   startup    start-up on an empty and a warm kernel cache, compiles after SERVING, first and
#              second run (python -m bench.stack.startup)
#   latency    open loop at 20-100% of saturation, base and 32 adapters, and a prefill burst of
#              64 long prompts
#   resident   the resident suite and the prefill burst (THEN_TEST=S: the no-compile test after)
#   eviction   --eviction lru against cost at 1,000 and 2,000 adapters
#   saturation issue 42: goodput, closed loops at 64 / 128 streams and open-loop latency for
#              base, 5 .. 2,000 Zipf, 32 resident and mixed-rank adapters in one run and one
#              device call: bench/results/saturation-<card>.{json,md,png} (below)
#   record     all of it in one run: bench/results/serve-h200.*, with the engine in-process on
#              the resident and base/5-adapter cases
#   two-gpu    issue 28 on nvidia-h200-x2: 1,000 rank-8 adapters, Zipf 1.0, one worker then two
#              (cuda:0, cuda:1), the same requests (open loop at RATE, closed loop at CONC per
#              worker), then worker 1 SIGKILLed mid-run and restarted; merged into
#              bench/results/serve-2gpu-h200.{json,md}. PART=w1|w2|kill|merge runs one step (one
#              device call each); QUICK=1: the same on the CPU, tiny model, both workers on the
#              CPU; ONE_GPU=1: both workers on one GPU, halved budgets
#   fp8-served issue 46: a bf16 stack then a --quantization fp8 one (base and 32 resident
#              adapters, closed loop at 64 streams, a short goodput search), then the in-process
#              FP8 rows with both stacks' closed loops beside them: OUT/fp8-<card>.{json,md}
#              (STACKS="auto fp8 fp8+kv8": a third stack with an e4m3 KV cache)
#   first-touch issue 43 (python -m bench.serve.first_touch): 32 never-used rank-16 adapters at
#              once and 16 one at a time beside 64 decoding base streams (and those alone),
#              source-tier loads under Zipf churn over 1,000 rank-8 adapters, a fresh worker's
#              start and first run: bench/results/first-touch-<card>.{json,md}. PART=stack (burst,
#              one, churn in one stack: ~2 min on an H100 with KCACHE=, ~5 min on an empty
#              kernel cache; +1-2 min writing the checkpoint and adapters on a fresh machine) |
#              start (bench.stack.startup, empty then warm kernel cache: ~4-5 min) | all (both in
#              one call: only where the checkpoint is written and the empty-cache start is
#              short) | merge (OUT/first-touch-parts/*.json: the part files of both calls
#              gathered in one OUT, e.g. here after fetching them); QUICK=1: the CPU run, tiny
#              model (~1 min); FT_EXTRA= more flags
# PACK=1: everything in OUT as one results.tgz; SAVE_KCACHE=1: the kernel cache the run left, in
# 15 MiB parts (carry them as tmp/kcache and pass KCACHE=tmp/kcache/triton-cache.tgz).
# Needs the wheels the services import that the image lacks in .whl (`bash
# bench/device/wheels.sh` here makes it) and the generated stubs (services/common/gen, carried). The checkpoint, adapters and
# Triton's cache live under tmp/ and are reused while the machine stays warm.
set -u
MODE=${1:-check}
OUT=${OUT:-bench/results}
WORK=${WORK:-$PWD/tmp/serve-work}
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/tmp/triton-cache}
mkdir -p "$OUT" "$WORK" "$TRITON_CACHE_DIR"
# A Triton cache from an earlier machine (KCACHE=path of a tgz made below, carried), so a
# fresh machine does not compile for two minutes first
# (KCACHE: a tgz, or the stem of its parts STEM.part-aa, -ab, ...)
if [ -n "${KCACHE:-}" ] && [ -z "$(ls -A "$TRITON_CACHE_DIR")" ]; then
  if [ -f "$KCACHE" ]; then tar xzf "$KCACHE" -C "$TRITON_CACHE_DIR"
  else cat "$KCACHE".part-* | tar xz -C "$TRITON_CACHE_DIR"; fi
  echo "triton cache: $(du -sh "$TRITON_CACHE_DIR")"
fi
if [ -d .whl ] && [ -z "${QUICK:-}" ]; then   # the device image's wheels (cp312), not the CPU run's
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# the services import with these wheels (the stubs refuse an older grpcio) and llguidance is
# new enough: seconds here, instead of a worker start that dies minutes into the call
# (the store apart: its metrics share names with the worker's)
python3 -c 'import services.adapter_store.__main__' || exit 1
python3 -c 'import importlib.metadata as md, services.router.__main__, services.worker.__main__
from services.worker.api.grammar import check_llguidance
check_llguidance()
print("preflight: the services import; grpcio", md.version("grpcio"), "llguidance",
      md.version("llguidance"))' || exit 1
[ -z "${QUICK:-}" ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
df -h "$WORK" /dev/shm | tail -2
step() { echo "=== $*"; local t=$SECONDS; "$@"; echo "=== rc=$? in $((SECONDS - t))s"; }
GPU=(--shape 7b --device cuda --work "$WORK" --gpu-pool-bytes 4GiB --kv-cache-bytes 40GiB
     --max-running 256 --max-batch-tokens 4096 --host-pool-bytes 8GiB --store-host-bytes 16GiB
     --max-in-flight-per-worker 256 --pool-slots 512 --clients 4 --out "$OUT"
     --worker-flag=--precompile-procs=${PROCS:-8}
     ${COMMIT:+--commit "$COMMIT"} ${EXTRA:-})   # COMMIT=$(git rev-parse --short HEAD) here
if [ "$MODE" = check ]; then
  [ -z "${SKIP_TESTS:-}" ] && step timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
       tests/test_adapter_scatter.py \
       "tests/test_gpu.py::test_a_cuda_pool_places_adapters_as_the_cpu_pool_does" 2>&1 | tail -4
  for i in $(seq "${REPEAT:-1}"); do     # REPEAT=2: a second stack on the warm kernel cache
    step timeout "${BUDGET:-420}" python3 -m bench.serve.bench "${GPU[@]}" \
         --suite "${SUITE:-resident,cold,engine}" \
         --rate "${RATE:-40}" --cold-rate 4 --cold-requests 32 --requests 400 --warmup 64 \
         --name "serve-h200-check$([ "$i" -gt 1 ] && echo "-$i")"
  done
elif [ "$MODE" = record ]; then
  R=${RATE:-58}                     # 90% of the base model's closed-loop 65.3-65.8 req/s
  OL="rank=8,zipf=1.0,rate=$R,requests=500,warmup=64,path=engine"
  step timeout "${BUDGET:-570}" python3 -m bench.serve.bench "${GPU[@]}" \
       --suite slora,resident,cold,engine --rate "$R" --steady-rate "${STEADY:-40}" \
       --cold-rate 4 --cold-requests 32 \
       --requests 500 --warmup 64 --name serve-h200 --scenarios \
       "slora-base-engine:adapters=0,$OL,twin=slora-base;slora-5-engine:adapters=5,$OL,twin=slora-5"
elif [ "$MODE" = startup ]; then        # issue 23: bench/results/startup-h200.*
  step timeout "${BUDGET:-560}" python3 -m bench.stack.startup "${GPU[@]}" --name startup-h200
  [ -z "${SKIP_TEST:-}" ] && step timeout 900 python3 -m pytest -q -p no:cacheprovider -m gpu \
       "tests/test_gpu.py::test_no_kernel_compiles_or_graph_captures_after_serving" 2>&1 | tail -5
elif [ "$MODE" = latency ]; then        # issue 23: bench/results/latency-h200.*
  step timeout "${BUDGET:-560}" python3 -m bench.serve.bench "${GPU[@]}" --suite latency \
       --requests "${REQUESTS:-400}" --warmup 64 --name latency-h200
elif [ "$MODE" = resident ]; then       # the resident suite alone (closed loop, base and 32)
  step timeout "${BUDGET:-300}" python3 -m bench.serve.bench "${GPU[@]}" --suite resident \
       --worker-flag=--warmup-max-rank=${WARMUP_MAX_RANK:-64} \
       --requests "${REQUESTS:-500}" --warmup 64 --name serve-h200-resident --scenarios \
       "prefill_burst:adapters=32,rank=16,zipf=1.0,rate=${BURST_RATE:-33},burst=64,burst_prompt=1024"
  [ -n "${THEN_TEST:-}" ] && step timeout "$THEN_TEST" python3 -m pytest -q -p no:cacheprovider \
       -m gpu "tests/test_gpu.py::test_no_kernel_compiles_or_graph_captures_after_serving" \
       2>&1 | tail -30
elif [ "$MODE" = eviction ]; then       # issue 27: cost-aware eviction against LRU, the same
  # trace (1,000 and 2,000 rank-8 adapters, Zipf 1.0), one stack each, LRU first
  for E in lru cost; do
    step timeout "${BUDGET:-270}" python3 -m bench.serve.bench "${GPU[@]}" --eviction "$E" \
         --suite none --rate "${RATE:-58}" --requests "${REQUESTS:-400}" --warmup 64 \
         --name "serve-h200-eviction-$E" --scenarios \
         "slora-1000:adapters=1000,rank=8,zipf=1.0,rate=${RATE:-58};$(
         )slora-2000:adapters=2000,rank=8,zipf=1.0,rate=${RATE:-58}"
  done
elif [ "$MODE" = two-gpu ]; then       # issue 28: bench/results/serve-2gpu-h200.*
  PART=${PART:-all}; NAME=${NAME:-serve-2gpu-h200}; TMPO=$OUT/2gpu-parts; mkdir -p "$TMPO"
  if [ -n "${QUICK:-}" ]; then           # the CPU dry run: both workers on the CPU, halved pools
    NAME=${NAME/h200/cpu}; BASE=(--quick --work "$WORK" --out "$TMPO" ${COMMIT:+--commit "$COMMIT"})
    N=${ADAPTERS:-16}; R=${RATE:-30}; C=${CONC:-4}; REQ=${REQUESTS:-200}
    SHAPE="prompt=8:16,output=16:32,warmup=8"; KREQ=${KILL_REQUESTS:-300}; KAT=${KILL_AT:-3}
    TWO=(--workers 2)
  else
    BASE=("${GPU[@]}" --out "$TMPO" --clients "${CLIENTS:-8}")   # later flags win
    N=${ADAPTERS:-1000}; R=${RATE:-110}; C=${CONC:-128}; REQ=${REQUESTS:-1500}
    SHAPE="warmup=64"; KREQ=${KILL_REQUESTS:-8000}; KAT=${KILL_AT:-20}
    # ONE_GPU=1: the dry run on a one-GPU kind, both workers on it with halved budgets
    if [ -n "${ONE_GPU:-}" ]; then TWO=(--workers 2); NAME=${NAME/h200/dryrun-1gpu}
    else TWO=(--workers 2 --devices cuda:0,cuda:1); fi
  fi
  SC="adapters=$N,rank=8,zipf=1.0,requests=$REQ,$SHAPE"
  # the same scenario names and seed in both runs: the same requests; the closed loop keeps
  # CONC rows in flight per worker (capacity), the open loop offers RATE req/s to both
  fleet() { echo "fleet-open:$SC,rate=$R;fleet-closed:$SC,concurrency=$(($C * $1))"; }
  case $PART in all|w1) step timeout "${BUDGET:-570}" python3 -m bench.serve.bench "${BASE[@]}" \
       --suite none --scenarios "$(fleet 1)" --name 2gpu-w1 ;; esac
  case $PART in all|w2) step timeout "${BUDGET:-570}" python3 -m bench.serve.bench "${BASE[@]}" \
       "${TWO[@]}" --suite none --scenarios "$(fleet 2)" --name 2gpu-w2 ;; esac
  case $PART in all|kill) step timeout "${BUDGET:-570}" python3 -m bench.serve.bench "${BASE[@]}" \
       "${TWO[@]}" --suite none --name 2gpu-kill --scenarios \
       "fleet-kill:adapters=$N,rank=8,zipf=1.0,rate=${KILL_RATE:-$R},requests=$KREQ,$SHAPE,$(
       )kill_at=$KAT,kill_worker=1" ;; esac
  case $PART in all|merge) python3 -m bench.serve.merge --out "$OUT" --name "$NAME" \
       "$TMPO"/2gpu-w1.json "$TMPO"/2gpu-w2.json "$TMPO"/2gpu-kill.json ;; esac
elif [ "$MODE" = first-touch ]; then   # issue 43: bench/results/first-touch-<card>.*
  PART=${PART:-stack}; TMPO=$OUT/first-touch-parts
  if [ -n "${QUICK:-}" ]; then FT=(--quick --work "$WORK" --out "$OUT" ${COMMIT:+--commit "$COMMIT"})
  else FT=("${GPU[@]}"); fi
  case $PART in stack) P=burst,one,churn ;; start) P=start ;; all) P=burst,one,churn,start ;;
       merge) P= ;; *) echo "PART=$PART: stack, start, all or merge"; exit 2 ;; esac
  if [ -n "$P" ]; then step timeout "${BUDGET:-570}" python3 -m bench.serve.first_touch \
       "${FT[@]}" --parts "$P" ${FT_EXTRA:-}
  else python3 -m bench.serve.first_touch --merge "$TMPO"/*.json --out "$OUT"; fi
elif [ "$MODE" = saturation ]; then    # issue 42: bench/results/saturation-<card>.*
  # One stack, one run, one device call (run's timeout_s 600): the suite stops starting parts
  # DEADLINE s after its own start and writes what it has, the header naming what it skipped.
  # Expected (H100 / H200, base ~65-75 req/s at 128/128 tokens, a request ~1-2 s):
  #   wheels, nvidia-smi                                                          ~15 s
  #   a fresh machine writes the 7B checkpoint (13.5 GB) and the adapters: 2,000 of rank 8 and
  #     70 each of rank 16, 32, 64 (~50 GB; the mixed set shrinks if the disk is short) 60-120 s
  #   start to SERVING on a warm kernel cache (KCACHE=...; an empty one adds 1-4 min) ~40 s
  #   a workload: warm-up (each adapter touched once, then 384 short Zipf requests)  5-15 s,
  #     closed 64 and 128 streams (3 rounds each: 192 + 384 requests)              ~10 s,
  #     goodput: 4 probes of 5 s of Poisson arrivals (+ ~2 s to drain each)        ~30 s,
  #     open loop at 25 / 50 / 75% of base goodput (5 s or 120 requests each)      ~20 s
  #   base 60, zipf-1000 cold (closed 64, first touches) 5, zipf-1000 75, resident-32 60,
  #     zipf-2000 50, mixed-280 50, zipf-5 40, zipf-100 45: ~385 s
  #   total ~500-560 s; on a slow start the deadline drops zipf-100, then zipf-5, first.
  # WORKLOADS=, COLD=, OPEN=, PROBE_S=, PROBES=, DEADLINE= override; SAT_EXTRA= more flags.
  step timeout "${BUDGET:-570}" python3 -m bench.serve.bench "${GPU[@]}" --suite saturation \
       --worker-flag=--warmup-max-rank=64 --deadline-s "${DEADLINE:-520}" \
       --probe-s "${PROBE_S:-5}" --max-probes "${PROBES:-4}" \
       ${WORKLOADS:+--sat-workloads "$WORKLOADS"} ${COLD:+--sat-cold "$COLD"} \
       ${OPEN:+--sat-open "$OPEN"} ${SAT_EXTRA:-}
elif [ "$MODE" = fp8-served ]; then   # issue 46: bf16 then FP8 stacks, one call
  # Each stack: base and 32 resident rank-16 adapters, closed loop at 64 streams and a short
  # goodput search (no cold or open rows); then the in-process step rows with every stack's
  # rows under "served": OUT/fp8-<card>.{json,md}. ~9 min on an H100 with KCACHE=.
  # STACKS: QUANTIZATION[+kv8] each (default "auto fp8"; "auto fp8 fp8+kv8": also FP8 weights
  # with an e4m3 KV cache, ~3 min more).
  files=()
  for S in ${STACKS:-auto fp8}; do
    Q=${S%%+*}; KV=auto; [ "$S" != "${S%+kv8}" ] && KV=fp8
    step timeout "${BUDGET:-200}" python3 -m bench.serve.bench "${GPU[@]}" \
         --suite saturation --sat-workloads resident:32 --sat-cold none --sat-open none \
         --streams 64 --max-probes "${PROBES:-2}" --worker-flag=--warmup-max-rank=64 \
         --worker-flag=--quantization=$Q --worker-flag=--kv-cache-dtype=$KV \
         --out "$OUT/served-${S/+/-}"
    files+=("$OUT/served-${S/+/-}"/saturation-*.json)
  done
  KVS=auto; [[ "${STACKS:-}" == *+kv8* ]] && KVS=auto,fp8
  step timeout "${FP8_S:-200}" python3 -m bench.engine.fp8 --quantizations auto,fp8 \
       --kv-cache-dtype "$KVS" --out "$OUT" --served "${files[@]}"
elif [ "$MODE" = slora ]; then
  step timeout "${BUDGET:-560}" python3 -m bench.serve.bench "${GPU[@]}" --suite "${SUITE:-slora}" \
       --rate "${RATE:-58}" --requests "${REQUESTS:-500}" --warmup 64 --name serve-h200-slora
fi
tar czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null
if [ -n "${SAVE_KCACHE:-}" ]; then      # in parts: a file back from the device is 16 MiB at most
  # the cache the last worker used: startup's --kernel-cache directory, else Triton's
  KDIR=$(ls -dt "$WORK"/kernel-cache-* 2>/dev/null | head -1)
  [ "$MODE" = startup ] && [ -n "$KDIR" ] || KDIR=$TRITON_CACHE_DIR
  tar czf - -C "$KDIR" . | split -b 15m - "$OUT/triton-cache.tgz.part-"
  du -ch "$OUT"/triton-cache.tgz.part-* | tail -1   # here: into tmp/kcache/, for KCACHE=
fi
if [ -n "${PACK:-}" ]; then              # one file back (a device call returns ~8 at most)
  tar czf /tmp/results.tgz -C "$OUT" --exclude='triton-cache.tgz.part-*' . &&
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name 'triton-cache.tgz.part-*' -exec rm -rf {} + &&
    mv /tmp/results.tgz "$OUT/"
fi
ls -la "$OUT"
