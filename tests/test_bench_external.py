"""``quanta bench sweep --server-cmd``: sweeps over any server's flags.

The server is ``tests/fake_openai_server.py``, a real HTTP server started as
a subprocess per condition; it clamps ``--ubatch-size`` to ``--batch-size``
as llama.cpp does, so a requested value can differ from the applied one.
"""

from __future__ import annotations

import json
import signal
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from quanta.bench.external import TemplateError, condition_values, from_args, parse_rule
from quanta.bench.sweep import expand
from quanta.cli import main

FAKE = Path(__file__).with_name("fake_openai_server.py")
TEMPLATE = f"{sys.executable} {FAKE} --port {{port}} --ubatch-size {{ubatch_size}} --batch-size {{batch_size}}"
RULES = ["--verify", r"ubatch_size=log:n_ubatch\s*=\s*(\d+)", "--verify", "batch_size=json:/props:n_batch"]


def test_rules_read_the_log_or_a_json_field():
    rule = parse_rule(r"ubatch-size=log:n_ubatch\s*=\s*(\d+)")
    assert rule.knob == "ubatch_size" and rule.kind == "log"
    assert rule.applied("n_ubatch = 512\nn_ubatch = 256\n", "", None) == ("256", None)  # the last match
    assert rule.applied("nothing here", "", None)[1].startswith("no match")
    rule = parse_rule("n_ctx=json:/props:default_generation_settings.n_ctx")
    assert (rule.path, rule.field) == ("/props", ["default_generation_settings", "n_ctx"])


@pytest.mark.parametrize("text, message", [
    ("ubatch_size", "expected KNOB=log:REGEX"),
    ("ubatch_size=grep:x", "expected KNOB=log:REGEX"),
    ("ubatch_size=log:n_ubatch = \\d+", "needs a (group)"),
    ("ubatch_size=log:(unclosed", "bad regex"),
    ("ubatch_size=json:props:n", "expected json:/PATH:FIELD"),
    ("ubatch_size=json:/props:", "expected json:/PATH:FIELD"),
])
def test_bad_rules_are_refused(text, message):
    with pytest.raises(TemplateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_rule(text)


def _server(template=TEMPLATE, verify=(), grid="--ubatch-size 64,128 --batch-size 512", server_flags=""):
    args = Namespace(server_cmd=template, health_url="/health", verify=list(verify), startup_timeout=30.0, server_flags=server_flags)
    return from_args(args, expand([grid]))


def test_template_is_filled_token_by_token_without_a_shell():
    server = _server()
    cond = expand(["--ubatch-size 64 --batch-size 512"])[0]
    argv = server.command(condition_values(cond.flags), 8123)
    assert argv[-6:] == ["--port", "8123", "--ubatch-size", "64", "--batch-size", "512"]
    assert server.unverified() == ["batch_size", "ubatch_size"]


@pytest.mark.parametrize("kw, message", [
    ({"template": "llama-server --ubatch-size {ubatch_size}"}, "has no {port}"),
    ({"template": "llama-server --port {port} --ubatch-size {ubatch_size}"}, "has no {batch_size}"),
    ({"template": TEMPLATE + " --ctx-size {ctx_size}"}, "gives no --ctx-size"),
    ({"verify": ["n_ctx=json:/props:n_ctx"]}, "which no --grid sweeps"),
    ({"verify": ["batch_size=log:a(b)", "batch-size=log:c(d)"]}, "two rules"),
    ({"grid": "--ubatch-size 64 --batch-size 512 --flash-attn"}, "has no value"),
    ({"server_flags": "--ctx-size 512"}, "--server-flags are quanta serve flags"),
    ({"template": "llama-server --port {port} 'unclosed"}, "No closing quotation"),
])
def test_template_and_grid_must_agree(kw, message):
    with pytest.raises(TemplateError, match=message.replace("{", r"\{").replace("}", r"\}")):
        _server(**kw)


def _bench(*argv: str) -> int:
    return main(["bench", "sweep", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--grid", "--ubatch-size 64", "--server-cmd", "llama-server --ubatch-size {ubatch_size}"], "has no {port}"),
    (["--grid", "--scheduler static", "--verify", "admit_k=json:/v1/config:admit_k"], "--verify applies to --server-cmd"),
    (["--grid", "--ubatch-size 64 --batch-size 512", "--server-cmd", TEMPLATE, "--verify", "ubatch_size=log:x"], "needs a (group)"),
])
def test_bad_external_sweeps_exit_2_before_anything_starts(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        _bench(*argv, "--out", str(tmp_path / "x"))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_dry_run_lists_each_command_and_the_verification(capsys):
    assert _bench("--grid", "--ubatch-size 64,128 --batch-size 512", "--server-cmd", TEMPLATE, *RULES[:2], "--dry-run") == 0
    err = capsys.readouterr().err
    assert "ubatch-size=64 batch-size=512: " in err and "--port {port} --ubatch-size 128 --batch-size 512" in err
    assert "unverified (no --verify rule): batch_size" in err


def test_sweep_starts_verifies_measures_and_stops_a_fresh_server_per_condition(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    prefix = tmp_path / "bench_external"
    sentinel = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, sentinel)
    try:
        code = _bench("--grid", "--ubatch-size 64,1024 --batch-size 512", "--grid", "--ubatch-size 64 --batch-size 0",
                      "--server-cmd", TEMPLATE + f" --state-dir {state}", *RULES, "--workload", "burst", "--num-requests", "3",
                      "--max-tokens", "4", "--prompt-words", "6", "--repeats", "2", "--warmup", "1", "--no-progress",
                      "--no-plots", "--out", str(prefix))
        assert signal.getsignal(signal.SIGTERM) is sentinel  # the sweep's SIGTERM handler does not outlive it
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    ok, clamped, refused = doc["conditions"]
    assert ok["valid"] and ok["applied"] == {"ubatch_size": "64", "batch_size": "512"} and ok["unverified"] == []
    assert ok["server_cmd"][-4:] == ["--batch-size", "512", "--state-dir", str(state)]
    assert [r["metrics"]["client"]["num_ok"] for r in ok["runs"]] == [3, 3]
    assert all(s["completion_tokens"] == 4 for r in ok["runs"] for s in r["samples"])
    # llama.cpp's rule: n_ubatch = min(ubatch, n_batch); the sweep must not measure it as ubatch 1024
    assert not clamped["valid"] and clamped["runs"] == []
    assert clamped["invalid_reason"] == "requested ubatch_size=1024, server applied ubatch_size=512"
    assert not refused["valid"] and refused["invalid_reason"] == (
        f"server did not start: {Path(sys.executable).name} exited with code 1 "  # python or python3, as pytest was run
        "(error: invalid batch sizes --batch-size 0 --ubatch-size 64)")
    # the two servers that started were stopped by SIGTERM (the third exited by itself)
    assert len(list(state.glob("*.stopped"))) == 2
    md = prefix.with_suffix(".md").read_text()
    assert "## Invalid conditions" in md and "server applied ubatch_size=512" in md
    assert "last match of /n_ubatch" in md and "field n_batch of GET /props" in md


def test_a_field_the_server_does_not_report_makes_the_condition_invalid(tmp_path):
    prefix = tmp_path / "bench_nofield"
    assert _bench("--grid", "--ubatch-size 64 --batch-size 512", "--server-cmd", TEMPLATE, "--verify", "batch_size=json:/props:n_seq",
                  "--num-requests", "1", "--repeats", "1", "--warmup", "0", "--no-progress", "--no-plots", "--out", str(prefix)) == 1
    cond = json.loads(prefix.with_suffix(".json").read_text())["conditions"][0]
    assert cond["invalid_reason"] == "batch_size: GET /props has no field n_seq"


def test_unhealthy_server_is_invalid_and_stopped(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    prefix = tmp_path / "bench_slow"
    assert _bench("--grid", "--ubatch-size 64 --batch-size 512", "--server-cmd", TEMPLATE + f" --load-delay 60 --state-dir {state}",
                  "--startup-timeout", "1", "--num-requests", "1", "--repeats", "1", "--warmup", "0", "--no-progress",
                  "--no-plots", "--out", str(prefix)) == 1
    cond = json.loads(prefix.with_suffix(".json").read_text())["conditions"][0]
    assert "not healthy at http://127.0.0.1:" in cond["invalid_reason"]
    assert len(list(state.glob("*.stopped"))) == 1


def _sessions_file(path: Path) -> Path:
    """Two recorded agent sessions (2 and 1 turns) written by the recorder itself."""
    from quanta.bench.record import Observed, Recorder

    rec = Recorder(path, "http://up", record_text=False)

    def one(messages, prompt_tokens, completion_tokens, reply):
        h = rec.begin("chat", "/v1/chat/completions", {"messages": messages, "stream": True})
        obs = Observed("chat")
        obs.sse = True
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        obs.feed(f'data: {json.dumps({"choices": [{"delta": {"content": reply}}], "usage": usage})}\n\n'.encode(), rec.now())
        rec.finish(h, 200, obs, complete=True)

    first = [{"role": "user", "content": "a b c d e f g h"}]
    one(first, 8, 3, "x y z")
    one([{"role": "user", "content": "other task here"}], 3, 2, "q r")
    one(first + [{"role": "assistant", "content": "x y z"}, {"role": "user", "content": "tool said ok"}], 14, 4, "done")
    rec.close()
    return path


def test_a_sessions_replay_sends_every_condition_the_same_requests(tmp_path):
    path = _sessions_file(tmp_path / "agent.jsonl")
    prefix = tmp_path / "bench_sessions"
    assert _bench("--grid", "--ubatch-size 64,128 --batch-size 512", "--server-cmd", TEMPLATE, *RULES, "--workload", "sessions",
                  "--sessions-file", str(path), "--endpoint", "chat", "--repeats", "2", "--warmup", "0", "--no-progress",
                  "--no-plots", "--out", str(prefix)) == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    sent = [sorted((s["tag"], s["prompt_tokens"], s["completion_tokens"]) for s in r["samples"])
            for c in doc["conditions"] for r in c["runs"]]
    assert len(sent) == 4 and all(x == sent[0] for x in sent)  # the fake counts words: equal sizes mean equal requests
    tags = [t for t, _, _ in sent[0]]
    assert tags == ["session0/turn0", "session0/turn1", "session1/turn0"]
    assert [c for _, _, c in sent[0]] == [3, 4, 2]  # the recorded output lengths
