"""task=vlm's part of the bench: ``rocktune bench --suite vlm`` and its Hugging Face baseline (the rules of
bench/ apply)."""
