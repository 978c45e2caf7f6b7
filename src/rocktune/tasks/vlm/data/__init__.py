"""task=vlm's part of the data layer: conversations with images read, checked, encoded, batched, packed and
cached (the rules of data/ apply: tests/test_layering.py)."""
