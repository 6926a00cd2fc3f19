"""``quanta generate``: one prompt through the engine, streamed to stdout."""

from __future__ import annotations

import sys

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.sampling import SamplingParams
from quanta.launch import build_engine, load_model, resolve_dtype
from quanta.model.tokenizer import Tokenizer
from quanta.server.chat_tokens import chat_prompt_ids


def prompt_ids(tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    """Ids of ``prompt``: as written (special-token text included), or with ``chat`` as one user
    message through the model's template, where it cannot forge a control token (as the server does).

    Raises:
        ValueError: ``chat`` and the model has no chat template, or its template rewrites the
            text and the text holds control-token text.
    """
    if chat:
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def generate_cli(engine_cfg: EngineConfig, sched_cfg: SchedulerConfig, prompt: str, max_tokens: int, temperature: float, chat: bool) -> int:
    """Print the completion of ``prompt``; returns the exit code (2 for a bad request)."""
    loaded = load_model(engine_cfg.model, resolve_dtype(engine_cfg.dtype), engine_cfg.quantization, engine_cfg.native_decode,
                        engine_cfg.prompt_weights)
    engine = build_engine(loaded, engine_cfg, sched_cfg)
    try:
        ids = prompt_ids(loaded.tokenizer, prompt, chat)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        engine.add_request(ids, params)
    except ValueError as exc:
        print(f"quanta generate: error: {exc}", file=sys.stderr)
        return 2
    while engine.has_work():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    t = engine.trace
    print(f"[{t.num_prefill_steps} prefill / {t.num_decode_steps} decode / {t.num_mixed_steps} mixed steps]", file=sys.stderr)
    return 0
