"""What `rocktune report` shows of a GRPO run beyond the common plots: its rewards and its rollouts (the
registry's report hooks; the report layer: tests/test_layering.py)."""
