"""Supervised fine-tuning of a causal LM's LoRA (task: lm): the task object and its evaluation. What it shares with
the other LM-based tasks (launch checks, model building, feed, loss, samples) is the kit in ``tasks/causal``."""
