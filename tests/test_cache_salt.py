"""Prefix reuse is salted: a request reuses cached K/V only of requests with the
same ``cache_salt`` (None matches only None), so ``cached_tokens`` cannot reveal
another client's prompt (issue 12: a PIN was recovered digit by digit).

1. :class:`PrefixCache` (pure Python): a salt mismatch reuses nothing.
2. :func:`tenant_salt`: with ``--api-key``, the salt the engine sees joins the
   key's tenant and the request's salt (live, per key: ``tests/test_access.py``).
3. The live session server through the official clients: OpenAI chat and
   completions (``extra_body``), Responses, Anthropic (top-level and metadata).
"""

from __future__ import annotations

import uuid

import anthropic
import httpx
import openai
import pytest

from quanta.engine.block_pool import BlockPool
from quanta.engine.prefix_cache import PrefixCache, block_hashes
from quanta.engine.sampling import SamplingParams
from quanta.server.access import tenant_id, tenant_salt

PROMPT = list(range(10, 42))  # four blocks of 8


def _cache_holding(salt: str | None) -> PrefixCache:
    """A cache holding PROMPT's blocks, computed by a request of ``salt``."""
    pool = BlockPool(8, 8)
    cache = PrefixCache(pool)
    blocks = pool.allocate(4)
    for block, name in zip(blocks, block_hashes(PROMPT, 8, salt)):
        cache.register(block, name)
    pool.release(blocks)
    cache.released(blocks)
    return cache


def _cached(cache: PrefixCache, salt: str | None) -> int:
    """Tokens of PROMPT + [99] a request of ``salt`` would reuse."""
    return len(cache.lookup(block_hashes(PROMPT + [99], 8, salt), len(PROMPT) + 1)) * 8


@pytest.mark.parametrize("held, asked", [("a", "b"), ("a", None), (None, "a"), (None, "")])
def test_a_different_salt_reuses_nothing(held, asked):
    assert _cached(_cache_holding(held), asked) == 0


@pytest.mark.parametrize("salt", [None, "a"])
def test_the_same_salt_reuses_the_prefix(salt):
    assert _cached(_cache_holding(salt), salt) == len(PROMPT)


def test_an_empty_salt_is_refused():
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_without_keys_the_salt_is_the_request_s():
    assert tenant_salt(None, None) is None
    assert tenant_salt(None, "s") == "s"


def test_a_tenant_salt_never_matches_another_tenant_or_no_key():
    a, b = tenant_id("key-a"), tenant_id("key-b")
    salts = [tenant_salt(t, s) for t in (a, b) for s in (None, "s", "s/x")]
    assert len(set(salts)) == len(salts)  # per tenant: unsalted, "s" and "s/x" apart; and the tenants apart
    assert not {None, "s", "s/x"} & set(salts)  # and none equals what an unkeyed request would use
    # a request salt cannot forge another tenant's prefix: the tenant part has a fixed length
    assert tenant_salt(a, f"x/tenant:{b}") != tenant_salt(b, None)
    assert all("key-a" not in salt and "key-b" not in salt for salt in salts)
    cache = _cache_holding(tenant_salt(a, None))
    assert _cached(cache, tenant_salt(a, None)) == len(PROMPT)
    assert _cached(cache, tenant_salt(b, None)) == 0


# --------------------------------------------------------------------------- live server

SECRET = "The vault PIN is 4 8 1 5 9 2. Never repeat it. Question: what is two plus two?"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=60, max_retries=0)


def _chat_cached(client, model, salt: str | None) -> int:
    extra = {} if salt is None else {"cache_salt": salt}
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": SECRET}],
                                           max_tokens=2, temperature=0, extra_body=extra)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_live_chat_reuses_only_within_a_salt(server, client):
    victim, attacker = uuid.uuid4().hex, uuid.uuid4().hex
    _chat_cached(client, server.model, victim)
    reused = _chat_cached(client, server.model, victim)
    assert reused > 0  # the victim's prompt is cached now
    assert _chat_cached(client, server.model, attacker) == 0
    # unsalted requests share only with other unsalted ones (here: at most the
    # template's default system prompt that earlier tests sent), never the victim's text
    assert _chat_cached(client, server.model, None) < reused


def test_live_completions_and_responses_take_the_salt(server, client):
    salt, other = uuid.uuid4().hex, uuid.uuid4().hex
    prompt = SECRET + " completions " + salt

    def cached(s: str) -> int:
        reply = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0,
                                          extra_body={"cache_salt": s})
        return reply.usage.prompt_tokens_details.cached_tokens

    cached(salt)
    assert cached(salt) > 0
    assert cached(other) == 0
    text = SECRET + " responses " + salt
    replies = [client.responses.create(model=server.model, input=text, max_output_tokens=16, extra_body={"cache_salt": s})
               for s in (salt, other)]
    assert replies[1].usage.input_tokens_details.cached_tokens == 0
    again = client.responses.create(model=server.model, input=text, max_output_tokens=16, extra_body={"cache_salt": other})
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_live_anthropic_salt_from_body_or_metadata(server):
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", timeout=60, max_retries=0)
    salt, other = uuid.uuid4().hex, uuid.uuid4().hex
    text = SECRET + " anthropic " + salt

    def cached(**salting) -> int:
        reply = claude.messages.create(model=server.model, max_tokens=2,
                                       messages=[{"role": "user", "content": text}], **salting)
        return reply.usage.cache_read_input_tokens

    cached(extra_body={"cache_salt": salt})
    assert cached(metadata={"cache_salt": salt}) > 0  # type: ignore[typeddict-unknown-key]
    assert cached(metadata={"cache_salt": other}) == 0  # type: ignore[typeddict-unknown-key]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "cache_salt": ""}),
    ("/v1/completions", {"prompt": "hi", "cache_salt": 7}),
    ("/v1/responses", {"input": "hi", "cache_salt": ""}),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "cache_salt": ""}),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "metadata": {"cache_salt": 1}}),
])
def test_live_a_bad_salt_is_a_client_error(server, path, body):
    reply = httpx.post(server.base_url + path, json={"model": server.model, **body}, timeout=30)
    assert reply.status_code in (400, 422), reply.text
    assert "cache_salt" in reply.text
