"""MoE cost study: expert-activity formulas, the prefill cost profile and the quantum advisor."""
