"""Per-request text: incremental detokenization and stop strings (:class:`TextState`).

Streaming must never show text that a stop string will later cut, so the
tail that could still start a stop string is held back until it either
completes the stop string (then it is dropped and the request finishes) or
can no longer match.

Stop strings are matched by an Aho-Corasick automaton (:class:`StopMatcher`)
fed each new character once, so the cost per generated character does not
grow with the number of stop strings, and the held-back tail is the
automaton's depth. The first stop string to be completed ends the request
(the longest one if several end at the same character), whatever the
tokenization: the result does not depend on how the text was split into
tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quanta.model.tokenizer import IncrementalDetokenizer


class StopMatcher:
    """Aho-Corasick automaton over stop strings, fed text one character at a time.

    Building costs O(total characters of the stop strings); :meth:`feed` costs
    amortized O(1) per character, independent of how many stop strings there are.

    Args:
        stops: non-empty stop strings.
    """

    def __init__(self, stops: list[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._word: list[str | None] = [None]  # longest stop string that is a suffix of the node's text
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = self._goto[node][ch] = len(self._goto)
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._word.append(None)
                node = nxt
            self._word[node] = stop
        self._fail = self._failure_links()
        self.state = 0

    def _failure_links(self) -> list[int]:
        fail = [0] * len(self._goto)
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                f = fail[node]
                while f and ch not in self._goto[f]:
                    f = fail[f]
                fail[child] = self._goto[f].get(ch, 0)
                if self._word[child] is None:
                    self._word[child] = self._word[fail[child]]
                queue.append(child)
        return fail

    def feed(self, text: str, start: int) -> tuple[int, str] | None:
        """Advance over ``text[start:]``; (position, stop string) of the first
        stop string completed, else None (the state then covers the whole text)."""
        goto, fail, word = self._goto, self._fail, self._word
        state = self.state
        for pos in range(start, len(text)):
            ch = text[pos]
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if word[state] is not None:
                self.state = state
                return pos + 1 - len(word[state]), word[state]
        self.state = state
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the fed text that could still begin a stop string."""
        return self._depth[self.state]


@dataclass
class TextState:
    """Accumulated text of one request and how much of it was released."""

    detokenizer: IncrementalDetokenizer
    matcher: StopMatcher | None
    text: str = ""
    released: int = 0
    scanned: int = 0
    stopped: bool = field(default=False)
    stop_string: str | None = None
    #: token ids whose text never joins ``text`` (end-of-output tokens, when special tokens are decoded)
    hidden: frozenset[int] = frozenset()

    @classmethod
    def create(cls, detokenizer: IncrementalDetokenizer, stop: list[str], hidden=()) -> TextState:
        """A fresh state over ``detokenizer`` that ends at the first of ``stop`` (empty strings
        ignored) and leaves out the text of the ``hidden`` token ids."""
        stops = [s for s in stop if s]
        return cls(detokenizer, StopMatcher(stops) if stops else None, hidden=frozenset(hidden))

    def add(self, token_id: int, final: bool) -> str:
        """Append a token; returns text now safe to release.

        Sets ``stopped`` and ``stop_string`` when a stop string appeared (the
        text is cut before it).
        ``final`` releases everything still held back.
        """
        if token_id not in self.hidden:
            self.text += self.detokenizer.add(token_id)
        if final:
            self.text += self.detokenizer.flush()
        held = 0
        if self.matcher is not None:
            found = self.matcher.feed(self.text, self.scanned)
            self.scanned = len(self.text)
            if found is not None:
                cut, self.stop_string = found
                self.text, self.stopped = self.text[:cut], True
                final = True
            held = self.matcher.held
        end = len(self.text) if final else len(self.text) - held
        delta = self.text[self.released:end]
        self.released = max(self.released, end)
        return delta
