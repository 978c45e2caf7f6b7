"""rocktune: rock-solid, fast LoRA fine-tuning of Hugging Face causal LMs."""

__version__ = "0.1.0"
