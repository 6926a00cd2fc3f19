"""Prompt text of a requested size, for any server's tokenizer.

The bench cannot know a foreign server's tokenizer, so sizes are in words
of a small common-English vocabulary (about one token each for BPE
tokenizers such as Llama's or SmolLM2's); the report uses the server's
``usage.prompt_tokens``, never this estimate.
"""

from __future__ import annotations

import random
import uuid

WORDS = (
    "the of and to in is was for on that with as by at from his her an are this which be or had it not were "
    "but have one all they their has been there who more when can would two other into time after first some "
    "new these only years may over most such out about also many year then them could its where people made "
    "state city world part between because three under well while still very since during same high long "
    "great large small house water story river music power light field book school family system number"
).split()


def text(num_words: int, rng: random.Random) -> str:
    """``num_words`` words drawn from :data:`WORDS` with ``rng`` (reproducible)."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def unique_prefix() -> str:
    """A prefix no earlier run has sent (fresh UUID), so no prefix or KV cache can serve it."""
    return f"[run {uuid.uuid4().hex}]"


def prompt(num_words: int, rng: random.Random, unique: bool = False) -> str:
    """A prompt of about ``num_words`` tokens; ``unique`` starts it with :func:`unique_prefix`."""
    body = text(num_words, rng)
    return f"{unique_prefix()} {body}" if unique else body
