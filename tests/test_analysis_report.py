"""Aggregation over repeats and the markdown tables, on hand-made figures."""

import math

import pytest

from quanta.analysis.report import aggregate, frontier_lines, main_table, rates_table, repeat_figures


def _summary(p50, p99):
    return {"n": 10, "mean": p50, "p50": p50, "p90": p99, "p99": p99, "max": p99}


def _metrics(thr, itl_p99, prefill=8, decode=100, trace=True):
    client = {"throughput": thr, "ttft": _summary(0.5, 1.0), "e2e": _summary(2.0, 3.0), "itl": _summary(0.02, itl_p99 * 1.1),
              "queue": _summary(0.0, 0.001), "num_failed": 0}
    t = {"steps": {"prefill": prefill, "decode": decode, "mixed": 0}, "itl": _summary(0.02, itl_p99), "prefill_rate": 700.0,
         "decode_rate": 300.0, "occupancy": 0.9, "overlap": 0.25} if trace else None
    return {"client": client, "trace": t, "scrape_overlap": math.nan}


def cond(name, thr_p99s, **kw):
    return {"name": name, "valid": True, "figures": [repeat_figures(_metrics(t, p, **kw)) for t, p in thr_p99s]}


def test_repeat_figures_prefer_the_server_trace():
    f = repeat_figures(_metrics(100.0, 0.2))
    assert f["itl_source"] == "server trace" and f["itl_p99"] == 0.2 and f["prefill_calls"] == 8
    g = repeat_figures(_metrics(100.0, 0.2, trace=False))
    assert g["itl_source"] == "client" and g["itl_p99"] == pytest.approx(0.22) and "prefill_calls" not in g


def test_aggregate_is_median_with_iqr():
    c = cond("x", [(100.0, 0.10), (120.0, 0.30), (110.0, 0.20)])
    agg = aggregate(c["figures"])
    assert agg["throughput"] == (110.0, 105.0, 115.0)
    assert agg["itl_p99"] == pytest.approx((0.20, 0.15, 0.25))


def test_main_table_baseline_frontier_and_invalid_rows():
    conds = [
        cond("static", [(100.0, 0.10)] * 3),
        cond("continuous K=1", [(200.0, 0.30), (220.0, 0.40), (180.0, 0.20)]),
        cond("chunked C=8", [(90.0, 0.50)] * 3),  # dominated by static
        {"name": "continuous K=32", "valid": False, "invalid_reason": "--admit-k (32) is larger than --max-num-seqs (16)", "figures": []},
        cond("foreign", [(150.0, 0.2)], trace=False),
    ]
    table = main_table(conds, "static")
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert "| 8 | 100 | 20.00 | 100.00 | 100.00-100.00 | 100.0 (100.0-100.0) | 1.00 (1.00-1.00) | 0 | yes |" in rows["static"]
    assert "300.00 | 250.00-350.00 | 200.0 (190.0-210.0) | 2.00 (1.90-2.10) | 0 | yes |" in rows["continuous K=1"]
    assert rows["chunked C=8"].rstrip().endswith("| 0 |  |")
    assert "invalid: --admit-k (32)" in rows["continuous K=32"]
    assert "| foreign | n/a | n/a |" in rows["foreign"]
    front = frontier_lines(conds)
    assert "**continuous K=1**" in front and "**static**" in front and "chunked" not in front
    assert "p99 ITL 300.00 (250.00-350.00) ms" in front
    assert "| foreign | n/a | n/a | n/a | n/a |" in rates_table(conds)


def test_frontier_line_needs_two_points():
    """A one-condition frontier is a point: the plot draws no line and no legend entry for one."""
    from quanta.analysis.plots import frontier_line

    def cond(name, throughput, p99):
        return {"name": name, "figures": [{"throughput": throughput, "itl_p99": p99}]}

    assert frontier_line([cond("only", 100.0, 0.05)]) == []
    assert frontier_line([cond("a", 100.0, 0.05), cond("b", 50.0, 0.08)]) == []  # b is dominated
    assert frontier_line([cond("fast", 200.0, 0.09), cond("a", 100.0, 0.05), cond("b", 50.0, 0.08)]) == [(100.0, 0.05), (200.0, 0.09)]


def test_lengths_table_counts_ok_requests_as_exact_outputs_does():
    """Four finished requests, one with usage: 'requests ok' is 4 beside 'exact outputs 4/4', not 1."""
    from quanta.bench.output import _lengths_section

    samples = [{"error": None, "ignore_eos": True, "prompt_tokens": 10, "completion_tokens": 5}]
    samples += [{"error": None, "ignore_eos": True, "prompt_tokens": 10, "completion_tokens": None} for _ in range(3)]
    samples.append({"error": "timeout", "ignore_eos": True, "prompt_tokens": None, "completion_tokens": None})
    row = _lengths_section({"conditions": [{"name": "c", "runs": [{"samples": samples}]}]}).splitlines()[-1]
    assert row == "| c | 4 | 10 / 10 / 10 | 5 / 5 / 5 (1 with usage) | 4/4 |"


def _saved_legends(monkeypatch, draw) -> list[list[str]] | None:
    """Run ``draw(path)`` with savefig captured: each saved figure's legend texts ([] for no legend),
    or None where nothing was saved."""
    from matplotlib.figure import Figure

    saved: list[list[str]] = []

    def capture(fig, path, **kw):
        legend = fig.axes[0].get_legend()
        saved.append([t.get_text() for t in legend.get_texts()] if legend else [])

    monkeypatch.setattr(Figure, "savefig", capture)
    draw("unused.png")
    return saved or None


def test_plots_draw_a_legend_entry_only_for_a_line_they_draw(monkeypatch):
    """No legend for a line that is not drawn: a one-condition frontier has no Pareto line, and an
    ITL CDF without a positive gap (tokens that arrived together) is no plot at all, not an empty
    legend box."""
    from quanta.analysis.plots import frontier_plot, itl_cdf_plot

    one = [{"name": "only", "figures": [{"throughput": 100.0, "itl_p99": 0.05}]}]
    two = one + [{"name": "fast", "figures": [{"throughput": 200.0, "itl_p99": 0.09}]}]
    assert _saved_legends(monkeypatch, lambda p: frontier_plot(one, p)) == [[]]
    assert _saved_legends(monkeypatch, lambda p: frontier_plot(two, p)) == [["Pareto frontier"]]
    assert _saved_legends(monkeypatch, lambda p: itl_cdf_plot({"a": [0.0, 0.0]}, p)) is None
    assert itl_cdf_plot({"a": [0.0], "b": []}, "unused.png") is False
    assert _saved_legends(monkeypatch, lambda p: itl_cdf_plot({"a": [0.0], "b": [0.01, 0.02]}, p)) == [["b"]]


def test_a_results_machine_names_the_vector_features_that_chose_its_kernels():
    from quanta.bench.output import machine, machine_text
    from quanta.model.cpu import cpu_summary

    m = machine()
    assert m["flags"] == cpu_summary()
    assert machine_text({"cpu": "AMD EPYC", "flags": "avx2 fma f16c", "logical_cores": 2}) == "AMD EPYC (avx2 fma f16c), 2 logical cores"
    assert machine_text({"cpu": "AMD EPYC", "logical_cores": 2}) == "AMD EPYC, 2 logical cores"  # a result recorded without them
