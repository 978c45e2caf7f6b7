"""The LoRA side paths and their correctness check: ``lean.py`` patches PEFT's layers (the lean or fused forward,
the fallbacks, q/k/v and gate/up grouped), ``fused.py`` is the fused node itself (torch only), ``check.py`` is the
reference (PEFT's own eager forward, torch's single-tensor AdamW) and the one judge of a path against it."""
