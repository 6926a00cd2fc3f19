"""A tiny real OpenAI-compatible HTTP server for tests of ``bench sweep --server-cmd``.

Standard library only, so it starts in a fraction of a second. It behaves
like llama-server where the sweep tests need it to:

- the batch knobs are applied as llama.cpp applies them: ``n_batch =
  min(--batch-size, --ctx-size)``, ``n_ubatch = min(--ubatch-size, n_batch)``,
  and logged as ``llama_context: n_ubatch = N``; ``GET /props`` returns them;
- ``GET /health`` is 503 until ``--load-delay`` seconds have passed, then 200;
- ``--batch-size 0`` is refused at startup (exit code 1);
- ``POST /v1/completions`` and ``/v1/chat/completions`` stream ``max_tokens``
  one-word chunks, then ``usage`` and ``data: [DONE]``;
- on SIGTERM it writes ``STATE_DIR/PORT.stopped`` (when ``--state-dir`` is
  given) and exits 0, so a test can see that every server was stopped.

Run: ``python tests/fake_openai_server.py --port 8123 --ubatch-size 64``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ctx-size", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--ubatch-size", type=int, default=512)
    p.add_argument("--load-delay", type=float, default=0.3)
    p.add_argument("--state-dir")
    p.add_argument("--model-name", default="fake-model")
    return p.parse_args(argv)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-openai/1"

    def log_message(self, fmt, *args):  # quiet: the log holds only the startup lines
        pass

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        s = self.server.settings
        if self.path == "/health":
            ready = time.monotonic() >= self.server.ready_at
            return self._json(200, {"status": "ok"}) if ready else self._json(503, {"error": {"code": 503, "message": "Loading model"}})
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [{"id": s["model"], "object": "model"}]})
        if self.path == "/props":
            return self._json(200, {"n_batch": s["n_batch"], "n_ubatch": s["n_ubatch"],
                                    "default_generation_settings": {"n_ctx": s["n_ctx"]}})
        return self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found_error"}})

    def _chunk(self, payload: str) -> None:
        data = payload.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self):
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found_error"}})
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        chat = self.path.endswith("chat/completions")
        text = " ".join(m.get("content", "") for m in body.get("messages", [])) if chat else str(body.get("prompt", ""))
        n = int(body.get("max_tokens") or 16)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(n):
            time.sleep(0.002)
            choice = {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
            self._chunk(f"data: {json.dumps({'id': 'x', 'choices': [{**choice, 'finish_reason': None}]})}\n\n")
        self._chunk(f"data: {json.dumps({'id': 'x', 'choices': [{'index': 0, 'text': '', 'delta': {}, 'finish_reason': 'length'}]})}\n\n")
        usage = {"prompt_tokens": len(text.split()), "completion_tokens": n, "total_tokens": len(text.split()) + n}
        self._chunk(f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n")
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main(argv: list[str]) -> int:
    a = _parse(argv)
    if a.batch_size < 1 or a.ubatch_size < 1:
        print(f"error: invalid batch sizes --batch-size {a.batch_size} --ubatch-size {a.ubatch_size}", flush=True)
        return 1
    n_batch = min(a.batch_size, a.ctx_size)
    settings = {"model": a.model_name, "n_ctx": a.ctx_size, "n_batch": n_batch, "n_ubatch": min(a.ubatch_size, n_batch)}
    httpd = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    httpd.daemon_threads = True
    httpd.settings = settings
    httpd.ready_at = time.monotonic() + a.load_delay
    for key in ("n_ctx", "n_batch", "n_ubatch"):
        print(f"llama_context: {key:<8} = {settings[key]}", flush=True)

    def stop(signum, frame):
        if a.state_dir:
            Path(a.state_dir, f"{a.port}.stopped").write_text("SIGTERM\n")
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    httpd.serve_forever(poll_interval=0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
