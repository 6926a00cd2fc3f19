"""OpenAI request bodies (the subset quanta serves), validated by pydantic.

Ranges follow the OpenAI API reference; ``top_k``, ``min_p`` and
``ignore_eos`` are the extensions vLLM and llama.cpp's server accept. Fields
beyond the declared ones follow :mod:`quanta.server.field_rule` (a typo such
as ``max_token`` is a 400; a documented field quanta has no use for is
accepted and logged); the fields official clients send that change nothing
here (:class:`NoEffect`: ``user``, ``metadata``, ``store`` false,
``service_tier``, ``prompt_cache_key``, ``safety_identifier``) are accepted.

Types are strict, as OpenAI's API is: ``"4"``, ``4.0`` or ``true`` is no
integer, ``"0.5"`` no number, ``NaN`` and ``Infinity`` are refused; ``seed``
is a 64-bit signed integer (as in vLLM). ``null`` means the default, for every
field. At most :data:`MAX_STOP` stop strings of at most
:data:`MAX_STOP_CHARS` characters each.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, field_validator, model_validator

from quanta.engine.sampling import SEED_RANGE, SamplingParams
from quanta.server.field_rule import OPENAI_CHAT, OPENAI_COMPLETIONS, FieldRule, field_error
from quanta.server.limits import PROMPT_TOKEN_LIMIT, surrogate_problem, too_many_messages

Role = Literal["system", "developer", "user", "assistant", "tool"]

#: Stop strings per request and characters per stop string. OpenAI takes 4;
#: these leave room for agents' lists while bounding the per-request matcher
#: (:class:`quanta.engine.stop_strings.StopMatcher`) built on the engine thread.
MAX_STOP, MAX_STOP_CHARS = 32, 256


def number(**ranges):
    """A finite JSON number (an integer is allowed) within ``ranges`` (``ge``, ``le``, ``gt``)."""
    return Annotated[float, Field(strict=True, allow_inf_nan=False, **ranges)]


def integer(**ranges):
    """A JSON integer (no string, float or boolean) within ``ranges``."""
    return Annotated[int, Field(strict=True, **ranges)]


def _unicode(text):
    """``text`` unchanged; a lone surrogate is named here (a length-constrained str would only say "unable to parse")."""
    problem = surrogate_problem(text) if isinstance(text, str) else None
    if problem is not None:
        raise ValueError(problem)
    return text


StrictFlag = Annotated[bool, Field(strict=True)]
#: ``cache_salt`` (vLLM's extension): prefix reuse only among requests with the
#: same salt (:class:`quanta.engine.sampling.SamplingParams`); a non-empty string.
CacheSalt = Annotated[str, BeforeValidator(_unicode), Field(strict=True, min_length=1, max_length=1024)]
TokenId = Annotated[int, Field(strict=True)]
NonEmptyText = Annotated[str, BeforeValidator(_unicode), Field(min_length=1)]
#: text with no lone surrogate (the 400 names the field it is in)
UnicodeText = Annotated[str, BeforeValidator(_unicode)]
#: a completions prompt: non-empty text, non-empty token ids, or a list of one non-empty text
#: (the schema states each bound; :meth:`CompletionRequest._one_prompt` words the common mistakes)
Prompt = NonEmptyText | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)]


def _fitting_turns(turns):
    """``turns`` unchanged; more than a prompt can hold (:data:`PROMPT_TOKEN_LIMIT`) are refused by their number alone."""
    limit = PROMPT_TOKEN_LIMIT.get()
    if isinstance(turns, list) and limit is not None and len(turns) > limit:
        raise ValueError(too_many_messages(limit))
    return turns


def turns(item):
    """A conversation: a non-empty list of ``item``, refused by its length before any item is validated."""
    return Annotated[list[item], BeforeValidator(_fitting_turns), Field(min_length=1)]


#: stop strings; the bounds appear in the OpenAPI schema, :func:`check_stop_strings` enforces them with its message
StopList = Annotated[list[str], Field(json_schema_extra={"maxItems": MAX_STOP, "items": {"type": "string", "maxLength": MAX_STOP_CHARS}})]


def check_stop_strings(stop: list[str], param: str) -> list[str]:
    """Raise ``ValueError`` (naming ``param``) beyond :data:`MAX_STOP` strings or :data:`MAX_STOP_CHARS` characters."""
    if len(stop) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} {param} strings are accepted, got {len(stop)}")
    for i, text in enumerate(stop):
        if len(text) > MAX_STOP_CHARS:
            raise ValueError(f"{param}[{i}] has {len(text)} characters; at most {MAX_STOP_CHARS} are accepted")
    return stop


def only(*allowed):
    """A field accepted only with one of the ``allowed`` JSON values, which have no effect
    (anything else is a 400 naming the field and the allowed values)."""
    shown = " or ".join(json.dumps(ok) for ok in allowed)

    def check(value):
        if not any(value == ok and type(value) is type(ok) for ok in allowed):
            raise ValueError(f"only {shown} is supported")
        return value
    return Annotated[Any, BeforeValidator(check), Field(description=f"only {shown} (no effect)")]


#: OpenAI's reasoning effort levels (chat's ``reasoning_effort``, Responses' ``reasoning.effort``)
ReasoningEffort = Literal["minimal", "low", "medium", "high"]


def _not_stored(value):
    if value not in (None, False):
        raise ValueError("only false is accepted: nothing is stored")
    return value


class NoEffect(BaseModel):
    """Fields official clients send that change nothing here: accepted, not honoured."""

    user: str | None = Field(None, description="accepted; no effect")
    metadata: dict | None = Field(None, description="accepted; no effect")
    store: Annotated[Any, BeforeValidator(_not_stored)] = Field(None, description="false or null only: nothing is stored")
    service_tier: str | None = Field(None, description="accepted; no effect")
    prompt_cache_key: str | None = Field(None, description="accepted; no effect (use cache_salt to partition the cache)")
    safety_identifier: str | None = Field(None, description="accepted; no effect")


#: :class:`NoEffect`'s fields that are named in the log when given (``store`` false is honoured: nothing is stored)
NO_EFFECT_FIELDS = frozenset({"user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "reasoning_effort"})


class NullMeansDefault(BaseModel):
    """A body in which ``null`` for a field means the field's default, as OpenAI allows
    (``max_tokens: null`` is the same as leaving it out)."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(BaseModel):
    include_usage: StrictFlag = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class SamplingRequest(FieldRule, NoEffect, NullMeansDefault):
    """Fields shared by both endpoints (other fields: :mod:`quanta.server.field_rule`)."""

    NO_EFFECT = NO_EFFECT_FIELDS

    #: None (left out): the served model, as vLLM and llama-server default to it (:func:`quanta.server.defaults.served_model`)
    model: str | None = None
    temperature: number(ge=0.0, le=2.0) = 1.0
    top_p: number(gt=0.0, le=1.0) = 1.0
    top_k: integer(ge=-1) = 0
    min_p: number(ge=0.0, le=1.0) = 0.0
    seed: integer(ge=SEED_RANGE[0], le=SEED_RANGE[1]) | None = None
    stop: Annotated[str, Field(json_schema_extra={"maxLength": MAX_STOP_CHARS})] | StopList | None = None
    stream: StrictFlag = False
    stream_options: StreamOptions | None = None
    #: the schema says ``maximum: 1``; the validator's message says what to do instead
    n: Annotated[int, Field(strict=True, ge=1, json_schema_extra={"maximum": 1})] = 1
    presence_penalty: number(ge=-2.0, le=2.0) = 0.0
    frequency_penalty: number(ge=-2.0, le=2.0) = 0.0
    ignore_eos: StrictFlag = False
    cache_salt: CacheSalt | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop):
        if stop is not None:
            check_stop_strings([stop] if isinstance(stop, str) else stop, "stop")
        return stop

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n > 1 is not supported; send n separate requests")
        return n

    @model_validator(mode="after")
    def _options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options is only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            cache_salt=self.cache_salt,
        )


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids.

    ``max_tokens`` defaults to 16, as in OpenAI's API and vLLM.
    """

    DOCUMENTED = OPENAI_COMPLETIONS

    prompt: Prompt
    max_tokens: integer(ge=1) = 16

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        limit = PROMPT_TOKEN_LIMIT.get()
        if isinstance(prompt, list) and limit is not None and len(prompt) > limit:  # before each id is checked
            raise ValueError(f"the prompt has {len(prompt)} token ids; at most {limit} fit (max_model_len - 1)")
        if isinstance(prompt, list) and any(isinstance(t, bool) for t in prompt):
            raise ValueError("token ids must be integers, not booleans")
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(t, str) for t in prompt):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _unwrapped(cls, prompt):
        return prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], str) else prompt


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``.

    Without ``max_tokens`` (or ``max_completion_tokens``) the server's
    ``--max-tokens-default`` applies (:mod:`quanta.server.defaults`), at most
    ``max_model_len`` minus the prompt's tokens.
    """

    DOCUMENTED = OPENAI_CHAT

    messages: turns(ChatMessage)
    max_tokens: integer(ge=1) | None = None
    max_completion_tokens: integer(ge=1) | None = None
    #: sent by agents configured for reasoning models; no effect (the model does not reason)
    reasoning_effort: ReasoningEffort | None = Field(None, description="accepted; no effect")

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self
