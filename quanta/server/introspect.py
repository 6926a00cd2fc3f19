"""What tools ask a server about itself: ``GET /version``, ``GET /v1/models/{id}``, and
llama-server's ``GET /props`` and ``GET /slots`` in llama-server's shapes (the fields quanta
has; values it does not have, such as sampler settings it does not default, are left out).

``/slots`` lists the engine's KV slots (``--max-num-seqs``): for a resident request its
engine id, prompt tokens, computed and cached prompt tokens and generated tokens, never its
text. It is an operator route (:data:`quanta.server.access.OPERATOR_PATHS`).
"""

from __future__ import annotations

from fastapi import APIRouter

from quanta import __version__
from quanta.server.errors import APIError
from quanta.server.serving import ServerState, check_model


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.get("/version")
    async def version() -> dict:
        return {"version": __version__, "server": "quanta"}

    @routes.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(state, model_id)
        return model_card(state, model_id)

    @routes.get("/props")
    async def props() -> dict:
        return props_body(state)

    @routes.get("/slots")
    async def slots() -> list[dict]:
        return slots_body(state)

    return routes


def model_card(state: ServerState, name: str) -> dict:
    """OpenAI's model object for one served name (``GET /v1/models`` lists one per name)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "quanta", "max_model_len": state.max_model_len}


def props_body(state: ServerState) -> dict:
    """llama-server's ``/props``: context per slot, slots, model, chat template(s), special tokens."""
    hf = state.tokenizer.hf
    templates = hf.chat_template if isinstance(hf.chat_template, dict) else {"default": hf.chat_template}
    body = {
        "default_generation_settings": {"n_ctx": state.max_model_len, "params": {}},
        "total_slots": state.config.get("max_num_seqs"),
        "model_alias": state.model_name,
        "model_path": state.config.get("model"),
        "modalities": {"vision": False, "video": False, "audio": False},
        "chat_template": templates.get("default") or "",
        "bos_token": hf.bos_token or "",
        "eos_token": hf.eos_token or "",
        "build_info": f"quanta {__version__}",
        "is_sleeping": False,
    }
    if templates.get("tool_use"):
        body["chat_template_tool_use"] = templates["tool_use"]
    return body


def slots_body(state: ServerState) -> list[dict]:
    """One entry per KV slot, llama-server's fields; a snapshot of the engine thread's running list."""
    if not state.async_engine.alive:
        raise APIError(503, "the engine thread stopped", None, "unavailable")
    resident = {seq.slot: seq for seq in list(state.async_engine.engine.scheduler.running) if seq.slot is not None}
    total = state.config.get("max_num_seqs") or len(resident)
    return [_slot(i, resident.get(i), state.max_model_len) for i in range(total)]


def _slot(index: int, seq, n_ctx: int) -> dict:
    slot = {"id": index, "n_ctx": n_ctx, "speculative": False, "is_processing": seq is not None}
    if seq is None:
        return slot
    generated = len(seq.output_token_ids)
    return slot | {
        "id_task": seq.seq_id,
        "n_prompt_tokens": seq.num_prompt_tokens,
        "n_prompt_tokens_processed": min(seq.num_computed_tokens, seq.num_prompt_tokens) - seq.num_cached_tokens,
        "n_prompt_tokens_cache": seq.num_cached_tokens,
        "next_token": [{"has_next_token": True, "n_remain": max(seq.params.max_tokens - generated, 0),
                        "n_decoded": generated}],
    }
