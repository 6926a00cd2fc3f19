"""One rule for request fields, on every route: chat completions, completions,
``/v1/responses``, ``/v1/messages`` and ``/v1/messages/count_tokens``.

- A field the route declares is honoured, or mapped onto what quanta has
  (Anthropic's ``output_config.format`` is the JSON-schema constraint;
  Responses ``namespace`` tools are function tools).
- A field the official API documents (:data:`OPENAI_CHAT`,
  :data:`OPENAI_COMPLETIONS`, :data:`OPENAI_RESPONSES`, :data:`ANTHROPIC_MESSAGES`,
  betas included) is never refused merely because quanta does not implement
  it: one that changes nothing here is accepted with no effect and named in
  the server log, one info line per request (logger ``quanta.server``;
  ``POST /v1/messages: no effect here: thinking, output_config.effort``).
  A documented field is refused (400 naming it) only where its value asks
  for an answer quanta cannot give, so ignoring it would return something
  else than what was asked: ``n`` > 1, ``echo``, ``logit_bias``, stored state
  (``previous_response_id``, ``conversation``, ``store: true``,
  ``background``), a forced hosted tool.
- Another protocol's name for one of the route's fields (:attr:`FieldRule.RENAMED`: ``max_tokens``
  on Responses, ``stop`` on Messages) is a 400 naming the route's own.
- An undocumented field within edit distance 1 of a field the route knows,
  once case, ``_`` and ``-`` are ignored (``max_token``, ``maxTokens``,
  ``temprature``), is a 400 naming the field it resembles: a typo of
  ``max_tokens`` would otherwise fill the context.
- Any other undocumented field is accepted and named in the same log line,
  as vLLM does (it ignores unknown fields with a warning): vendor extensions
  quanta does not serve (vLLM's ``min_tokens``, ``repetition_penalty``;
  :data:`ENGINE_EXTENSIONS` are never taken for typos) are no errors. Why
  not refuse it: agents' clients add fields with each release (Codex CLI's
  ``client_metadata``, Claude Code's betas) faster than these lists follow;
  a refusal stops the agent at its first request, a logged field costs a line.

Each route's body is a :class:`FieldRule`; the route calls :func:`log_fields`
once the body is valid.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

log = logging.getLogger("quanta.server")

#: top-level fields of OpenAI's chat completions (API reference and the official client)
OPENAI_CHAT = frozenset({
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "messages", "metadata", "modalities", "model", "moderation", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
    "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options",
    "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
})
#: top-level fields of OpenAI's (legacy) completions
OPENAI_COMPLETIONS = frozenset({
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n", "presence_penalty",
    "prompt", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
})
#: top-level fields of OpenAI's Responses API (``client_metadata``: what Codex CLI sends on every request)
OPENAI_RESPONSES = frozenset({
    "access_programs", "background", "client_metadata", "context_management", "conversation", "image", "include",
    "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "moderation",
    "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store", "stream", "stream_options",
    "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user",
})
#: top-level fields of Anthropic's Messages API and its betas (count_tokens takes a subset)
ANTHROPIC_MESSAGES = frozenset({
    "betas", "billing_policy", "cache_control", "compaction", "container", "context_management", "diagnostics",
    "fallback_credit_token", "fallbacks", "inference_geo", "max_tokens", "mcp_servers", "messages", "metadata", "model",
    "output_config", "service_tier", "speed", "stop_sequences", "stream", "system", "temperature", "thinking", "thread",
    "tool_choice", "tools", "top_k", "top_p", "user_profile_id", "workspace_id",
})

#: request fields other engines' servers take (vLLM's and llama.cpp's): when quanta does not serve
#: one on a route it is an unknown field, never a typo of a known one (``top_k`` is no ``top_p``)
ENGINE_EXTENSIONS = frozenset({
    "top_k", "min_p", "min_tokens", "repetition_penalty", "length_penalty", "stop_token_ids", "bad_words",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "chat_template", "chat_template_kwargs", "documents", "guided_grammar", "structural_tag", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "return_tokens_as_token_ids", "use_beam_search", "ignore_eos",
    "cache_salt", "n_predict", "typical_p", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "repeat_penalty",
    "repeat_last_n", "penalize_nl", "n_probs", "dynatemp_range", "dry_multiplier", "xtc_probability", "samplers",
    "cache_prompt", "id_slot", "grammar", "json_schema", "n_keep",
})

#: names listed in one log line, at most (the rest are counted)
_LOGGED_NAMES = 20


def field_error(field: str, message: str) -> PydanticCustomError:
    """A validation error naming ``field`` (dotted, relative to the model that raises it):
    a model validator's error otherwise names no field, and the 400's ``param`` would be null
    (:func:`quanta.server.errors.install_error_handlers` reads ``ctx["field"]``)."""
    return PydanticCustomError("field_error", message.replace("{", "(").replace("}", ")"), {"field": field})


def _normal(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _within_one_edit(a: str, b: str) -> bool:
    """Whether ``a`` becomes ``b`` by at most one insertion, deletion, substitution or swap of neighbours."""
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) <= 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = next((k for k in range(len(short)) if short[k] != long[k]), len(short))
    return short[i:] == long[i + 1:]


def resembles(name: str, known) -> str | None:
    """The field of ``known`` that ``name`` is a likely typo of (see the module docstring), else None."""
    key = _normal(name)
    if len(key) < 3:
        return None
    return next((k for k in sorted(known) if _within_one_edit(key, _normal(k))), None)


class FieldRule(BaseModel):
    """A route's body under the rule of the module docstring.

    Subclasses set :attr:`DOCUMENTED` (the official API's top-level fields),
    :attr:`NO_EFFECT` (declared fields that change nothing here, logged when
    given) and may name ignored parts of declared fields in :meth:`ignored_parts`.
    """

    model_config = ConfigDict(extra="allow")
    DOCUMENTED: ClassVar[frozenset[str]] = frozenset()
    NO_EFFECT: ClassVar[frozenset[str]] = frozenset()
    #: another protocol's name for one of this route's fields -> this route's name: a 400 naming both
    #: (the request would otherwise run ignoring it: ``max_tokens`` on Responses is ``max_output_tokens``)
    RENAMED: ClassVar[dict[str, str]] = {}
    _ignored: list[str] = PrivateAttr(default_factory=list)
    _unknown: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _sort_fields(self):
        known = set(type(self).model_fields) | self.DOCUMENTED
        for name in self.model_extra or {}:
            if name in self.DOCUMENTED:
                self._ignored.append(name)
                continue
            if name in self.RENAMED:
                raise field_error(name, f"not a field of this API; its name here is {self.RENAMED[name]}")
            near = None if name in ENGINE_EXTENSIONS else resembles(name, known)
            if near is not None:
                raise field_error(name, f"unknown field (did you mean {near}?)")
            self._unknown.append(name)
        self._ignored += [name for name in type(self).model_fields if name in self.NO_EFFECT and name in self.model_fields_set]
        return self

    def ignored_parts(self) -> list[str]:
        """Parts of declared fields accepted with no effect (``output_config.effort``, ``tools.2``)."""
        return []

    def ignored_fields(self) -> list[str]:
        """What this request sent that changes nothing here (documented fields and parts)."""
        return self._ignored + self.ignored_parts()

    def unknown_fields(self) -> list[str]:
        """Undocumented fields, accepted and ignored."""
        return list(self._unknown)


def _names(names: list[str]) -> str:
    shown = ", ".join(ascii(n)[1:-1][:64] for n in names[:_LOGGED_NAMES])
    return shown + (f" and {len(names) - _LOGGED_NAMES} more" if len(names) > _LOGGED_NAMES else "")


def log_fields(route: str, body: FieldRule) -> None:
    """One info line naming what ``body`` sent that had no effect (nothing when it all counted)."""
    ignored, unknown = body.ignored_fields(), body.unknown_fields()
    parts = ([f"no effect here: {_names(ignored)}"] if ignored else []) + ([f"unknown, ignored: {_names(unknown)}"] if unknown else [])
    if parts:
        log.info("POST %s: %s", route, "; ".join(parts))
