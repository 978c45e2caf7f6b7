"""Vision-language models (task=vlm, ``generate --image``): ``families.py`` is the typed table of families (model
class, vision tower and projector, pixel limits, placeholder rule); ``model.py`` loads a model, its image processor
and its language model's LoRA targets from it."""
