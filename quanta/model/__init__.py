"""Model architectures, weight loading (GGUF, safetensors) and tokenizers."""
