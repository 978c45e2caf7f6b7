"""Use the trained adapter: merged transformers model, GGUF, GGUF LoRA, Ollama bundle (``main``), and generation
(``generate``). Reads a run directory; never needs the training process."""
