"""GGUF models: reading, architectures, tokenizer and chat template."""
