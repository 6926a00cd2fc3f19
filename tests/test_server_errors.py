"""Bad requests get their status and an OpenAI-style error body, and do not
disturb a streaming request that runs at the same time.

Raw httpx is used because the ``openai`` client refuses to send most of these.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from quanta.server.protocol import MAX_STOP, MAX_STOP_CHARS

MAX_MODEL_LEN = 512  # the session server's --max-model-len
BACKGROUND_TOKENS = 400  # far more than it ever reads: the stream is still generating when the bad request is answered
TOKENS_AFTER = 3  # tokens the stream must still deliver after the bad request was answered


class BackgroundStream(threading.Thread):
    """A long streaming completion read on its own thread: it keeps reading until
    ``TOKENS_AFTER`` tokens arrived after :attr:`answered` was set, then closes
    (the server aborts it). A stream that ended, errored or stalled instead fails :meth:`check`."""

    def __init__(self, server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.started = threading.Event()
        self.answered = threading.Event()
        self.finished_at: float | None = None
        self.lines: list[str] = []
        self.after = 0
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": self.server.model, "prompt": "Once upon a time", "max_tokens": BACKGROUND_TOKENS,
                "temperature": 0, "stream": True, "ignore_eos": True}
        try:
            with httpx.Client(timeout=60) as http:
                with http.stream("POST", self.server.base_url + "/v1/completions", json=body) as resp:
                    self.status = resp.status_code
                    for line in resp.iter_lines():
                        if not line.strip():
                            continue
                        self.lines.append(line)
                        self.started.set()
                        if self.answered.is_set():
                            self.after += 1
                            if self.after >= TOKENS_AFTER:
                                break
        except BaseException as exc:  # reported by check()
            self.error = exc
        finally:
            self.finished_at = time.monotonic()
            self.started.set()

    def check(self) -> None:
        self.join(timeout=90)
        assert not self.is_alive(), "the background stream stalled"
        assert self.error is None, repr(self.error)
        assert self.status == 200
        assert self.after >= TOKENS_AFTER, f"the stream ended after the bad request: {self.lines[-2:]}"
        events = [json.loads(line[len("data: "):]) for line in self.lines]  # never [DONE]: it stopped reading first
        assert all("error" not in e for e in events), events[-1]
        assert "".join(e["choices"][0]["text"] for e in events)
        assert all(e["choices"][0]["finish_reason"] is None for e in events)


def _cases(model: str) -> list[tuple[str, str, object, int, list[str], str | None]]:
    """(id, endpoint, body (str = raw bytes), status, message fragments, param)."""
    chat = lambda **kw: {"model": model, "messages": [{"role": "user", "content": "hi"}], **kw}  # noqa: E731
    comp = lambda **kw: {"model": model, "prompt": "hi", **kw}  # noqa: E731
    return [
        ("malformed-json-completions", "completions", '{"model": "m", "prompt": "hi",', 400, ["JSON"], None),
        ("malformed-json-chat", "chat/completions", '{"model": ', 400, ["JSON"], None),
        ("body-not-an-object", "completions", "[1, 2]", 400, [], None),
        ("max-tokens-string", "completions", comp(max_tokens="ten"), 400, ["max_tokens"], "max_tokens"),
        ("max-tokens-float", "chat/completions", chat(max_tokens=1.5), 400, ["max_tokens"], "max_tokens"),
        ("messages-not-a-list", "chat/completions", {"model": model, "messages": "hi"}, 400, ["messages"], "messages"),
        ("prompt-a-number", "completions", {"model": model, "prompt": 5}, 400, ["prompt"], None),
        ("missing-prompt", "completions", {"model": model}, 400, ["prompt"], "prompt"),
        ("max-tokens-0-completions", "completions", comp(max_tokens=0), 400, ["max_tokens"], "max_tokens"),
        ("max-tokens-neg-completions", "completions", comp(max_tokens=-1), 400, ["max_tokens"], "max_tokens"),
        ("max-tokens-0-chat", "chat/completions", chat(max_tokens=0), 400, ["max_tokens"], "max_tokens"),
        ("max-tokens-neg-chat", "chat/completions", chat(max_tokens=-1), 400, ["max_tokens"], "max_tokens"),
        ("max-completion-tokens-0", "chat/completions", chat(max_completion_tokens=0), 400,
         ["max_completion_tokens"], "max_completion_tokens"),
        ("max-tokens-0-streaming", "completions", comp(max_tokens=0, stream=True), 400, ["max_tokens"], "max_tokens"),
        ("temperature-3", "completions", comp(temperature=3), 400, ["temperature"], "temperature"),
        ("temperature-neg", "chat/completions", chat(temperature=-1), 400, ["temperature"], "temperature"),
        ("empty-messages", "chat/completions", {"model": model, "messages": []}, 400, ["messages"], "messages"),
        ("unknown-role", "chat/completions", {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
         ["role"], "messages.0.role"),
        ("unknown-model-completions", "completions", {"model": "no-such-model", "prompt": "hi"}, 404, ["no-such-model"], "model"),
        ("unknown-model-chat", "chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404,
         ["no-such-model"], "model"),
        ("prompt-alone-too-long", "completions", {"model": model, "prompt": [1000] * (MAX_MODEL_LEN + 10)}, 400,
         [str(MAX_MODEL_LEN + 10), str(MAX_MODEL_LEN - 1)], None),
        ("n-2-completions", "completions", comp(n=2), 400, ["n"], "n"),
        ("n-2-chat", "chat/completions", chat(n=2), 400, ["n"], "n"),
        ("token-id-too-large", "completions", {"model": model, "prompt": [1, 10_000_000]}, 400, ["10000000", "vocabulary"], "prompt"),
        ("token-id-negative", "completions", {"model": model, "prompt": [5, -1]}, 400, ["-1", "vocabulary"], "prompt"),
        ("empty-prompt-string", "completions", comp(prompt=""), 400, ["prompt", "at least 1"], "prompt"),
        ("empty-prompt-ids", "completions", comp(prompt=[]), 400, ["prompt", "at least 1"], "prompt"),
        ("empty-prompt-in-list", "completions", comp(prompt=[""]), 400, ["prompt.0", "at least 1"], "prompt.0"),
        # issue 12: each of these once reached the engine (a 500, or a step that failed every request)
        ("seed-2-64", "completions", comp(seed=2**64), 400, ["seed"], "seed"),
        ("seed-below-int64", "chat/completions", chat(seed=-(2**63) - 1), 400, ["seed"], "seed"),
        ("temperature-nan", "completions", f'{{"model": "{model}", "prompt": "hi", "temperature": NaN}}', 400,
         ["temperature", "finite"], "temperature"),
        ("top-p-infinity", "chat/completions",
         f'{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}], "top_p": Infinity}}', 400,
         ["top_p"], "top_p"),
        ("temperature-string", "completions", comp(temperature="0.5"), 400, ["temperature"], "temperature"),
        ("top-k-float", "completions", comp(top_k=2.5), 400, ["top_k"], "top_k"),
        ("min-p-above-1", "chat/completions", chat(min_p=1.5), 400, ["min_p"], "min_p"),
        ("presence-penalty-3", "completions", comp(presence_penalty=3), 400, ["presence_penalty"], "presence_penalty"),
        ("frequency-penalty-neg", "chat/completions", chat(frequency_penalty=-2.5), 400, ["frequency_penalty"], "frequency_penalty"),
        ("max-tokens-digit-string", "completions", comp(max_tokens="4"), 400, ["max_tokens"], "max_tokens"),
        ("max-tokens-bool", "chat/completions", chat(max_tokens=True), 400, ["max_tokens"], "max_tokens"),
        ("max-completion-tokens-string", "chat/completions", chat(max_completion_tokens="4"), 400,
         ["max_completion_tokens"], "max_completion_tokens"),
        ("stream-string", "completions", comp(stream="yes"), 400, ["stream"], "stream"),
        ("token-ids-booleans", "completions", comp(prompt=[True, False]), 400, ["prompt", "boolean"], "prompt"),
        ("too-many-stop-strings", "completions", comp(stop=["x" * 60] * 20_000), 400, ["stop", "32"], "stop"),
        ("stop-string-too-long", "chat/completions", chat(stop=["end", "x" * 257]), 400, ["stop[1]", "256"], "stop"),
        ("lone-surrogate-prompt", "completions", f'{{"model": "{model}", "prompt": "a\\ud800b"}}', 400, ["surrogate"], "prompt"),
        ("lone-surrogate-chat", "chat/completions", f'{{"model": "{model}", "messages": [{{"role": "user", "content": "a\\udc00"}}]}}', 400,
         ["surrogate"], "messages"),
        ("prompt-chars-beyond-context", "completions", comp(prompt="word " * 20_000), 400,
         ["100000 characters", str(MAX_MODEL_LEN - 1)], "prompt"),
        ("nested-json-completions", "completions", '{"model": "m", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, [], None),
        ("nested-json-chat", "chat/completions", "[" * 100_000 + "]" * 100_000, 400, [], None),
    ]


_CASE_IDS = [c[0] for c in _cases("m")]


@pytest.mark.parametrize("case_id", _CASE_IDS)
def test_bad_request_gets_openai_error_and_spares_a_running_stream(server, case_id):
    case = {c[0]: c for c in _cases(server.model)}[case_id]
    _, endpoint, body, status, fragments, param = case
    background = BackgroundStream(server)
    background.start()
    assert background.started.wait(60), "the background stream produced nothing"
    assert background.finished_at is None, "the background stream ended before the bad request was sent"

    url = f"{server.base_url}/v1/{endpoint}"
    if isinstance(body, str):
        resp = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        resp = httpx.post(url, json=body, timeout=30)
    answered_at = time.monotonic()

    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json"), resp.headers["content-type"]
    payload = resp.json()
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    for fragment in fragments:
        assert fragment in error["message"], f"{fragment!r} not in {error['message']!r}"
    if param is not None:
        assert error["param"] == param, error
    if status == 404:
        assert error["code"] == "model_not_found"

    background.answered.set()
    background.check()
    assert background.finished_at > answered_at
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_unknown_route_gets_an_openai_error_body(server):
    resp = httpx.get(server.base_url + "/v1/no-such-route", timeout=10)
    assert resp.status_code == 404
    assert resp.json()["error"]["message"]


def test_no_request_is_left_behind_after_the_errors(server):
    """None of the rejected requests took a slot or a queue place."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
        values = dict(
            line.split(" ", 1) for line in text.splitlines()
            if line.startswith(("quanta:num_requests_running ", "quanta:num_requests_waiting "))
        )
        if float(values["quanta:num_requests_running"]) == 0 and float(values["quanta:num_requests_waiting"]) == 0:
            break
        assert time.monotonic() < deadline, f"requests still resident: {values}"
        time.sleep(0.1)


def test_openapi_schema_states_the_limits(server):
    """/openapi.json says n is 1 and bounds the stop strings (issue 12), as the validators enforce."""
    schemas = httpx.get(server.base_url + "/openapi.json", timeout=30).json()["components"]["schemas"]
    for name in ("ChatRequest", "CompletionsRequest"):
        props = schemas[name]["properties"]
        assert props["n"]["minimum"] == props["n"]["maximum"] == 1
        text, listed = props["stop"]["anyOf"][:2]
        assert text["maxLength"] == listed["items"]["maxLength"] == MAX_STOP_CHARS and listed["maxItems"] == MAX_STOP
