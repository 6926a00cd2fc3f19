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

# torch reads THP_MEM_ALLOC_ENABLE at its first allocation: with it, every CPU buffer of 2 MiB or
# more is madvise(MADV_HUGEPAGE)d (which the kernel's transparent huge pages follow in their
# "madvise" mode; "always" gives them anyway, "never" none). A fresh buffer then faults in 2 MiB at a time, not 4 KiB (a prompt's
# activations are fresh buffers of tens of MiB each layer; on the 2-core dev VM a 4 KiB fault costs
# ~4 us: filling a new 64 MiB tensor 31-35 -> 7 ms), and the weights a decode step streams sit in
# huge pages (fewer TLB misses). Measured in-process on the 2-core AMD EPYC (avx2 fma f16c), a
# Llama-3.2-1B-shaped Q4_K_M GGUF, two runs each: a 1,000-token prefill 10.4-11.1 -> 9.8-10.1 s,
# decode 42.6-43.8 -> 35.7-38.5 ms a token. A value the user set (0 turns it off) wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# oneDNN reads ONEDNN_MAX_CPU_ISA at its first primitive: capped at AVX512_CORE_BF16, a host with AMX
# (Intel Sapphire Rapids and later: amx_bf16) runs bf16 linears on the AVX-512 bf16 kernels, not the AMX
# tile kernels. Those sum a row in an order that depends on how many rows the call has (on a 2-core Xeon
# VM with amx_bf16, a (576, 1536) weight: calls of 13-17 and 31 rows gave other bits than the same rows in
# a 300-row call), which breaks what tests/test_batch_invariance.py holds every kernel to: a prompt row's
# result does not depend on the rows beside it. Hosts below the cap (AVX2, AVX-512 without AMX) are not
# affected. A value the user set wins.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

__version__ = "0.1.0"
