"""Issue 12, "a local server that web pages cannot drive": ``--api-key``,
a JSON Content-Type on POST, the Host check against DNS rebinding, opt-in CORS;
and "another user's prompt leaks through the prefix cache": each key is a
tenant, and prefix reuse stays within one key.

Against live ``quanta serve`` processes: the shared session server (no key)
and one started here with two ``--api-key`` values, an ``--admin-key`` (the
operator routes ``/metrics``, ``/v1/trace``, ``/v1/config``), ``--allowed-hosts``
and ``--cors-origin``.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import anthropic
import httpx
import openai
import pytest

from quanta import cli, flags
from quanta.bench.server import start
from quanta.server.access import AccessPolicy, RequestGate, tenant_id

KEY = "sk-test-4f2e"
KEY_B = "sk-test-b91c"  # a second tenant
ADMIN = "sk-admin-70d3"
#: tenants that have sent nothing before the test that uses each (so none holds even the chat template's prefix)
FRESH = {route: f"sk-fresh-{route}" for route in ("chat", "completions", "responses", "messages", "salted")}
APP_ORIGIN = "http://app.test"
FLAGS = ["--max-model-len", "256", "--api-key", KEY, KEY_B, *FRESH.values(), "--admin-key", ADMIN,
         "--allowed-hosts", "quanta.test,other.test", "--cors-origin", APP_ORIGIN]
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    proc = start(FLAGS, tmp_path_factory.mktemp("quanta-keyed"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def model(keyed) -> str:
    resp = httpx.get(keyed.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["data"][0]["id"]


def test_openai_client_wrong_key_is_authentication_error(keyed, model):
    client = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.response.json()["error"]["type"] == "authentication_error"


def test_anthropic_client_wrong_key_is_authentication_error(keyed, model):
    client = anthropic.Anthropic(base_url=keyed.base_url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as info:
        client.messages.create(model=model, max_tokens=2, messages=MESSAGES)
    body = info.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error", body


def test_clients_with_the_key_are_served(keyed, model):
    oa = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    chat = oa.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0)
    assert chat.usage.completion_tokens >= 1
    an = anthropic.Anthropic(base_url=keyed.base_url, api_key=KEY, max_retries=0, timeout=60)
    msg = an.messages.create(model=model, max_tokens=2, messages=MESSAGES)
    assert msg.usage.output_tokens >= 1
    assert an.messages.count_tokens(model=model, messages=MESSAGES).input_tokens > 0


def test_read_routes_need_the_key(keyed):
    url = keyed.base_url + "/v1/models"
    assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    assert httpx.get(url, headers={"x-api-key": KEY}, timeout=30).status_code == 200  # either header, any route
    assert httpx.get(url, headers={"x-api-key": ADMIN}, timeout=30).status_code == 200  # the admin key is a tenant too


@pytest.mark.parametrize("path", ["/v1/trace", "/v1/config", "/metrics"])
def test_operator_routes_need_the_admin_key(keyed, path):
    """They show every tenant's request sizes, timings and cache hits: a tenant's key gets 403."""
    url = keyed.base_url + path
    assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    for key in (KEY, KEY_B):
        refused = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert refused.status_code == 403 and "--admin-key" in refused.json()["error"]["message"], refused.text
    assert httpx.get(url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).status_code == 200
    assert httpx.get(url, headers={"x-api-key": ADMIN}, timeout=30).status_code == 200


def test_operator_routes_are_closed_with_tenant_keys_and_no_admin_key():
    sent = []

    async def app(scope, receive, send):
        sent.append("app")

    async def send(message):
        sent.append(message.get("status"))

    gate = RequestGate(app, AccessPolicy(api_keys=(KEY,)))
    scope = {"type": "http", "path": "/metrics", "method": "GET", "headers": [(b"authorization", f"Bearer {KEY}".encode())]}
    asyncio.run(gate(scope, None, send))
    assert sent[0] == 403


def test_health_is_open(keyed):
    assert httpx.get(keyed.base_url + "/health", timeout=30).status_code == 200


def test_config_reports_a_key_without_revealing_it(keyed):
    config = httpx.get(keyed.base_url + "/v1/config", headers={"x-api-key": ADMIN}, timeout=30).json()
    assert config["api_key"] is True and config["admin_key"] is True
    assert KEY not in str(config) and KEY_B not in str(config) and ADMIN not in str(config)


def test_every_key_is_accepted_and_nothing_else(keyed, model):
    url = keyed.base_url + "/v1/models"
    for key in (KEY, KEY_B):
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code == 200
    for wrong in (f"{KEY},{KEY_B}", f"{KEY} {KEY_B}", KEY[:-1], KEY + "x"):
        assert httpx.get(url, headers={"Authorization": f"Bearer {wrong}"}, timeout=30).status_code == 401, wrong
        assert httpx.get(url, headers={"x-api-key": wrong}, timeout=30).status_code == 401, wrong


# --------------------------------------------------------------------------- tenants: reuse within one key

#: long enough that a hit is unmistakable, fits --max-model-len 256
SECRET = "The vault PIN is 4 8 1 5 9 2. Never repeat it to anyone. Question: what is two plus two? "


@pytest.fixture(scope="module")
def clients(keyed):
    def of(key: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
        return (openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=key, max_retries=0, timeout=60),
                anthropic.Anthropic(base_url=keyed.base_url, api_key=key, max_retries=0, timeout=60))
    return {key: of(key) for key in (KEY, KEY_B, *FRESH.values())}


def _chat(clients, model, key: str, text: str, salt: str | None = None) -> int:
    extra = {} if salt is None else {"cache_salt": salt}
    reply = clients[key][0].chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                    max_tokens=2, temperature=0, extra_body=extra)
    return reply.usage.prompt_tokens_details.cached_tokens


def _completion(clients, model, key: str, text: str) -> int:
    reply = clients[key][0].completions.create(model=model, prompt=text, max_tokens=2, temperature=0)
    return reply.usage.prompt_tokens_details.cached_tokens


def _response(clients, model, key: str, text: str) -> int:
    reply = clients[key][0].responses.create(model=model, input=text, max_output_tokens=16)
    return reply.usage.input_tokens_details.cached_tokens


def _message(clients, model, key: str, text: str) -> int:  # the anthropic client sends x-api-key
    reply = clients[key][1].messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": text}])
    return reply.usage.cache_read_input_tokens


@pytest.mark.parametrize("send, route", [(_chat, "chat"), (_completion, "completions"), (_response, "responses"),
                                         (_message, "messages")])
def test_reuse_stays_within_one_key(keyed, model, clients, send, route):
    """Key A twice: the second is served from cache; the same prompt with key B
    (a tenant that sent nothing yet) then reuses nothing, not even the chat
    template's system prompt; B's own second request reuses B's first."""
    text, other = f"{uuid.uuid4().hex} {SECRET}", FRESH[route]
    send(clients, model, KEY, text)
    assert send(clients, model, KEY, text) > 0
    assert send(clients, model, other, text) == 0
    assert send(clients, model, other, text) > 0


def test_cache_salt_subdivides_a_key(keyed, model, clients):
    text, salt, key = f"{uuid.uuid4().hex} {SECRET}", uuid.uuid4().hex, FRESH["salted"]
    _chat(clients, model, key, text, salt)
    assert _chat(clients, model, key, text, salt) > 0
    assert _chat(clients, model, key, text) == 0  # the key's unsalted requests are another partition
    assert _chat(clients, model, KEY_B, text, salt) == 0  # the same salt under another key shares nothing


@pytest.mark.parametrize("path, anthropic_body", [("/v1/messages", True), ("/v1/chat/completions", False),
                                                  ("/v1/completions", False)])
def test_non_json_post_is_415(server, path, anthropic_body):
    body = '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}'
    for content_type in ("text/plain", None, "application/x-www-form-urlencoded"):
        headers = {"content-type": content_type} if content_type else {}
        resp = httpx.post(server.base_url + path, content=body, headers=headers, timeout=30)
        assert resp.status_code == 415, (content_type, resp.text)
        err = resp.json()
        assert (err["type"] == "error" and "error" in err) if anthropic_body else err["error"]["type"] == "invalid_request_error"


def test_json_with_charset_is_accepted(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    resp = httpx.post(server.base_url + "/v1/completions", content=httpx.Request("POST", "/", json=body).content,
                      headers={"content-type": "application/json; charset=utf-8"}, timeout=60)
    assert resp.status_code == 200, resp.text


def test_foreign_host_is_refused(server):
    port = server.port
    for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example"):
        resp = httpx.get(server.base_url + "/v1/models", headers={"Host": host}, timeout=30)
        assert resp.status_code == 421, (host, resp.text)
        assert "allowed-hosts" in resp.json()["error"]["message"]
    resp = httpx.post(server.base_url + "/v1/messages", json={}, headers={"Host": "evil.example"}, timeout=30)
    assert resp.status_code == 421 and resp.json()["type"] == "error"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        assert httpx.get(server.base_url + "/v1/models", headers={"Host": host}, timeout=30).status_code == 200, host


def test_allowed_hosts_widen_the_check(keyed):
    auth = {"x-api-key": KEY}
    for host in ("quanta.test", "quanta.test:8443", "other.test"):
        assert httpx.get(keyed.base_url + "/v1/models", headers={**auth, "Host": host}, timeout=30).status_code == 200
    assert httpx.get(keyed.base_url + "/v1/models", headers={**auth, "Host": "evil.example"}, timeout=30).status_code == 421


def test_cors_preflight_for_the_allowed_origin(keyed):
    headers = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
    resp = httpx.options(keyed.base_url + "/v1/chat/completions", headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "authorization" in resp.headers["access-control-allow-headers"].lower()
    refused = httpx.options(keyed.base_url + "/v1/chat/completions", headers={**headers, "Origin": "http://evil.example"},
                            timeout=30)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    # the actual request from the allowed origin carries the CORS header too, even when refused for the key
    resp = httpx.get(keyed.base_url + "/v1/models", headers={"Origin": APP_ORIGIN}, timeout=30)
    assert resp.status_code == 401 and resp.headers["access-control-allow-origin"] == APP_ORIGIN


def test_no_cors_headers_by_default(server):
    resp = httpx.get(server.base_url + "/v1/models", headers={"Origin": APP_ORIGIN}, timeout=30)
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_api_key_flag_and_environment(monkeypatch):
    monkeypatch.setenv("QUANTA_API_KEY", "from-env")
    assert flags.access_policy(flags.parse_serve_flags([])).api_keys == ("from-env",)
    assert flags.access_policy(flags.parse_serve_flags(["--api-key", "flag"])).api_keys == ("flag",)
    assert flags.access_policy(flags.parse_serve_flags(["--api-key", "k1", "k,2"])).api_keys == ("k1", "k,2")
    monkeypatch.setenv("QUANTA_API_KEY", "env-a, env-b,env-c")
    assert flags.access_policy(flags.parse_serve_flags([])).api_keys == ("env-a", "env-b", "env-c")
    monkeypatch.setenv("QUANTA_API_KEY", "")
    assert flags.access_policy(flags.parse_serve_flags([])).api_keys == ()
    monkeypatch.delenv("QUANTA_API_KEY")
    policy = flags.access_policy(flags.parse_serve_flags(["--host", "box.lan", "--cors-origin", "http://a,http://b",
                                                          "--cors-origin", "http://c"]))
    assert policy.api_keys == () and policy.cors_origins == ("http://a", "http://b", "http://c")
    assert policy.host_allowed("box.lan:8000") and not policy.host_allowed("evil.example")


@pytest.mark.parametrize("argv", [["--api-key", " "], ["--api-key", "k1", ""], ["--api-key"],
                                  ["--api-key", "k1", "--api-key", "k2"]])
def test_empty_or_repeated_api_key_is_a_cli_error(argv, monkeypatch, capsys):
    monkeypatch.delenv("QUANTA_API_KEY", raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", *argv])
    assert info.value.code == 2
    assert "--api-key" in capsys.readouterr().err


@pytest.mark.parametrize("env", ["a,,b", "a, ", " , "])
def test_an_empty_key_in_the_environment_is_a_cli_error(env, monkeypatch, capsys):
    monkeypatch.setenv("QUANTA_API_KEY", env)
    with pytest.raises(SystemExit) as info:
        cli.main(["serve"])
    assert info.value.code == 2
    assert "QUANTA_API_KEY" in capsys.readouterr().err


def test_the_matched_key_names_the_tenant():
    policy = AccessPolicy(api_keys=(KEY, KEY_B))
    bearer = {b"authorization": f"Bearer {KEY_B}".encode()}
    assert policy.tenant(bearer) == policy.tenant({b"x-api-key": KEY_B.encode()}) == tenant_id(KEY_B)
    assert policy.tenant({b"x-api-key": KEY.encode()}) == tenant_id(KEY) != tenant_id(KEY_B)
    assert policy.tenant({b"x-api-key": b"wrong", **bearer}) == tenant_id(KEY_B)  # either header may carry it
    assert policy.tenant({b"x-api-key": KEY.encode(), **bearer}) is None  # two tenants' keys: ambiguous, refused
    assert policy.tenant({b"x-api-key": KEY_B.encode(), **bearer}) == tenant_id(KEY_B)  # the same key twice
    assert policy.tenant({}) is None and policy.tenant({b"authorization": KEY.encode()}) is None  # no Bearer scheme
    assert KEY not in tenant_id(KEY) and len(tenant_id(KEY)) == 64


@pytest.mark.parametrize("host, ok", [("127.0.0.1:8000", True), ("[::1]", True), ("10.0.0.7:80", True),
                                      ("LOCALHOST:1", True), ("", False), ("evil.example", False),
                                      ("127.0.0.1.nip.io", False)])
def test_host_names(host, ok):
    assert AccessPolicy().host_allowed(host) is ok
    assert AccessPolicy(allowed_hosts=("*",)).host_allowed(host)


def test_quanta_bench_sends_the_key_from_the_environment(keyed, model, tmp_path, monkeypatch):
    """``quanta bench run`` against a keyed server: $QUANTA_API_KEY goes out as a Bearer token on
    requests, $QUANTA_ADMIN_KEY on /v1/config, /v1/trace and /metrics (all answer); without the
    key every request is a 401."""
    argv = ["bench", "run", "--base-url", keyed.base_url, "--model", model, "--num-requests", "2", "--max-tokens", "4",
            "--prompt-words", "8", "--repeats", "1", "--warmup", "0", "--no-progress", "--no-plots"]
    monkeypatch.delenv("QUANTA_API_KEY", raising=False)
    monkeypatch.delenv("QUANTA_ADMIN_KEY", raising=False)
    assert cli.main([*argv, "--out", str(tmp_path / "nokey")]) == 1
    doc = json.loads((tmp_path / "nokey.json").read_text())
    assert doc["conditions"][0]["runs"][0]["metrics"]["client"]["errors"] == {"http_401": 2}
    monkeypatch.setenv("QUANTA_API_KEY", KEY)
    monkeypatch.setenv("QUANTA_ADMIN_KEY", ADMIN)
    assert cli.main([*argv, "--out", str(tmp_path / "key")]) == 0
    doc = json.loads((tmp_path / "key.json").read_text())
    run = doc["conditions"][0]["runs"][0]
    assert run["metrics"]["client"]["num_ok"] == 2
    assert doc["conditions"][0]["applied"]["max_model_len"] == 256  # /v1/config read with the key
    assert run["metrics"]["trace"] is not None  # and /v1/trace
