"""GRPO (task: grpo): reinforcement learning with verifiable rewards on a causal LM's LoRA; docs/rl.md."""
