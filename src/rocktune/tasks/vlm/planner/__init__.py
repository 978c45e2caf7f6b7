"""task=vlm's part of the planner layer: a vision-language model's parameters and memory from its
config.json (torch-free; the rules of planner/ apply)."""
