"""Reproduce benchmarks/results/moe_profile_seed-moe-mini.{md,json,png}.

Makes the synthetic ``seed-moe-mini`` preset (random weights, the seed's
routing proportions: 256 routed experts, 6 per token, 1 shared) in a
temporary directory and measures pure prefill cost per token against the
quantum 128 ... 8192 with 5 interleaved repeats and one torch thread (a
2-core machine shared with other work; one thread is what keeps oneDNN's
workers from spinning against other processes). About 6 minutes here.

    .venv/bin/python benchmarks/moe_profile.py [extra quanta profile flags]
"""

from __future__ import annotations

import sys

from quanta.cli import main

if __name__ == "__main__":
    sys.exit(main(["profile", "moe", "--threads", "1", "--repeats", "5", "--out", "benchmarks/results", *sys.argv[1:]]))
