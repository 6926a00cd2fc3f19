"""MoE cost study: expert-activity formulas, the prefill cost report and the quantum advisor."""
