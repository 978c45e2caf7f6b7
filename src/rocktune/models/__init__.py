"""Models: loading a causal LM with its LoRA adapter and tokenizer (``load.py``), checking a model directory before
anything is read (``check.py``), quantisation's verdict and settings (``quant.py``), and the hub probe (``hub.py``)."""
