"""What `rocktune report` shows of a dpo / orpo run beyond the common plots (the registry's report hooks; the
report layer: tests/test_layering.py)."""
