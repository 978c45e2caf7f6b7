"""LoRA for diffusion models (Wan 2.1/2.2 text-to-video and text-to-image) through diffusers.

The LM path knows nothing of this package; ``tasks/wan/task.py`` drives it with the loop's shared pieces
(checkpoints, guards, OOM recovery, progress). This layer never imports the training loop, the CLI or reports.
"""
