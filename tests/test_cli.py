"""The ``quanta`` command line: flags given once, configuration checked before
the model loads, and ``quanta generate`` end to end.

Bad command lines are checked two ways: in-process with every model loader
replaced by one that fails the test (so "before the model loads" is exact),
and a few as real subprocesses (exit code 2, stderr, no model load line).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from quanta import cli, flags


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quanta.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def no_model_load(monkeypatch):
    """Make any attempt to load a model fail the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the command line was validated")

    import quanta.generate
    import quanta.launch
    import quanta.server.run

    for module in (quanta.launch, quanta.generate, quanta.server.run):
        monkeypatch.setattr(module, "load_model", refuse)


def main_exit(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    return info.value.code, capsys.readouterr().err


# --------------------------------------------------------------------------- flags given twice


REPEATS = [
    (["serve", "--prefill-cap", "4096", "--prefill-cap", "2048"], "--prefill-cap"),
    (["serve", "--port", "1", "--port", "2"], "--port"),
    (["serve", "--port=1", "--port=2"], "--port"),
    (["serve", "--port=1", "--port", "1"], "--port"),
    (["serve", "--max-num-seqs", "4", "--max-num-seqs=4"], "--max-num-seqs"),
    (["serve", "--scheduler", "batched", "--scheduler", "batched"], "--scheduler"),
    (["serve", "--dtype", "bf16", "--dtype", "fp32"], "--dtype"),
    (["serve", "--max-queue", "3", "--max-queue", "4"], "--max-queue"),
    (["serve", "--served-model-name", "a", "--served-model-name", "b"], "--served-model-name"),
    (["generate", "hi", "--max-tokens", "1", "--max-tokens", "2"], "--max-tokens"),
    (["generate", "hi", "--temperature=0", "--temperature=1"], "--temperature"),
]


@pytest.mark.parametrize("argv,flag", REPEATS, ids=[" ".join(a) for a, _ in REPEATS])
def test_flag_given_twice_is_an_error(argv, flag, capsys, no_model_load):
    code, err = main_exit(argv, capsys)
    assert code == 2
    assert flag in err and "more than once" in err, err


@pytest.mark.parametrize("argv,command,fragment", [
    (["serve", "--max-num-seqs", "x"], "quanta serve", "--max-num-seqs: invalid int value"),
    (["serve", "--max-tokens", "64"], "quanta serve", "unrecognized arguments: --max-tokens 64"),  # not --max-tokens-default
    (["serve", "--max-num", "2"], "quanta serve", "unrecognized arguments: --max-num 2"),
    (["bench", "run", "--base-url", "http://127.0.0.1:1", "--nope"], "quanta bench run", "unrecognized arguments: --nope"),
    ([], "quanta", "required: command"),
], ids=["bad-int", "abbreviation", "prefix", "bench-unknown", "no-command"])
def test_a_parse_error_is_one_line_naming_the_command(argv, command, fragment, capsys, no_model_load):
    """No usage text, no abbreviated flags: one line, the command's name, a pointer to its --help."""
    code, err = main_exit(argv, capsys)
    assert code == 2
    assert err.strip().splitlines() == [f"{command}: error: {err.split(': error: ', 1)[1].strip()}"], err
    assert err.startswith(f"{command}: error:") and fragment in err and f"(see {command} --help)" in err, err


@pytest.mark.parametrize("argv,error", [
    (["serve", "--max-num-seq", "4"], "quanta serve: error: unrecognized arguments: --max-num-seq 4; did you mean --max-num-seqs?"),
    (["serve", "--max-num-seq=4"], "quanta serve: error: unrecognized arguments: --max-num-seq=4; did you mean --max-num-seqs?"),
    (["serve", "--prefil-cap", "8", "--max-num-seq", "2"],
     "quanta serve: error: unrecognized arguments: --prefil-cap 8 --max-num-seq 2; did you mean --prefill-cap or --max-num-seqs?"),
    (["generate", "hi", "--temprature", "0"],
     "quanta generate: error: unrecognized arguments: --temprature 0; did you mean --temperature?"),
    (["serve", "--nope"], "quanta serve: error: unrecognized arguments: --nope"),  # nothing close: no guess
], ids=["serve", "equals", "two", "generate", "no-guess"])
def test_a_misspelled_flag_is_one_line_with_the_closest_flag(argv, error, capsys, no_model_load):
    code, err = main_exit(argv, capsys)
    command = error.split(": error:")[0]
    assert code == 2 and err.splitlines() == [f"{error} (see {command} --help)"], err


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["serve", "--prefill-cap", "4096", "--prefill-cap", "2048"], "--prefill-cap"),
        (["serve", "--port", "1", "--port", "2"], "--port"),
        (["serve", "--port=1", "--port=2"], "--port"),
    ],
    ids=["prefill-cap", "port", "port-equals"],
)
def test_flag_given_twice_exits_2_before_loading(argv, flag):
    proc = run_cli(*argv)
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr and "more than once" in proc.stderr
    assert "loaded" not in proc.stderr, "the model loaded before the flags were checked"


# --------------------------------------------------------------------------- invalid configuration


INVALID = [
    (["serve", "--scheduler", "nope"], ["--scheduler", "nope"]),
    (["serve", "--max-num-seqs", "0"], ["--max-num-seqs", "0"]),
    (["serve", "--max-num-seqs", "-3"], ["--max-num-seqs"]),
    (["serve", "--prefill-quantum", "-5"], ["--prefill-quantum", "-5"]),
    (["serve", "--mixed-prefill-quantum", "0"], ["--mixed-prefill-quantum"]),
    (["serve", "--prefill-cap", "0"], ["--prefill-cap"]),
    (["serve", "--prefill-quantum", "8192"], ["--prefill-quantum", "8192", "--prefill-cap", "4096"]),
    (["serve", "--prefill-quantum", "256", "--mixed-prefill-quantum", "600", "--prefill-cap", "512"],
     ["--mixed-prefill-quantum", "600", "--prefill-cap", "512"]),
    (["serve", "--scheduler", "static", "--prefill-cap", "1024"], ["--prefill-cap", "static"]),
    (["serve", "--scheduler", "static", "--prefill-quantum", "64"], ["--prefill-quantum", "static"]),
    (["serve", "--max-model-len", "0"], ["--max-model-len"]),
    (["serve", "--max-queue", "0"], ["--max-queue"]),
    (["serve", "--block-size", "12"], ["--block-size"]),
    (["serve", "--kv-cache-memory", "lots"], ["--kv-cache-memory"]),
    (["serve", "--kv-cache-dtype", "q4_0"], ["--kv-cache-dtype"]),
    (["serve", "--prompt-weights", "none"], ["--prompt-weights"]),
    (["serve", "--prompt-weights", "form", "--quantization", "none"], ["--prompt-weights form", "--quantization"]),
    (["generate", "hi", "--prompt-weights", "form", "--quantization", "int8"], ["--prompt-weights form", "int8"]),
    (["serve", "--kv-cache-tokens", "100", "--max-model-len", "512"], ["--kv-cache-tokens", "--max-model-len"]),
    (["serve", "--kv-cache-memory", "1GiB", "--kv-cache-tokens", "4096"], ["--kv-cache-memory", "--kv-cache-tokens"]),
    (["serve", "--max-queue", "-1"], ["--max-queue"]),
    (["serve", "--dtype", "fp16"], ["--dtype"]),
    (["serve", "--max-num-seqs", "many"], ["--max-num-seqs"]),
    (["serve", "--port", "-1"], ["--port"]),
    (["serve", "--port", "70000"], ["--port"]),
    (["generate", "hi", "--max-tokens", "0"], ["--max-tokens"]),
    (["generate", "hi", "--temperature", "3"], ["--temperature"]),
    (["generate", "hi", "--temperature", "-0.5"], ["--temperature"]),
    (["generate", "hi", "--prefill-quantum", "-1"], ["--prefill-quantum"]),
]


@pytest.mark.parametrize("argv,fragments", INVALID, ids=[" ".join(a) for a, _ in INVALID])
def test_invalid_configuration_exits_2_before_loading(argv, fragments, capsys, no_model_load):
    code, err = main_exit(argv, capsys)
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["serve", "--scheduler", "nope"], ["--scheduler"]),
        (["serve", "--max-num-seqs", "0"], ["--max-num-seqs"]),
        (["serve", "--prefill-quantum", "-5"], ["--prefill-quantum"]),
        (["serve", "--prefill-quantum", "8192", "--prefill-cap", "4096"], ["--prefill-quantum", "--prefill-cap"]),
        (["serve", "--scheduler", "static", "--prefill-cap", "1024"], ["--prefill-cap"]),
        (["serve", "--kv-cache-memory", "1MiB"], ["--kv-cache-memory", "holds 32 tokens", "--max-model-len 8192"]),
        (["serve", "--stream-keepalive", "0.0001"], ["--stream-keepalive", "0 (none) or a number >= 0.1"]),
    ],
    ids=["unknown-scheduler", "zero-seqs", "negative-quantum", "quantum-over-cap", "foreign-knob", "kv-budget",
         "keepalive-floor"],
)
def test_invalid_configuration_subprocess(argv, fragments):
    proc = run_cli(*argv)
    assert proc.returncode == 2, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "loaded" not in proc.stderr


# --------------------------------------------------------------------------- generate


def test_generate_prints_the_greedy_completion(server):
    """``quanta generate`` prints text and exits 0; its greedy text is the
    server's greedy text for the same prompt and length (same engine)."""
    import httpx

    prompt, max_tokens = "The capital of France is", 8
    proc = run_cli("generate", prompt, "--max-tokens", str(max_tokens), timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip(), "generate printed no text"
    steps = re.search(r"\[(\d+) prefill / (\d+) decode / (\d+) mixed steps\]", proc.stderr)
    assert steps, proc.stderr[-2000:]

    reference = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=60,
    ).json()
    assert proc.stdout == reference["choices"][0]["text"] + "\n"
    prefill, decode, mixed = map(int, steps.groups())
    assert prefill >= 1
    assert prefill + decode + mixed >= reference["usage"]["completion_tokens"]


POLICY_FLAGS = {
    "static": [],
    "continuous": ["--admit-k", "2"],
    "chunked": ["--chunk", "4", "--prefill-cap", "16"],
    "budget": ["--max-num-batched-tokens", "8"],
}


@pytest.mark.parametrize("name", sorted(POLICY_FLAGS))
def test_generate_runs_under_every_policy(name):
    """Each policy serves ``quanta generate``; chunking shows in the step counts it reports."""
    prompt = "The capital of France is"
    proc = run_cli("generate", prompt, "--max-tokens", "4", "--scheduler", name, *POLICY_FLAGS[name], timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    steps = re.search(r"\[(\d+) prefill / (\d+) decode / (\d+) mixed steps\]", proc.stderr)
    assert steps, proc.stderr
    prefill, decode, mixed = map(int, steps.groups())
    assert decode + mixed >= 3  # 4 tokens: the first comes from the prompt's last chunk
    if name == "chunked":
        assert prefill >= 2  # a 5+-token prompt in chunks of 4
    if name == "budget":
        assert mixed == 0 and prefill >= 1  # one sequence: never a decode to fuse with


def test_version_and_python_dash_m(capsys):
    import quanta

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"quanta {quanta.__version__}"
    out = subprocess.run([sys.executable, "-m", "quanta", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"quanta {quanta.__version__}"


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"]])
def test_missing_model_is_one_line_and_exit_2(command, capsys, tmp_path, no_model_load):
    code, err = main_exit([*command, "--model", str(tmp_path / "nope.gguf")], capsys)
    assert code == 2
    assert err == f"quanta {command[0]}: error: --model {tmp_path / 'nope.gguf'}: no such file or directory\n"


def test_served_model_name_takes_aliases_and_tool_call_parser_is_checked(capsys, no_model_load):
    args = flags.parse_serve_flags(["--served-model-name", "main", "alias-1", "alias-2"])
    assert args.served_model_name == ["main", "alias-1", "alias-2"]
    engine_cfg, _ = flags.configs_from_args(args)
    assert engine_cfg.served_model_name == "main"
    code, err = main_exit(["serve", "--tool-call-parser", "nope"], capsys)
    assert code == 2 and "--tool-call-parser" in err and "hermes" in err


@pytest.mark.parametrize("make_args,host,port", [
    (['ARGS=--port 18080'], "127.0.0.1", "18080"),
    (["PORT=9000", "HOST=0.0.0.0"], "0.0.0.0", "9000"),
    (['ARGS=--host 0.0.0.0 --port 1 --max-num-seqs 4'], "0.0.0.0", "1"),
])
def test_make_serve_passes_host_and_port_once(make_args, host, port):
    import shutil
    from pathlib import Path

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["make", "-s", "-n", "-o", ".venv/.quanta-installed", "serve", *make_args],
                         cwd=root, capture_output=True, text=True, timeout=60)
    line = [ln for ln in out.stdout.splitlines() if "quanta serve" in ln][-1].split()
    assert line.count("--host") == 1 and line.count("--port") == 1, line
    assert line[line.index("--host") + 1] == host and line[line.index("--port") + 1] == port


# --------------------------------------------------------------------------- what cannot load, found first


def _not_a_model(tmp_path):
    text = tmp_path / "notes.md"
    text.write_text("# not a model\n")
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    return [
        (str(text), "not a GGUF file"),
        (str(empty), "without config.json"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "local paths only (no hub downloads)"),
    ]


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"]])
def test_what_is_no_model_is_one_line_before_loading(command, capsys, tmp_path, no_model_load):
    for model, fragment in _not_a_model(tmp_path):
        code, err = main_exit([*command, "--model", model], capsys)
        assert code == 2, err
        assert err.startswith(f"quanta {command[0]}: error: --model {model}: ") and err.count("\n") == 1, err
        assert fragment in err, err


def test_readme_as_model_and_busy_port_subprocess(tmp_path):
    """As a user meets them: exit 2, one line, no traceback, nothing loaded."""
    import socket
    from pathlib import Path

    readme = Path(__file__).resolve().parents[1] / "README.md"
    proc = run_cli("serve", "--model", str(readme))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "not a GGUF file" in proc.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = run_cli("serve", "--port", str(port))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"quanta serve: error: --port {port}: 127.0.0.1:{port} is already in use (another server?); "
                           "stop it or choose another --port\n")


def test_a_free_port_and_real_models_pass_the_checks(tmp_path):
    from quanta.preflight import GGUF_MAGIC, check_listen, check_model_path

    (tmp_path / "m.gguf").write_bytes(GGUF_MAGIC + b"\0" * 8)
    check_model_path(str(tmp_path / "m.gguf"))
    (tmp_path / "config.json").write_text("{}")
    check_model_path(str(tmp_path))
    check_listen("127.0.0.1", 0)
    with pytest.raises(ValueError, match="cannot resolve"):
        check_listen("no-such-host.invalid", 8000)


# --------------------------------------------------------------------------- commands that load no model import no torch

HEAVY = ("torch", "transformers", "fastapi", "httpx", "numpy")


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["advise"], ["serve", "--help"], ["bench", "--help"]])
def test_commands_without_a_model_import_no_torch(argv):
    """Behaviour, not timing (benchmarks/cli_startup.py times them): a lazy import turned eager shows here."""
    code = ("import sys, quanta.cli\n"
            f"try:\n    quanta.cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr


def test_a_bad_chat_template_is_one_line_before_loading(capsys, tmp_path, no_model_load):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    for value, fragment in [(str(tmp_path / "none.jinja"), "no such file"), (str(broken), "not a valid Jinja template")]:
        code, err = main_exit(["serve", "--port", "0", "--chat-template", value], capsys)
        assert code == 2 and err.startswith(f"quanta serve: error: --chat-template {value}: ") and err.count("\n") == 1, err
        assert fragment in err, err


def test_ctrl_c_while_loading_ends_with_one_line():
    """SIGINT before the server is up: one line and status 130, no KeyboardInterrupt traceback."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "quanta.cli", "serve", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # shells ignore it in background jobs
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    # 130, or death by SIGINT where the interpreter re-raises it at exit (a shell shows 130 for both)
    assert proc.returncode in (130, -signal.SIGINT), out
    assert "Traceback" not in out and out.strip().splitlines()[-1] == "quanta: interrupted", out


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_model_file_that_fails_at_load_is_one_line_and_exit_2(tmp_path, command):
    """A file that passes the checks before the load (GGUF magic) but cannot be read into a model."""
    from quanta.model.loader import embedded_model_path

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(embedded_model_path().read_bytes()[:200_000])
    args = ["--port", "0"] if command == "serve" else ["hi"]
    proc = run_cli(command, *args, "--model", str(cut))
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if " INFO " not in ln]
    assert errors == [f"quanta {command}: error: --model {cut}: truncated GGUF header: the file (200000 bytes) "
                      "ends within key 'tokenizer.ggml.tokens'"], proc.stderr


def _swallowed_interrupt_then(error: Exception):
    """A command that is interrupted where the KeyboardInterrupt is lost (an import it cut short) and then
    fails on what the interrupt left half made."""
    import os
    import signal
    import time

    def command(argv):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass
        raise error

    return command


@pytest.fixture
def python_sigint():
    """SIGINT handled as Python handles it by default (a test run from a background job has it ignored)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_error_that_follows_an_interrupt_ends_with_the_interrupt_line(monkeypatch, capsys, python_sigint):
    monkeypatch.setattr(cli, "_main", _swallowed_interrupt_then(AttributeError("module 'numpy' has no attribute 'matrix'")))
    assert cli.main([]) == 130
    assert capsys.readouterr().err.strip() == "quanta: interrupted"


def test_an_error_without_an_interrupt_is_not_called_one(monkeypatch):
    def broken(argv):
        raise AttributeError("a real bug")

    monkeypatch.setattr(cli, "_main", broken)
    with pytest.raises(AttributeError, match="a real bug"):
        cli.main([])
