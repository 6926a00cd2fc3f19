"""OpenAI's protocol: chat completions and completions (with logprobs), their request models."""
