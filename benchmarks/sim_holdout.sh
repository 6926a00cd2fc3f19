#!/usr/bin/env bash
# Does `quanta simulate` predict the engine on workloads its profile was not fitted to?
# Fit on one set of server runs, check on others (quanta simulate --compare), default serve settings
# (batched, 8 slots, prefix cache on, --max-model-len 4096):
#   fit:   Mooncake window A (trace lines 0-63, lengths x1/32) at arrival gaps x4 and x2; the probe (3 decoding
#          sessions, one 2,048-word prompt) at mixed quantum 512
#   check: Mooncake window B (trace lines 150-213) at gaps x4 and x2; the probe at mixed quanta 128 and 2048
#   replicas (PART=all or replicas): 2 replicas on a local Ray (quanta serve --replicas 2, one CPU each): the
#          replica profile is fitted to each replica's own step trace of window A under round-robin routing,
#          a second one to window A under prefix routing (--also-profile), and both are checked on window B
#          under prefix routing (gaps x4)
#   long contexts (PART=all or long, after single): a second profile fitted to single's fitting runs and a
#          probe with a 6,000-word prompt that then decodes 64 tokens (contexts to ~7.8k), checked on the
#          recorded codex and opencode sessions (benchmarks/data/agent_sessions: 9.3k- and 7.8k-token prompts)
#          and on a probe with a 12,000-word prompt (~15.6k tokens)
# The probe's sessions decode for 3 s before and after its prompt (--probe-delay 3): with the default 1 s
# they make ~570 gaps, of which 6 are the prompt's two stalls, so their p99 falls between the 6th and 7th
# largest gap and moves with (gaps - 1) mod 100, i.e. with the decode step's speed; at 3 s (~1,400 gaps)
# it is the decode steps' own tail.
# A shared machine's speed drifts by 10-25% over tens of minutes, so the workloads run in ROUNDS alternating
# rounds of one repeat each, and each workload's rounds are joined (benchmarks/merge_bench.py): fitted and
# checked runs sample the same stretch of time. A round runs its workloads in order in odd rounds and in
# reverse order in even ones (fit, check, check, fit, ...): a machine that slows down through the
# session would otherwise slow every checked run against its round's fitted one.
# Usage: QUANTA=.venv/bin/quanta [ROUNDS=3] [LONG_ROUNDS=2] [PART=single|replicas|long|all] bash benchmarks/sim_holdout.sh [OUT_PREFIX]
#        (single: about 20 minutes on a quiet 2-core machine; replicas: about 15 more; long: about 10 more)
set -euo pipefail
OUT=${1:-benchmarks/results/sim_holdout}
Q=${QUANTA:-quanta}
TRACE=benchmarks/traces/mooncake_conversation_head300.jsonl
SERVE="--max-num-seqs 8 --max-model-len 4096"
RDIR="${OUT}_rounds"  # each round's results; the joined ones are OUT_NAME.json
mkdir -p "$RDIR"
grep -o -w 'avx512[a-z_0-9]*\|avx2\|fma\|f16c' /proc/cpuinfo | sort -u | tr '\n' ' ' > "${OUT}_cpu_flags.txt"
sweep() {  # quanta bench sweep with what every run here shares
  $Q bench sweep --no-progress --no-plots --max-duration 600 --warmup 2 "$@"
}
window() {  # window OUT START SCALE REPEATS SERVE_FLAGS GRID TITLE
  sweep --grid "$6" --server-flags "$5" --workload trace --trace "$TRACE" --start "$2" --limit 64 \
    --length-scale 0.03125 --time-scale "$3" --repeats "$4" --out "$1" \
    --title "$7" --note "Mooncake conversation trace lines $2-$(($2 + 63)), lengths x1/32, arrival gaps x$3, for simulator validation."
}
probe() {  # probe OUT QUANTA REPEATS TITLE
  sweep --grid "--scheduler batched --mixed-prefill-quantum $2" --server-flags "$SERVE" --interleave \
    --workload probe --sessions 3 --prompt-words 16 --session-tokens 1024 --probe-words 2048 --max-tokens 4 \
    --probe-delay 3 --repeats "$3" --out "$1" --title "$4"
}

ROUNDS=${ROUNDS:-3}
LONG_ROUNDS=${LONG_ROUNDS:-2}
PY=$(dirname "$Q")/python
[ -x "$PY" ] || PY=python
pair() {  # pair ROUND FN...: the functions in order in odd rounds, in reverse order in even ones
  local r=$1; shift
  local fns=("$@") i
  if (( r % 2 )); then for i in "${fns[@]}"; do "$i"; done
  else for ((i = ${#fns[@]} - 1; i >= 0; i--)); do "${fns[i]}"; done; fi
}
join() {  # join NAME: RDIR/NAME_r1.json ... -> OUT_NAME.json
  local parts=()
  for r in $(seq 1 "$ROUNDS"); do parts+=("$RDIR/${1}_r$r.json"); done
  "$PY" benchmarks/merge_bench.py "${OUT}_$1.json" "${parts[@]}"
}
single() {
  for r in $(seq 1 "$ROUNDS"); do
    for s in 4 2; do
      fit() { window "$RDIR/fit_x${s}_r$r" 0 "$s" 1 "$SERVE" "--scheduler batched" "Mooncake window A, gaps x$s (fit)"; }
      check() { window "$RDIR/check_x${s}_r$r" 150 "$s" 1 "$SERVE" "--scheduler batched" "Mooncake window B, gaps x$s (check)"; }
      pair "$r" fit check
    done
    fit() { probe "$RDIR/fit_probe_r$r" 512 1 "probe at mixed quantum 512 (fit)"; }
    check() { probe "$RDIR/check_probe_r$r" 128,2048 1 "probe at mixed quanta 128 and 2048 (check)"; }
    pair "$r" fit check
  done
  for n in fit_x4 fit_x2 fit_probe check_x4 check_x2 check_probe; do join "$n"; done
  $Q profile-engine --from-bench "${OUT}_fit_x4.json" --from-bench "${OUT}_fit_x2.json" --from-bench "${OUT}_fit_probe.json" \
    --check-bench "${OUT}_check_x4.json" --check-bench "${OUT}_check_x2.json" --check-bench "${OUT}_check_probe.json" \
    --out "${OUT}_profile.json"
  $Q simulate --profile "${OUT}_profile.json" --draws 10 --compare "${OUT}_check_x4.json" --compare "${OUT}_check_x2.json" \
    --compare "${OUT}_check_probe.json" --title "quanta simulate vs the real server on workloads the profile was not fitted to (10 simulated draws per measured repeat)" \
    --out "$OUT"
}
replicas() {
  local cl="$SERVE --replicas 2"
  for r in $(seq 1 "$ROUNDS"); do
    fit() { window "$RDIR/rep_fit_r$r" 0 4 1 "$cl" "--routing round-robin" "2 replicas, Mooncake window A, gaps x4 (fit)"; }
    fit_prefix() { window "$RDIR/rep_fit_prefix_r$r" 0 4 1 "$cl" "--routing prefix" "2 replicas, Mooncake window A, gaps x4, prefix routing (fit)"; }
    check() { window "$RDIR/rep_check_r$r" 150 4 1 "$cl" "--routing prefix" "2 replicas, Mooncake window B, gaps x4 (check)"; }
    pair "$r" fit fit_prefix check
  done
  join rep_fit
  join rep_fit_prefix
  join rep_check
  $Q profile-engine --from-bench "${OUT}_rep_fit.json" --out "${OUT}_rep_profile.json"
  $Q profile-engine --from-bench "${OUT}_rep_fit_prefix.json" --out "${OUT}_rep_profile_prefix.json"
  $Q simulate --profile "${OUT}_rep_profile.json" --also-profile "${OUT}_rep_profile_prefix.json" --draws 10 \
    --compare "${OUT}_rep_check.json" \
    --title "quanta simulate vs 2 real replicas on a window the replica profile was not fitted to (10 simulated draws per measured repeat)" \
    --out "${OUT}_rep"
}
LONG_SERVE="--max-model-len 17664"
long_probe() {  # long_probe OUT WORDS TITLE: the probe with a long prompt that then decodes 64 tokens
  sweep --grid "--scheduler batched --mixed-prefill-quantum 2048" --server-flags "--max-num-seqs 8 $LONG_SERVE" \
    --workload probe --sessions 3 --prompt-words 16 --session-tokens 1024 --probe-words "$2" --max-tokens 64 \
    --repeats 1 --request-timeout 600 --out "$1" --title "$3"
}
long() {  # needs single's fitting runs; the long probes and the sessions alternate round by round as single's do
  for r in $(seq 1 "$LONG_ROUNDS"); do
    long_probe "$RDIR/fit_long_r$r" 6000 "probe with a 6,000-word prompt (fit, long contexts)"
    long_probe "$RDIR/check_long16k_r$r" 12000 "probe with a 12,000-word prompt (check, long contexts)"
    for s in codex opencode; do
      sweep --grid "--scheduler batched" --server-flags "$LONG_SERVE" --workload sessions \
        --sessions-file "benchmarks/data/agent_sessions/$s.jsonl" --endpoint chat --repeats 1 --request-timeout 900 \
        --out "$RDIR/sessions_${s}_r$r" --title "agent sessions $s, for simulator validation"
    done
  done
  for n in fit_long check_long16k sessions_codex sessions_opencode; do ROUNDS=$LONG_ROUNDS join "$n"; done
  $Q profile-engine --from-bench "${OUT}_fit_x4.json" --from-bench "${OUT}_fit_x2.json" --from-bench "${OUT}_fit_probe.json" \
    --from-bench "${OUT}_fit_long.json" --check-bench "${OUT}_sessions_codex.json" \
    --check-bench "${OUT}_sessions_opencode.json" --check-bench "${OUT}_check_long16k.json" --out "${OUT}_profile_long.json"
  $Q simulate --profile "${OUT}_profile_long.json" --also-profile "${OUT}_profile.json" --draws 10 \
    --compare "${OUT}_sessions_codex.json" --compare "${OUT}_sessions_opencode.json" --compare "${OUT}_check_long16k.json" \
    --title "quanta simulate vs recorded agent sessions replayed (prompts of 7.8k and 9.3k tokens) and a 15.6k-token probe" \
    --out "${OUT}_sessions"
}
case "${PART:-single}" in
  single) single ;;
  replicas) replicas ;;
  long) long ;;
  all) single; replicas; long ;;
  *) echo "PART must be single, replicas, long or all" >&2; exit 2 ;;
esac
