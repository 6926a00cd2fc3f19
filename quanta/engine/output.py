"""What the engine returns per request and step: :class:`RequestOutput`.

The text in it comes from the request's :class:`~quanta.engine.stop_strings.TextState`
(incremental detokenization and stop strings).
"""

from __future__ import annotations

from dataclasses import dataclass


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
        stop_string: the stop string that ended the request, else None.
        error: set (with ``finish_reason == "error"``) when this request alone
            failed inside a step; a short message naming the error id that
            the server log carries with the traceback.
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
    stop_string: str | None = None
    error: str | None = None
