"""quanta: an LLM serving engine whose prefill/decode scheduling is visible and tunable."""

__version__ = "0.1.0"
