"""Prompt text of a requested size, for any server's tokenizer.

The bench cannot know a foreign server's tokenizer, so sizes are in words
of a small common-English vocabulary (about one token each for BPE
tokenizers such as Llama's or SmolLM2's); the report uses the server's
``usage.prompt_tokens``, never this estimate.

Every prompt starts with a fresh random nonce, so no prefix or KV cache (nor
an earlier repeat of the same workload) can serve any part of it.
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


#: hex characters of the nonce every prompt starts with (unless asked otherwise)
NONCE_CHARS = 8
#: hex characters of the probe's nonce (a full UUID's worth)
PROBE_NONCE_CHARS = 32


def nonce_tokens(hex_chars: int) -> int:
    """Tokens a nonce of ``hex_chars`` hex characters adds, about 4 characters a BPE token (the simulator's estimate)."""
    return hex_chars // 4


def text(num_words: int, rng: random.Random) -> str:
    """``num_words`` words drawn from :data:`WORDS` with ``rng`` (reproducible)."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def unique_prefix(hex_chars: int = 32) -> str:
    """A prefix no earlier request has sent (random hex from a fresh UUID)."""
    return uuid.uuid4().hex[:hex_chars]


def prompt(num_words: int, rng: random.Random, nonce_chars: int = NONCE_CHARS) -> str:
    """A prompt of about ``num_words`` tokens (plus a few for the nonce) that
    starts with a unique ``nonce_chars``-hex nonce (0: no nonce)."""
    body = text(num_words, rng)
    return f"{unique_prefix(nonce_chars)} {body}" if nonce_chars else body
