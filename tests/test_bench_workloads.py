"""Length distributions, Mooncake trace replay and the request plan shared by bench and simulate."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from quanta.bench import lengths, mooncake
from quanta.bench.workloads import Workload, plan
from quanta.cli import main
from quanta.config import SchedulerConfig
from quanta.sim.profile import Profile
from quanta.sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "benchmarks" / "traces" / "mooncake_conversation_head300.jsonl"
SEED = ROOT / "profiles" / "ds4_m3_ultra_seed.json"


def _trace(tmp_path: Path, rows: list[dict], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


# --------------------------------------------------------------------------- lengths


def test_uniform_lengths_stay_in_vllms_range_and_cover_it():
    xs = lengths.draw("uniform:0.5", 100, 2000, seed=1, what="output")
    assert min(xs) >= 50 and max(xs) <= 150
    assert min(xs) < 55 and max(xs) > 145  # the whole range is used, not a fixed value
    assert xs == lengths.draw("uniform:0.5", 100, 2000, seed=1, what="output")
    assert xs != lengths.draw("uniform:0.5", 100, 2000, seed=2, what="output")
    assert xs != lengths.draw("uniform:0.5", 100, 2000, seed=1, what="prompt")


def test_lognormal_lengths_have_the_centre_as_median():
    xs = lengths.draw("lognormal:0.8", 200, 4001, seed=0, what="output")
    assert 180 <= statistics.median(xs) <= 220 and min(xs) >= 1 and max(xs) > 600


def test_empirical_lengths_come_from_the_file(tmp_path):
    f = tmp_path / "lens.txt"
    f.write_text("# measured\n7\n\n300\n12\n")
    xs = lengths.draw(f"file:{f}", 64, 500, seed=0, what="output")
    assert set(xs) == {7, 300, 12}
    j = tmp_path / "lens.json"
    j.write_text("[5, 6]")
    assert set(lengths.draw(f"file:{j}", 1, 100, 0, "prompt")) == {5, 6}


@pytest.mark.parametrize("spec, message", [
    ("gauss", "unknown length distribution"), ("uniform:1", "0 <= R < 1"), ("uniform:x", "needs a number"),
    ("lognormal:0", "positive sigma"), ("fixed:3", "takes no parameter"), ("file:/nonexistent/x", "cannot read"),
])
def test_bad_length_specs_are_refused(spec, message):
    with pytest.raises(lengths.LengthError, match=message):
        lengths.parse(spec)


def test_a_bad_lengths_file_names_its_line(tmp_path):
    f = tmp_path / "lens.txt"
    f.write_text("5\n0\n")
    with pytest.raises(lengths.LengthError, match="line 2: expected a positive integer"):
        lengths.parse(f"file:{f}")


def test_the_plan_draws_lengths_without_moving_arrivals():
    fixed = plan(Workload(kind="poisson", num_requests=50, rate=3.0, seed=4))
    varied = plan(Workload(kind="poisson", num_requests=50, rate=3.0, seed=4, output_dist="uniform:0.9", prompt_dist="lognormal:0.5"))
    assert [s.scheduled for s in fixed] == [s.scheduled for s in varied]
    assert {s.max_tokens for s in fixed} == {64} and len({s.max_tokens for s in varied}) > 10
    assert len({s.prompt_size for s in varied}) > 10
    eos = plan(Workload(num_requests=3, output_dist="eos"))
    assert all(not s.ignore_eos and s.max_tokens == 64 for s in eos)


def test_simulated_requests_carry_the_planned_lengths():
    w = Workload(kind="concurrency", num_requests=20, concurrency=4, prompt_words=40, max_tokens=30,
                 output_dist="uniform:0.8", prompt_dist="uniform:0.5", seed=2)
    run = simulate(Profile.load(SEED), SchedulerConfig("continuous", 4, {"admit_k": 1}), w)
    specs = plan(w)
    assert [s["max_tokens"] for s in run["samples"]] == [s.max_tokens for s in specs]
    assert [s["completion_tokens"] for s in run["samples"]] == [s.max_tokens for s in specs]  # exact (never EOS)
    assert [s["prompt_tokens"] for s in run["samples"]] == [s.prompt_size for s in specs]  # 1 token per word
    assert all(s["ignore_eos"] for s in run["samples"])


def test_varied_outputs_make_admission_matter_in_a_burst():
    # fixed lengths: every request of a wave ends together, so K=1 and K=8 schedule alike (the degenerate grid)
    p = Profile.load(SEED)

    def calls(k, dist):
        w = Workload(num_requests=64, prompt_words=64, max_tokens=32, output_dist=dist, seed=0)
        return simulate(p, SchedulerConfig("continuous", 8, {"admit_k": k}), w)["metrics"]["trace"]["steps"]["prefill"]

    assert calls(1, "fixed") == calls(8, "fixed") == 8
    assert calls(1, "uniform:0.9") > 2 * calls(8, "uniform:0.9")


# --------------------------------------------------------------------------- Mooncake traces


def test_the_shipped_excerpt_loads_with_its_window_and_scaling():
    reqs = mooncake.load(str(EXCERPT), 10, 20, 0.5, 0.1)
    assert len(reqs) == 20 and reqs[0].index == 10 and reqs[0].t == 0.0
    raw = [json.loads(line) for line in EXCERPT.read_text().splitlines()[10:30]]
    assert reqs[-1].t == pytest.approx((raw[-1]["timestamp"] - raw[0]["timestamp"]) / 1000 * 0.5)
    assert [r.prompt_tokens for r in reqs] == [max(1, round(x["input_length"] * 0.1)) for x in raw]
    assert [r.output_tokens for r in reqs] == [max(1, round(x["output_length"] * 0.1)) for x in raw]
    assert mooncake.block_tokens(0.1) == 51


def test_equal_hash_ids_give_equal_blocks_and_the_reuse_is_counted(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]},
            {"timestamp": 10, "input_length": 1500, "output_length": 5, "hash_ids": [7, 8, 9]},
            {"timestamp": 20, "input_length": 600, "output_length": 5, "hash_ids": [1, 8]}]
    reqs = mooncake.load(str(_trace(tmp_path, rows)), length_scale=1 / 16)  # 32-token blocks
    a, b, c = (mooncake.prompt_ids(r, 32, salt=3, vocab=1000) for r in reqs)
    assert len(a) == 62 and len(b) == 94 and len(c) == 38
    assert b[:62] == a and b[62] != a[-1]  # a's second block is partial (30 of 32 tokens): b shares all of a
    assert c[:32] != a[:32] and c[32:38] == a[32:38]  # block 8 is equal wherever it sits
    assert mooncake.prompt_ids(reqs[0], 32, salt=4, vocab=1000) != a  # another salt, other blocks
    ta, tb = (mooncake.prompt_text(r, 32, salt="s").split() for r in reqs[:2])
    assert len(ta) == 62 and tb[:62] == ta
    r = mooncake.reuse(reqs, 32)
    assert (r["blocks"], r["repeated_blocks"]) == (7, 3)  # b: 7, 8; c: 8
    assert r["prefix_reuse"] == pytest.approx(62 / (62 + 94 + 38))  # only b's leading blocks are a prefix hit


@pytest.mark.parametrize("rows, message", [
    ([{"timestamp": 0, "input_length": 10, "hash_ids": [1]}], "line 1: missing field 'output_length'"),
    ([{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [1]},
      {"timestamp": 4, "input_length": 10, "output_length": 2, "hash_ids": [1]}], "line 2: timestamp 4 is earlier"),
    ([{"timestamp": 0, "input_length": 0, "output_length": 2, "hash_ids": [1]}], "input_length must be a positive integer"),
    ([{"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": "1,2"}], "hash_ids must be a list"),
])
def test_bad_traces_are_exit_2_and_nothing_is_written(tmp_path, capsys, rows, message):
    trace = _trace(tmp_path, rows)
    out = tmp_path / "out" / "x"
    for argv in (["simulate", "--profile", str(SEED)], ["bench", "run", "--base-url", "http://127.0.0.1:1"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--workload", "trace", "--trace", str(trace), "--out", str(out)])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not out.parent.exists()


@pytest.mark.parametrize("argv, message", [
    (["--workload", "trace"], "needs --trace FILE"),
    (["--trace", str(EXCERPT)], "need --workload trace"),
    (["--workload", "trace", "--trace", str(EXCERPT), "--output-dist", "uniform:0.5"], "the trace gives every length"),
    (["--workload", "probe", "--output-dist", "uniform:0.5"], "not --workload probe"),
    (["--workload", "trace", "--trace", str(EXCERPT), "--start", "400"], "holds no request"),
    (["--output-dist", "eos"], "simulated tokens never end at EOS"),
])
def test_workload_flags_that_do_not_apply_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--profile", str(SEED), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_simulated_trace_reuses_the_prefixes_the_trace_shares(tmp_path, capsys):
    # each request extends the one before (a conversation), arriving after it ended: every earlier block is cached
    rows = [{"timestamp": 60_000 * i, "input_length": 512 * (i + 1), "output_length": 24, "hash_ids": list(range(i + 1))}
            for i in range(4)]
    trace = _trace(tmp_path, rows)
    prefix = tmp_path / "sim_trace"
    assert main(["simulate", "--profile", str(SEED), "--workload", "trace", "--trace", str(trace), "--length-scale", "0.125",
                 "--max-num-seqs", "2", "--out", str(prefix), "--no-plots"]) == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    samples = doc["conditions"][0]["runs"][0]["samples"]
    assert [s["cached_tokens"] for s in samples] == [0, 64, 128, 192]
    assert [s["completion_tokens"] for s in samples] == [3, 3, 3, 3] and [s["tag"] for s in samples][1] == "trace#1"
    assert doc["trace_reuse"]["block_reuse"] == pytest.approx(6 / 10)
    md = prefix.with_suffix(".md").read_text()
    assert "## Trace prefix reuse" in md and "6 of 10 prompt blocks (60.0%)" in md
    hit = 384 / (64 + 128 + 192 + 256)
    assert f"{hit * 100:.1f}%" in md and doc["conditions"][0]["figures"][0]["prefix_hit_share"] == pytest.approx(hit)
    # a simulated report names the profile's machine and what it leaves out, not this machine's load
    assert "Apple M3 Ultra" in md and "What a simulation does not model" in md and "load average" not in md
    assert "client queue" not in md and "overlap (/metrics)" not in md
    assert "n/a (1 repeat)" in md and not math.isnan(doc["conditions"][0]["figures"][0]["itl_p99"])
    assert "trace: 4 requests of" in md and "lengths x0.125 (64-token blocks for the trace's 512)" in md


# --------------------------------------------------------------------------- against a live quanta server


def test_bench_sends_each_requests_drawn_length_exactly(server, tmp_path):
    prefix = tmp_path / "bench_lengths"
    assert main(["bench", "run", "--base-url", server.base_url, "--num-requests", "6", "--max-tokens", "8",
                 "--output-dist", "uniform:0.75", "--prompt-dist", "uniform:0.5", "--prompt-words", "16", "--repeats", "1",
                 "--warmup", "0", "--no-progress", "--no-plots", "--out", str(prefix)]) == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    samples = doc["conditions"][0]["runs"][0]["samples"]
    specs = plan(Workload.from_dict(doc["workload"]))
    assert [s["max_tokens"] for s in samples] == [p.max_tokens for p in specs] and len({p.max_tokens for p in specs}) > 1
    assert [s["completion_tokens"] for s in samples] == [s["max_tokens"] for s in samples]  # ignore_eos: exact
    assert [s["prompt_size"] for s in samples] == [p.prompt_size for p in specs] and all(s["ignore_eos"] for s in samples)
    assert "## Request lengths" in prefix.with_suffix(".md").read_text()


def test_bench_replays_a_trace_and_the_server_reuses_its_shared_prefix(server, tmp_path):
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [1, 2]},
            {"timestamp": 3000, "input_length": 1536, "output_length": 48, "hash_ids": [1, 2, 3]},
            {"timestamp": 3500, "input_length": 512, "output_length": 32, "hash_ids": [9]}]
    prefix = tmp_path / "bench_trace"
    assert main(["bench", "run", "--base-url", server.base_url, "--workload", "trace", "--trace", str(_trace(tmp_path, rows)),
                 "--length-scale", "0.0625", "--repeats", "1", "--warmup", "0", "--no-progress", "--no-plots",
                 "--out", str(prefix)]) == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    a, b, c = doc["conditions"][0]["runs"][0]["samples"]
    assert [s["completion_tokens"] for s in (a, b, c)] == [4, 3, 2]  # exact scaled output lengths
    assert b["scheduled"] - a["scheduled"] == pytest.approx(3.0)
    assert b["cached_tokens"] >= 0.9 * a["prompt_tokens"]  # b starts with a's two blocks, sent as the same words
    assert c["cached_tokens"] < 8 and a["prompt_tokens"] >= 60
    md = prefix.with_suffix(".md").read_text()
    assert "2 of 6 prompt blocks (33.3%)" in md and "## Trace prefix reuse" in md
