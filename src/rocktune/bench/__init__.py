"""``rocktune bench``: the same model and data through several configurations, each in its own subprocess.

``configs`` names the configurations (rocktune's loop with each speed knob on or off, and the Hugging Face
Trainer + PEFT baselines); ``child`` runs one of them and writes its per-step records; ``runner`` orchestrates and
summarises (``stats`` holds the numerics); ``pick`` turns the fastest into a config file.
"""
