#!/usr/bin/env bash
# Validation of `quanta simulate` against the real engine on this machine (issue #6).
#   1. profile the executor in-process            (quanta profile-engine)
#   2. calibration runs over HTTP (quanta bench sweep), batched, poisson arrivals: four quanta on
#      200-word prompts, two on short prompts with long outputs (decode at short and long contexts),
#      two on 1000-word prompts (prefill chunks and positions as large as the probe's)
#   3. validation runs over HTTP: the seed 002 grid (scaled) and a probe sweep (quanta bench sweep)
#   4. fit a profile to the calibration runs' server trace (quanta profile-engine --from-bench)
#   5. simulate every validation condition with the fitted profile, and with the in-process one,
#      and compare with what was measured (quanta simulate --compare)
#   6. the KV pool: 4 slots in a 1,024-token budget with the prefix cache on (preemption, recompute and
#      a preempted prompt's own cached blocks), measured and simulated on the pool the server reported
# The calibration and validation runs share no condition and no workload.
# Usage: QUANTA=.venv/bin/quanta bash benchmarks/sim_validation.sh [OUT_PREFIX]
#        (about 20 minutes on a quiet 2-core machine; QUANTA defaults to the quanta on PATH)
#        PART=pool: step 6 alone, with the profiles an earlier full run left at OUT_PREFIX_profile*.json
set -euo pipefail
OUT=${1:-benchmarks/results/sim_validation}
Q=${QUANTA:-quanta}
NOTE="Simulator validation run: servers run with --no-prefix-cache (the prefix cache is validated by the pool step)."
sweep() {  # quanta bench sweep with what every run here shares
  $Q bench sweep --interleave --no-progress --max-duration 300 --note "$NOTE" "$@"
}
pool() {
  NOTE="Simulator validation of the KV block pool: a budget that holds 3 of the 4 slots' sequences."
  sweep --grid "--scheduler batched" --server-flags "--max-num-seqs 4 --max-model-len 1024 --kv-cache-tokens 1024" \
    --workload burst --num-requests 12 --prompt-words 200 --max-tokens 64 --repeats 2 --warmup 1 \
    --title "KV pool: 4 slots in a 1,024-token budget, for simulator validation" --out "${OUT}_pool"
  $Q simulate --profile "${OUT}_profile.json" --also-profile "${OUT}_profile_inprocess.json" --compare "${OUT}_pool.json" \
    --title "quanta simulate vs the real server on this machine: the KV block pool" --out "${OUT}_pool_compare"
}
if [ "${PART:-}" = pool ]; then pool; exit 0; fi

$Q profile-engine --out "${OUT}_profile_inprocess.json" --chunks 8,16,32,64,128,256,512,1024 --positions 0,512 \
  --batches 1,2,4,8 --decode-contexts 64,512 --repeats 5
calibrate() {  # calibrate SUFFIX TITLE "QUANTA..." WORKLOAD_FLAGS...: batched, pq = mpq = each quantum, Poisson
  local suffix=$1 title=$2 q grids=()
  for q in $3; do grids+=(--grid "--scheduler batched --prefill-quantum $q --mixed-prefill-quantum $q"); done
  shift 3
  sweep "${grids[@]}" --server-flags "--max-num-seqs 8 --max-model-len 2048 --no-prefix-cache" \
    --workload poisson --repeats 2 --warmup 1 --title "calibration runs for the simulator ($title)" \
    --out "${OUT}_calibration$suffix" "$@"
}

calibrate "" "batched, poisson arrivals" "16 64 256 1024" --rate 3 --num-requests 32 --prompt-words 200 --max-tokens 48
calibrate _short "batched, poisson arrivals, short prompts, long outputs" "16 256" \
  --rate 3 --num-requests 32 --prompt-words 24 --max-tokens 128
calibrate _long "batched, poisson arrivals, 1000-word prompts" "128 512" \
  --rate 0.5 --num-requests 8 --prompt-words 1000 --max-tokens 32
sweep --grid "--scheduler static" --grid "--scheduler continuous --admit-k 1,2,4,8" --grid "--scheduler chunked --chunk 8,16,32" \
  --server-flags "--max-num-seqs 8 --max-model-len 256 --no-prefix-cache" \
  --workload burst --num-requests 32 --prompt-words 32 --max-tokens 64 --repeats 3 --warmup 2 --baseline static \
  --title "seed 002 grid, scaled (32 requests on 8 slots), for simulator validation" --out "${OUT}_grid"
sweep --grid "--scheduler batched --mixed-prefill-quantum 32,128,512" \
  --server-flags "--max-num-seqs 4 --max-model-len 2048 --no-prefix-cache" \
  --workload probe --sessions 3 --prompt-words 16 --session-tokens 512 --probe-words 1024 --max-tokens 4 \
  --repeats 3 --warmup 1 \
  --title "probe: 3 decoding sessions + one 1024-word prompt, batched mixed quantum sweep, for simulator validation" \
  --out "${OUT}_probe"
$Q profile-engine --from-bench "${OUT}_calibration.json" --from-bench "${OUT}_calibration_short.json" \
  --from-bench "${OUT}_calibration_long.json" --out "${OUT}_profile.json"
$Q simulate --profile "${OUT}_profile.json" --also-profile "${OUT}_profile_inprocess.json" \
  --compare "${OUT}_grid.json" --compare "${OUT}_probe.json" \
  --title "quanta simulate vs the real server on this machine" --out "$OUT"
pool
