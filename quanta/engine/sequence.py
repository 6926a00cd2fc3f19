"""State of one request inside the engine.

Following vLLM's v1 scheduler there is no separate prefill or decode phase:
a sequence has ``num_computed_tokens`` (already in its KV cache) and
``num_tokens`` (prompt plus generated), and each step hands it some of the
difference. It is *prefilling* while prompt tokens remain uncomputed and
*decoding* afterwards.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from quanta.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and progress.

    Attributes:
        seq_id: engine-unique id.
        prompt_token_ids: the prompt, in tokens.
        params: sampling settings.
        arrival_time: when the engine received it (seconds, engine clock).
        output_token_ids: generated tokens so far.
        num_computed_tokens: tokens whose keys/values are in the cache.
        num_cached_tokens: prompt tokens whose keys/values were already in the
            slot at admission (prefix reuse), not computed for this request.
        slot: KV cache slot while resident, else None.
        block_ids: the sequence's KV block table while resident (position ``p``
            in block ``block_ids[p // block_size]``), else empty.
        prompt_block_names: the chain names of its prompt's full blocks
            (:func:`quanta.engine.prefix_cache.block_hashes`), once looked up.
        num_named_blocks: leading blocks of ``block_ids`` the prefix cache names.
        finish_reason: ``stop``, ``length`` or ``abort`` once finished.
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    slot: int | None = None
    block_ids: list[int] = field(default_factory=list)
    prompt_block_names: list[bytes] | None = None
    num_named_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_token_ids)

    @property
    def num_prompt_tokens_left(self) -> int:
        return max(0, len(self.prompt_token_ids) - self.num_computed_tokens)

    def token_ids(self, start: int, count: int) -> list[int]:
        """Tokens ``[start, start + count)`` of prompt followed by output."""
        prompt = self.prompt_token_ids
        if start + count <= len(prompt):
            return prompt[start:start + count]
        return (prompt + self.output_token_ids)[start:start + count]
