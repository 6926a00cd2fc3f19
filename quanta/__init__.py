"""quanta: an LLM serving engine whose prefill/decode scheduling is visible and tunable."""

import os

# libgomp, torch's OpenMP runtime, reads GOMP_SPINCOUNT once, when torch loads it (so this
# works only if quanta is imported first, as the CLI does): its idle threads then spin 10,000
# times (tens of us) instead of 300,000 before they sleep, and stop taking the core that
# quanta's C kernels (pool.c) need right after a torch call. Measured in-process on the 2-core
# dev VM (AVX-512 + bf16, embedded model, benchmarks/engine_throughput.py's figures, medians of
# 3, two runs each, alternating): decode at 8 rows 451-532 -> 858-888 tok/s, 1 row 261-307 ->
# 312-318, 32 rows 839-913 -> 927-945; prefill unchanged (1,100-1,165 -> 1,118-1,171).
# A value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"
