"""Preference tuning (task: dpo / orpo) on a causal LM's LoRA: pairs, their feed and their loss."""
