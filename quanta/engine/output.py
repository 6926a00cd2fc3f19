"""Per-request output text: incremental detokenization and stop strings.

Streaming must never show text that a stop string will later cut, so the
tail that could still start a stop string is held back until it either
completes the stop string (then it is dropped and the request finishes) or
can no longer match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quanta.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        seq_id: the sequence.
        token_ids: tokens generated this step (0 or 1 of them).
        text: newly releasable text (may be empty while held back).
        finished: the request ended in this step.
        finish_reason: ``stop``, ``length`` or ``abort`` when finished.
        num_prompt_tokens / num_output_tokens: usage counts so far.
        time: engine-clock seconds when the step ended.
        arrival_time: engine-clock seconds when the request arrived.
        num_cached_tokens: prompt tokens served from the prefix cache (not
            computed); known from admission on, so 0 before the first token.
        stop_reason: the stop string that ended the request, else None.
    """

    seq_id: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    time: float
    arrival_time: float
    num_cached_tokens: int = 0
    stop_reason: str | None = None


@dataclass
class TextState:
    """Accumulated text of one request and how much of it was released."""

    detokenizer: IncrementalDetokenizer
    stop: list[str]
    text: str = ""
    released: int = 0
    stopped: bool = field(default=False)
    stop_string: str | None = None

    @classmethod
    def create(cls, tokenizer: Tokenizer, stop: list[str]) -> "TextState":
        return cls(IncrementalDetokenizer(tokenizer), [s for s in stop if s])

    def add(self, token_id: int, final: bool) -> str:
        """Append a token; returns text now safe to release.

        Sets ``stopped`` and ``stop_string`` when a stop string appeared (the
        text is cut before it).
        ``final`` releases everything still held back.
        """
        self.text += self.detokenizer.add(token_id)
        if final:
            self.text += self.detokenizer.flush()
        if self.stop:
            found = self._find_stop()
            if found is not None:
                cut, self.stop_string = found
                self.text, self.stopped = self.text[:cut], True
                final = True
        end = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self.released:end]
        self.released = max(self.released, end)
        return delta

    def _find_stop(self) -> tuple[int, str] | None:
        """(position, stop string) of the earliest stop string in the text, if any."""
        window_start = max(0, self.released - max(map(len, self.stop)))
        hits = [(i, s) for s, i in ((s, self.text.find(s, window_start)) for s in self.stop) if i >= 0]
        return min(hits, key=lambda h: h[0]) if hits else None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
