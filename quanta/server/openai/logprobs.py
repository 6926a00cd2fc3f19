"""Log-probabilities in OpenAI's two response shapes.

The sampler records, per generated token, its natural-log probability under
the model's raw distribution (before penalties, temperature, filters or a
grammar mask, as vLLM returns by default) and the top alternatives
(:class:`quanta.engine.sampling.TokenLogprob`). Chat completions return
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``;
completions return ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}``. A token's text is its own decoding (special tokens
included), so it may be part of a UTF-8 character; ``bytes`` are that text's
UTF-8 bytes.
"""

from __future__ import annotations

from quanta.engine.sampling import TokenLogprob
from quanta.model.tokenizer import Tokenizer


class LogprobFormatter:
    """Formats :class:`TokenLogprob` records for one tokenizer (token texts cached)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self.text_offset = 0  # completions: characters of the output before the next record

    def token(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, records: list[TokenLogprob]) -> dict:
        """A chat choice's ``logprobs`` object."""
        content = [
            {**self._entry(r.token_id, r.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in r.top]}
            for r in records
        ]
        return {"content": content, "refusal": None}

    def completion(self, records: list[TokenLogprob]) -> dict:
        """A completion choice's ``logprobs`` object; offsets continue across calls (streaming)."""
        tokens, offsets = [], []
        for r in records:
            tokens.append(self.token(r.token_id))
            offsets.append(self.text_offset)
            self.text_offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{self.token(t): lp for t, lp in r.top} for r in records],
            "text_offset": offsets,
        }
