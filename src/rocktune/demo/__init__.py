"""The embedded default: a tiny Qwen2-architecture model, an offline tokenizer and a learnable synthetic task."""
