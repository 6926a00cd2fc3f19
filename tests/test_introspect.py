"""``/version``, ``/v1/models/{id}``, and llama-server's ``/props`` and ``/slots`` on a real server."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from quanta import __version__


def get(server, path: str) -> httpx.Response:
    return httpx.get(server.base_url + path, timeout=30)


def test_version(server):
    assert get(server, "/version").json() == {"version": __version__, "server": "quanta"}


def test_one_model_by_id_with_the_official_client(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=60, max_retries=0)
    card = client.models.retrieve(server.model)
    assert card.id == server.model and card.owned_by == "quanta"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")


def test_props_in_llama_servers_shape(server):
    props = get(server, "/props").json()
    flags = dict(zip(server.flags[::2], server.flags[1::2]))
    assert props["total_slots"] == int(flags["--max-num-seqs"])
    assert props["default_generation_settings"]["n_ctx"] == int(flags["--max-model-len"])
    assert props["model_alias"] == server.model and "<|im_start|>" in props["chat_template"]
    assert props["eos_token"] and props["build_info"] == f"quanta {__version__}"


def test_slots_show_a_running_request_and_no_text(server):
    idle = get(server, "/slots").json()
    assert len(idle) == int(dict(zip(server.flags[::2], server.flags[1::2]))["--max-num-seqs"])
    assert [s["id"] for s in idle] == list(range(len(idle)))
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=120, max_retries=0)
    secret = "zebra-secret " * 20
    done = threading.Event()

    def generate():
        client.completions.create(model=server.model, prompt=secret, max_tokens=200, temperature=0,
                                  extra_body={"ignore_eos": True})
        done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    seen = []
    while not done.is_set() and not seen:
        seen = [s for s in get(server, "/slots").json() if s["is_processing"]]
        time.sleep(0.02)
    worker.join(timeout=120)
    assert seen, "the request never showed in /slots"
    slot = seen[0]
    assert slot["n_prompt_tokens"] > 20 and slot["n_ctx"] > 0 and "id_task" in slot
    assert 0 <= slot["next_token"][0]["n_decoded"] <= 200
    assert "zebra" not in str(seen)
