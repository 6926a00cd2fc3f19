"""The served model as Ollama describes a model: names, ``/api/tags``, ``/api/show``, ``/api/ps``.

Names: each served model name (``--served-model-name``, the first and its
aliases) is listed with Ollama's ``:latest`` tag when it has none, and
accepted with or without it; a requested name without a tag asks for its
``:latest``, as Ollama reads names. ``size`` is the bytes of the weights the server
holds (for Ollama the model file's size; quanta holds its own forms of the
weights); ``digest`` identifies the served name and that size (it is not a
hash of a file). ``model_info`` takes GGUF's key names, with
``<architecture>.context_length`` the server's ``max_model_len`` (the context
a request can use, which clients read to size their prompts). ``template``
is the model's chat template, Jinja (not one of Ollama's Go templates).
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime

from quanta.model.config import ModelConfig
from quanta.server.errors import APIError, quoted

#: what ``/api/version`` answers: the release of Ollama's API this adapter follows
OLLAMA_API_VERSION = "0.13.0"
#: ``expires_at`` of ``/api/ps``: the model is never unloaded (Ollama's ``keep_alive: -1``)
NEVER = "2318-11-17T00:00:00Z"


def tagged(name: str) -> str:
    """``name`` with Ollama's ``:latest`` tag when it has no tag of its own."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def resolve(state, model: str) -> str:
    """The served name ``model`` asks for: ``name`` or ``name:latest``, and a name without a tag
    is ``:latest`` of it, as Ollama reads names (``m`` asks for a served ``m:latest``).

    Raises:
        APIError: 404 when the server does not serve it.
    """
    for name in state.model_names:
        if tagged(model) == tagged(name):
            return name
    served = " or ".join(repr(tagged(n)) for n in state.model_names)
    raise APIError(404, f"model {quoted(model)} not found; this server serves {served}", "model")


def served_model(state):
    """The served :class:`quanta.model.llama.LlamaModel` (None where the engine runs none: a fake executor)."""
    executor = getattr(getattr(state.async_engine, "engine", None), "executor", None)
    return getattr(executor, "model", None)


def parameter_count(cfg: ModelConfig) -> int:
    """The model's weights counted from its shape (embeddings, attention, MLP or experts, norms, head)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attention = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    dense = 3 * h * cfg.intermediate_size
    moe = cfg.num_experts * (3 * h * cfg.moe_intermediate_size + h) + 3 * h * cfg.shared_expert_intermediate_size
    layers = sum(attention + 2 * h + (moe if cfg.is_moe_layer(i) else dense) for i in range(cfg.num_hidden_layers))
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.vocab_size * h + layers + h + head


def _short(count: int) -> str:
    """``135M``, ``1.2B``: Ollama's ``parameter_size``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}".removesuffix(".0") + unit
    return str(count)


class ModelFacts:
    """What ``/api/tags``, ``/api/show`` and ``/api/ps`` say about the served model (computed once)."""

    def __init__(self, state) -> None:
        self.state = state
        model = served_model(state)
        self.config: ModelConfig | None = getattr(model, "config", None)
        self.size = model.weight_bytes() if hasattr(model, "weight_bytes") else 0
        self.modified_at = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        self.started = time.time()

    def digest(self, name: str) -> str:
        return hashlib.sha256(f"{name}\0{self.size}".encode()).hexdigest()

    def details(self) -> dict:
        cfg, kernels = self.config, self.state.config.get("kernels") or ""
        form = next((p.split("=", 1)[1].split(":")[0] for p in kernels.split() if p.startswith("projections=")), None)
        family = cfg.architecture if cfg else "unknown"
        return {"parent_model": "", "format": "gguf" if form else "", "family": family, "families": [family],
                "parameter_size": _short(parameter_count(cfg)) if cfg else "",
                "quantization_level": (form or self.state.config.get("dtype") or "").upper()}

    def listing(self, name: str) -> dict:
        """One model of ``/api/tags``."""
        return {"name": tagged(name), "model": tagged(name), "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest(name), "details": self.details()}

    def running(self, name: str) -> dict:
        """One model of ``/api/ps`` (held in CPU memory: ``size_vram`` 0)."""
        return {**{k: v for k, v in self.listing(name).items() if k != "modified_at"}, "expires_at": NEVER,
                "size_vram": 0, "context_length": self.state.max_model_len}

    def model_info(self) -> dict:
        cfg, n_ctx = self.config, self.state.max_model_len
        if cfg is None:
            return {"general.architecture": "unknown", "unknown.context_length": n_ctx}
        arch = cfg.architecture
        info = {"general.architecture": arch, "general.basename": cfg.name, "general.parameter_count": parameter_count(cfg),
                f"{arch}.context_length": n_ctx, f"{arch}.embedding_length": cfg.hidden_size,
                f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.feed_forward_length": cfg.intermediate_size,
                f"{arch}.attention.head_count": cfg.num_attention_heads,
                f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
                f"{arch}.rope.freq_base": cfg.rope_theta, f"{arch}.vocab_size": cfg.vocab_size}
        if cfg.num_experts:
            info.update({f"{arch}.expert_count": cfg.num_experts, f"{arch}.expert_used_count": cfg.num_experts_per_tok})
        return info

    def capabilities(self) -> list[str]:
        """``completion`` and ``tools`` always (a template that does not read tools gets them as
        Hermes text, :mod:`quanta.server.tool_formats.templates`); ``thinking`` when the model reasons."""
        return ["completion", "tools"] + (["thinking"] if thinks(self.state) else [])

    def show(self, name: str) -> dict:
        """``/api/show``'s answer."""
        defaults = self.state.config.get("sampling_defaults") or {}
        parameters = "\n".join(f"{k} {v}" for k, v in sorted(defaults.items()))
        return {"modelfile": f"# served by quanta\nFROM {tagged(name)}\n", "parameters": parameters,
                "template": self.state.tokenizer.chat_template or "", "details": self.details(),
                "model_info": self.model_info(), "capabilities": self.capabilities(), "modified_at": self.modified_at}


def thinks(state) -> bool:
    """Whether the served model writes reasoning quanta splits off (a reasoning syntax, or harmony's channels)."""
    return state.reasoning is not None or bool(getattr(state.tool_parser, "reasons", False))
