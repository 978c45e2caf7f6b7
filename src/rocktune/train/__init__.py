"""Training: the loop, its numerics, checkpoints and guards."""
