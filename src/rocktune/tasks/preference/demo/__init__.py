"""`rocktune demo --task dpo`: the SFT demo's model taught to prefer one style of answer, and the pairs it learns from
(the rules of demo/ apply: tests/test_layering.py)."""
