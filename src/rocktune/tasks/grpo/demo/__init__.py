"""`rocktune demo --task grpo`: a short SFT, then GRPO with the exact-answer reward (the rules of demo/ apply:
tests/test_layering.py)."""
