"""Four coding agents, unchanged, against a fresh ``quanta serve``: Claude Code,
Codex CLI, opencode and Qwen Code each run one small non-interactive task.

Not run in CI: it downloads the agents from npm. Steps:

1. ``npm install --prefix DIR`` the pinned versions (:data:`AGENTS`; ``--latest``
   takes each package's newest release instead; an install whose versions
   already match is reused).
2. Everything after the install runs in a network namespace with loopback
   only (``unshare -rn``; ``--no-isolate`` runs on the host's network): the
   agents reach quanta and nothing else, so no telemetry, update check or
   model-list download leaves the machine, and an agent that needs one shows
   it by failing.
3. A fresh ``quanta serve`` (the embedded model unless ``--serve-args`` names
   another) on a free 127.0.0.1 port, with ``--api-key``: each agent must
   send its key.
4. Per agent, a logging proxy on its own port forwards every request to the
   server and records its route, HTTP status, output cap and the prompt
   tokens the answer's ``usage`` reports; the agent runs in a scratch HOME
   and a scratch git repository with its default settings apart from base
   URL, key and model name (:func:`agent_command`), bounded by ``--timeout``.
   The prompt tokens an agent cost in all come from the server's
   ``quanta:prompt_tokens`` counter (``/metrics``), which also counts answers
   whose ``usage`` the agent did not ask for.

Prints per agent: requests, HTTP statuses, prompt tokens (in all, and the
largest single prompt), wall time and exit code; ``--out PATH`` writes
``PATH.json`` (every request) and ``PATH.md``. Each agent's stdout/stderr,
its requests and the server log (``quanta-serve-PORT.log``) stay under ``--workdir``.

``--record DIR`` also puts ``quanta record`` (:mod:`quanta.bench.record`,
token counts and prefix relations, no text) between the logging proxy and
the server: agent -> logging proxy -> ``quanta record`` -> ``quanta serve``.
Each agent's requests go to ``DIR/AGENT.jsonl`` (a sessions file for
``quanta bench run --workload sessions``; overwritten if present), whose
header line also names the agent, its version, the task, the server flags,
node and the machine.

Usage::

    python benchmarks/coding_agents.py [--agents claude-code codex opencode qwen-code]
        [--latest] [--npm-prefix DIR] [--max-model-len 17408] [--timeout 1500]
        [--serve-args "--max-num-seqs 2"] [--task "..."] [--out /tmp/coding_agents] [--record DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import uvicorn

from quanta.bench.server import ServerProcess, free_port, launch
from quanta.bench.server import start as start_quanta

#: agent -> (npm package, pinned version, executable)
AGENTS = {
    "claude-code": ("@anthropic-ai/claude-code", "2.1.332", "claude"),
    "codex": ("@openai/codex", "0.171.0", "codex"),
    "opencode": ("opencode-ai", "1.18.33", "opencode"),
    "qwen-code": ("@qwen-code/qwen-code", "0.24.4", "qwen"),
}
API_KEY = "sk-quanta-agents"
ADMIN_KEY = "quanta-agents-admin"
ISOLATED_ENV = "QUANTA_AGENTS_ISOLATED"
DEFAULT_TASK = "Reply with one word: hello."
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "accept-encoding"}


# --------------------------------------------------------------------------- install


def installed_version(prefix: Path, package: str) -> str | None:
    manifest = prefix / "node_modules" / package / "package.json"
    return json.loads(manifest.read_text())["version"] if manifest.is_file() else None


def install(prefix: Path, names: list[str], latest: bool) -> dict[str, str]:
    """npm-install the agents into ``prefix`` (skipped when the pinned versions are there); returns agent -> version."""
    wanted = {n: (AGENTS[n][0], "latest" if latest else AGENTS[n][1]) for n in names}
    if latest or any(installed_version(prefix, pkg) != ver for pkg, ver in wanted.values()):
        specs = [f"{pkg}@{ver}" for pkg, ver in wanted.values()]
        cmd = ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel", "error", *specs]
        print("+", shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return {n: installed_version(prefix, pkg) or "?" for n, (pkg, _) in wanted.items()}


# --------------------------------------------------------------------------- the logging proxy


@dataclass
class Record:
    method: str
    path: str
    status: int
    seconds: float
    stream: bool
    max_tokens: int | None
    prompt_tokens: int | None
    #: the agent closed the connection before the answer ended
    client_closed: bool = False


def prompt_tokens_of(body: bytes) -> int | None:
    """Prompt tokens from a JSON answer's or an SSE stream's ``usage`` (chat / completions,
    Responses, Anthropic: input plus cache reads), or None when the answer has none."""
    found = None
    docs = []
    text = body.decode("utf-8", "replace")
    if text.lstrip().startswith("{"):
        docs = [text]
    else:
        docs = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    for doc in docs:
        try:
            obj = json.loads(doc)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        inner = obj.get("response") or obj.get("message") or obj
        usage = inner.get("usage") if isinstance(inner, dict) else None
        if not isinstance(usage, dict):
            continue
        if "prompt_tokens" in usage:
            found = usage["prompt_tokens"]
        elif "input_tokens" in usage and "cache_read_input_tokens" in usage:  # Anthropic: cached tokens apart
            found = usage["input_tokens"] + usage["cache_read_input_tokens"] + (usage.get("cache_creation_input_tokens") or 0)
        elif "input_tokens" in usage:  # Responses: cached tokens included
            found = usage["input_tokens"]
    return found


class Proxy:
    """Forwards every request on ``port`` to ``upstream`` and records it (:class:`Record`)."""

    def __init__(self, upstream: str, port: int, log_path: Path) -> None:
        self.upstream, self.port, self.log_path = upstream, port, log_path
        self.records: list[Record] = []
        self.inflight = 0
        self.client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None))
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                interface="asgi3")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Proxy:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        t0 = time.monotonic()
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k.decode().lower() not in HOP_HEADERS]
        try:
            req_json = json.loads(body) if body else {}
        except ValueError:
            req_json = {}
        req_json = req_json if isinstance(req_json, dict) else {}
        cap = next((req_json[k] for k in ("max_tokens", "max_completion_tokens", "max_output_tokens") if k in req_json), None)
        request = self.client.build_request(scope["method"], path, headers=headers, content=body)
        answer = {"status": 502, "kept": b""}

        async def forward() -> None:
            async with self.client.stream(request.method, request.url, headers=request.headers, content=body) as response:
                answer["status"] = response.status_code
                out_headers = [(k.encode(), v.encode()) for k, v in response.headers.items() if k.lower() not in HOP_HEADERS]
                await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
                async for chunk in response.aiter_raw():
                    answer["kept"] += chunk
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        self.inflight += 1
        closed = False
        try:
            work, watch = asyncio.ensure_future(forward()), asyncio.ensure_future(client_gone())
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:  # the agent went away: closing upstream aborts the request in quanta
                closed = True
                work.cancel()
            watch.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
            if work.done() and not work.cancelled() and work.exception() is not None:
                answer["kept"] += f"proxy: {work.exception()!r}".encode()
        finally:
            self.inflight -= 1
        status, kept = answer["status"], answer["kept"]
        rec = Record(scope["method"], path, status, round(time.monotonic() - t0, 2), bool(req_json.get("stream")), cap,
                     prompt_tokens_of(kept), closed)
        self.records.append(rec)
        with self.log_path.open("a") as f:
            f.write(json.dumps({**rec.__dict__, "request_bytes": len(body),
                                "answer_head": kept[:600].decode("utf-8", "replace") if status >= 300 else None}) + "\n")


# --------------------------------------------------------------------------- server


def start_server(args, workdir: Path) -> ServerProcess:
    flags = ["--max-model-len", str(args.max_model_len), "--api-key", API_KEY, "--admin-key", ADMIN_KEY,
             *shlex.split(args.serve_args)]
    print("+ quanta serve", shlex.join(flags), flush=True)
    return start_quanta(flags, workdir)


def start_recorder(upstream: str, out: Path, log_dir: Path) -> ServerProcess:
    """``quanta record --upstream upstream --out out`` on a free port, healthy once it passes ``/health`` through."""
    port = free_port()
    cmd = [sys.executable, "-m", "quanta.cli", "record", "--upstream", upstream, "--out", str(out), "--port", str(port),
           "--force"]
    print("+ quanta record", shlex.join(cmd[4:]), flush=True)
    base = f"http://127.0.0.1:{port}"
    return launch(cmd, base, base + "/health", log_dir / f"quanta-record-{port}.log")


def annotate_sessions(path: Path, meta: dict) -> int:
    """Add ``meta`` to the header line of the sessions file ``path`` (the format allows extra header keys);
    returns the number of requests it recorded."""
    lines = path.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    lines[0] = json.dumps({**header, **meta}, separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines) - 1


def model_id(url: str) -> str:
    models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()
    return models["data"][0]["id"]


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).text
    match = re.search(rf"^{re.escape(name)}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


# --------------------------------------------------------------------------- agents


def agent_command(name: str, bin_dir: Path, base: str, model: str, task: str, home: Path, repo: Path) -> tuple[list[str], dict]:
    """The agent's command line and the environment it adds: base URL, key and model name, nothing else
    (each agent's own documented way to name a provider); ``home`` is its scratch HOME."""
    exe = str(bin_dir / AGENTS[name][2])
    if name == "claude-code":
        return [exe, "-p", task, "--model", model], {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": API_KEY}
    if name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "quanta"\n\n[model_providers.quanta]\nname = "quanta"\n'
            f'base_url = "{base}/v1"\nenv_key = "QUANTA_API_KEY"\nwire_api = "responses"\n')
        return [exe, "exec", "--skip-git-repo-check", task], {"CODEX_HOME": str(codex_home), "QUANTA_API_KEY": API_KEY}
    if name == "opencode":
        config = {"$schema": "https://opencode.ai/config.json", "model": f"quanta/{model}",
                  "provider": {"quanta": {"npm": "@ai-sdk/openai-compatible", "name": "quanta",
                                          "options": {"baseURL": f"{base}/v1", "apiKey": API_KEY},
                                          "models": {model: {"name": model}}}}}
        (repo / "opencode.json").write_text(json.dumps(config, indent=2) + "\n")
        return [exe, "run", task], {}
    if name == "qwen-code":
        return [exe, "-p", task], {"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": model}
    raise ValueError(name)


@dataclass
class Result:
    agent: str
    version: str
    exit_code: int | None
    seconds: float
    records: list[Record] = field(default_factory=list)
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0

    def row(self) -> dict:
        statuses: dict[int, int] = {}
        for r in self.records:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        prompts = [r.prompt_tokens for r in self.records if r.prompt_tokens is not None]
        return {"agent": self.agent, "version": self.version, "requests": len(self.records),
                "statuses": " ".join(f"{s}x{n}" for s, n in sorted(statuses.items())) or "-",
                "all_2xx": bool(self.records) and all(200 <= r.status < 300 for r in self.records),
                "prompt_tokens": self.prompt_tokens_total, "cached_tokens": self.cached_tokens_total,
                "largest_prompt": max(prompts, default=None),
                "routes": " ".join(sorted({r.method + " " + r.path for r in self.records})),
                "seconds": round(self.seconds), "exit_code": "timeout" if self.exit_code is None else self.exit_code}


def run_agent(name: str, version: str, args, url: str, model: str, bin_dir: Path, workdir: Path) -> Result:
    out = workdir / name
    shutil.rmtree(out, ignore_errors=True)
    home, repo = out / "home", out / "repo"
    home.mkdir(parents=True)
    repo.mkdir()
    (repo / "README.md").write_text("# scratch\n\nA scratch repository for one agent task.\n")
    git_env = {**os.environ, "HOME": str(home), "GIT_AUTHOR_NAME": "e2e", "GIT_AUTHOR_EMAIL": "e2e@localhost",
               "GIT_COMMITTER_NAME": "e2e", "GIT_COMMITTER_EMAIL": "e2e@localhost"}
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, env=git_env)
    subprocess.run(["git", "add", "README.md"], cwd=repo, check=True, env=git_env)
    subprocess.run(["git", "commit", "-qm", "scratch"], cwd=repo, check=True, env=git_env)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv, extra = agent_command(name, bin_dir, base, model, args.task, home, repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "OPENCODE_", "QWEN_"))}
    env.update(HOME=str(home), PWD=str(repo), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"), CI="1", **extra)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    (out / "command.txt").write_text(" ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items()) + " " + shlex.join(argv) + "\n")
    print(f"\n== {name} {version}: {shlex.join(argv)}", flush=True)
    before = counter(url, "quanta:prompt_tokens"), counter(url, "quanta:prefix_cache_hits")
    recorder = None
    if args.record:
        recorder = start_recorder(url, args.record / f"{name}.jsonl", out)
    t0 = time.monotonic()
    try:
        code, records = _run_proxied(argv, env, repo, out, port, recorder.base_url if recorder else url, args.timeout)
    finally:
        if recorder is not None:  # SIGTERM: requests still running are written as incomplete, the file closed
            recorder.stop()
    if recorder is not None:
        sessions_file = args.record / f"{name}.jsonl"
        n = annotate_sessions(sessions_file, {"agent": name, "agent_package": AGENTS[name][0], "agent_version": version,
                                              "task": args.task, "command": (out / "command.txt").read_text().strip(),
                                              **args.record_meta})
        print(f"   recorded {n} requests to {sessions_file}", flush=True)
    after = counter(url, "quanta:prompt_tokens"), counter(url, "quanta:prefix_cache_hits")
    result = Result(name, version, code, time.monotonic() - t0, records, int(after[0] - before[0]), int(after[1] - before[1]))
    row = result.row()
    print(f"   exit {row['exit_code']} in {row['seconds']} s; {row['requests']} requests ({row['statuses']}); "
          f"prompt tokens {row['prompt_tokens']} (largest {row['largest_prompt']})", flush=True)
    print("   stdout:", (out / "stdout.txt").read_text()[-400:].strip().replace("\n", " | "), flush=True)
    if code != 0:
        print("   stderr:", (out / "stderr.txt").read_text()[-1500:].strip(), flush=True)
    return result


def _run_proxied(argv: list[str], env: dict, repo: Path, out: Path, port: int, upstream: str,
                 timeout: float) -> tuple[int | None, list[Record]]:
    """Run the agent against the logging proxy on ``port`` (forwarding to ``upstream``); returns its exit code
    (None: timed out) and the proxy's records."""
    with Proxy(upstream, port, out / "requests.jsonl") as proxy, (out / "stdout.txt").open("w") as so, \
            (out / "stderr.txt").open("w") as se:
        proc = subprocess.Popen(argv, cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=so, stderr=se,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # timed out, or this script was stopped: the agent's whole process group goes
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        deadline = time.monotonic() + 30  # requests the agent abandoned finish their records
        while proxy.inflight and time.monotonic() < deadline:
            time.sleep(0.2)
        return code, list(proxy.records)


# --------------------------------------------------------------------------- report


def machine() -> str:
    flags = sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|avx2|fma)\b", Path("/proc/cpuinfo").read_text())))
    return f"{platform.machine()}, {os.cpu_count()} cpus, {' '.join(flags)}"


def markdown(results: list[Result], meta: dict) -> str:
    lines = ["| agent | version | exit | requests | statuses | all 2xx | prompt tokens (all) | of them cached | "
             "largest prompt | seconds | routes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        w = r.row()
        lines.append(f"| {w['agent']} | {w['version']} | {w['exit_code']} | {w['requests']} | {w['statuses']} | "
                     f"{'yes' if w['all_2xx'] else 'no'} | {w['prompt_tokens']} | {w['cached_tokens']} | "
                     f"{w['largest_prompt']} | {w['seconds']} | {w['routes']} |")
    head = [f"- date: {meta['date']}", f"- machine: {meta['machine']}", f"- node: {meta['node']}",
            f"- command: `{meta['command']}`", f"- server: `{meta['server']}`", f"- task: {meta['task']!r}"]
    return "\n".join(head) + "\n\n" + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", nargs="+", choices=list(AGENTS), default=list(AGENTS))
    ap.add_argument("--latest", action="store_true", help="install each agent's newest npm release instead of the pinned one")
    ap.add_argument("--npm-prefix", type=Path, default=Path(tempfile.gettempdir()) / "quanta-coding-agents" / "npm")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "quanta-coding-agents" / "run",
                    help="server log, each agent's HOME, repository, output and requests")
    ap.add_argument("--max-model-len", type=int, default=17408,
                    help="the largest first prompt (about 15,000 tokens) plus room: output caps are clamped to the room, "
                         "so this bounds how long a looping answer runs on a small CPU (default 17408)")
    ap.add_argument("--serve-args", default="", help="more quanta serve flags, e.g. '--max-num-seqs 2'")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per agent")
    ap.add_argument("--task", default=DEFAULT_TASK)
    ap.add_argument("--no-isolate", action="store_true", help="run on the host network instead of a loopback-only namespace")
    ap.add_argument("--skip-install", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    ap.add_argument("--record", type=Path, metavar="DIR",
                    help="also record each agent's requests with quanta record to DIR/AGENT.jsonl (a sessions file)")
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stopped: clean up as on an error
    prefix = args.npm_prefix.resolve()
    if not args.skip_install:
        install(prefix, args.agents, args.latest)
    if not args.no_isolate and os.environ.get(ISOLATED_ENV) != "1":
        argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--skip-install"]
        os.environ[ISOLATED_ENV] = "1"
        os.execvp("unshare", ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv])
    versions = {n: installed_version(prefix, AGENTS[n][0]) or "?" for n in args.agents}

    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    if args.record:
        args.record = args.record.resolve()
        args.record.mkdir(parents=True, exist_ok=True)
        args.record_meta = {"server": f"quanta serve --max-model-len {args.max_model_len} {args.serve_args}".strip(),
                            "node": node, "machine": machine(), "isolated": not args.no_isolate}
    server = start_server(args, workdir)
    results = []
    try:
        model = model_id(server.base_url)
        for name in args.agents:
            results.append(run_agent(name, versions[name], args, server.base_url, model, prefix / "node_modules" / ".bin",
                                     workdir))
    finally:
        server.stop()
    command = shlex.join(["python", "benchmarks/coding_agents.py", *[a for a in sys.argv[1:] if a != "--skip-install"]])
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(), "node": node,
            "command": command, "task": args.task, "isolated": not args.no_isolate,
            "server": f"quanta serve --max-model-len {args.max_model_len} {args.serve_args}".strip()}
    table = markdown(results, meta)
    print("\n" + table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.md").write_text(table)
        Path(f"{args.out}.json").write_text(json.dumps({**meta, "results": [
            {**r.row(), "requests_log": [rec.__dict__ for rec in r.records]} for r in results]}, indent=1) + "\n")
    sys.exit(0 if all(r.exit_code == 0 and r.row()["all_2xx"] for r in results) else 1)


if __name__ == "__main__":
    main()
