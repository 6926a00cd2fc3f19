"""Stop strings: the Aho-Corasick matcher against a brute-force reference, and
the streamed text of :class:`TextState` however the text is split into pieces."""

from __future__ import annotations

import random

import pytest

from quanta.engine.stop_strings import StopMatcher, TextState


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Reference: the stop string completed first (the longest of those ending there)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return end - len(stop), stop
    return None


def longest_partial(text: str, stops: list[str]) -> int:
    """Reference: the longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


class Pieces:
    """A stand-in detokenizer: token ``i`` is the ``i``-th piece of a fixed split."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def add(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


def _random_case(rng: random.Random) -> tuple[list[str], str]:
    stops = sorted({"".join(rng.choice("ab c") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))})
    return stops, "".join(rng.choice("abc ") for _ in range(rng.randint(0, 40)))


def _split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, max(0, len(text) - 1)) // 2)) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@pytest.mark.parametrize("seed", range(4))
def test_the_matcher_finds_what_brute_force_finds(seed):
    rng = random.Random(seed)
    for _ in range(500):
        stops, text = _random_case(rng)
        matcher = StopMatcher(stops)
        fed, found = "", None
        for piece in _split(rng, text):
            start, fed = len(fed), fed + piece
            found = matcher.feed(fed, start)
            if found is not None:
                break
        assert found == first_stop(text, stops), (stops, text)
        if found is None:
            assert matcher.held == longest_partial(text, stops), (stops, text)


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_never_shows_what_a_stop_string_cuts(seed):
    rng = random.Random(100 + seed)
    for _ in range(300):
        stops, text = _random_case(rng)
        pieces = _split(rng, text)
        state = TextState(Pieces(pieces), StopMatcher(stops))
        released = []
        for i in range(len(pieces)):
            released.append(state.add(i, final=i == len(pieces) - 1))
            if state.stopped:
                break
        hit = first_stop(text, stops)
        expected = text if hit is None else text[:hit[0]]
        assert "".join(released) == expected, (stops, pieces)
        assert state.stopped == (hit is not None) and state.stop_string == (hit[1] if hit else None)


def test_a_long_list_matches_like_a_short_one():
    """32 stop strings of 256 characters, the API's caps: the last one still ends the text."""
    stops = [f"{i:03d}" + "x" * 253 for i in range(32)]
    state = TextState(Pieces(["hello ", stops[-1][:100], stops[-1][100:], " more"]), StopMatcher(stops))
    out = [state.add(i, final=False) for i in range(3)]
    assert "".join(out) == "hello " and state.stopped and state.stop_string == stops[-1]
