"""``rocktune generate RUN --image PATH --prompt TEXT``: a task=vlm run's adapter answering about an image.

The base vision-language model with the run's adapter (unmerged, so ``--compare`` can switch it off), the prompt
rendered by the model's chat template with one image part per ``--image`` and widened exactly as training widened
it (tasks/vlm/data/vision.py), greedy decoding unless a temperature is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rocktune.tasks.vlm.data.images import check
from rocktune.tasks.vlm.data.images import resolve as image_ref
from rocktune.tasks.vlm.data.vision import VisionTokens, encode_prompt
from rocktune.tasks.vlm.data.vision_batch import collate
from rocktune.errors import UserError, first_line
from rocktune.export.source import Origin, Source, load_tokenizer, resolve
from rocktune.models.load import stop_ids
from rocktune.platform.environment import resolve_device
from rocktune.readers.yaml_file import read_yaml
from rocktune import task_registry
from rocktune.tasks.vlm.vision.families import vision_checkpoint, vision_family
from rocktune.tasks.vlm.vision.model import model_inputs


def is_vision_run(src: Source) -> bool:
    name = src.run_config.get("task")
    return name in task_registry.VISION


def is_vision_dir(path: str) -> bool:
    """A run directory of a vision-language task (its saved config says so), or a vision-language model directory
    (e.g. ``export --to merged``'s): generate answers about images."""
    for saved in (Path(path) / "config.yaml", Path(path) / "adapter" / "rocktune_config.yaml"):
        if saved.is_file():
            config = read_yaml(saved, "restore the run directory from a copy, or train again.")[0]
            name = config.get("task") if isinstance(config, dict) else None
            return name in task_registry.VISION
    return (Path(path) / "config.json").is_file() and vision_checkpoint(path) is not None


def load(src: Source, device: str):
    """(model, tokenizer, vision tokens) ready for generation, with the run's pixel limits."""
    from transformers import AutoConfig

    from rocktune.models.load import quiet_transformers
    from rocktune.platform.advise import device_precision
    from rocktune.tasks.vlm.vision.model import load_vlm, patch_embed_as_linear, vision_tokens, with_processor_template

    quiet_transformers()
    data = src.run_config.get("data") or {}
    tokenizer = with_processor_template(load_tokenizer(src), src.base)
    vision = vision_tokens(src.base, AutoConfig.from_pretrained(src.base), tokenizer, data.get("min_pixels"),
                           data.get("max_pixels"))
    model = load_vlm(src.base, device_precision(device), "sdpa", device)  # the platform's precision policy
    if (src.run_config.get("model") or {}).get("vision_patch_embed") == "linear":  # as the run trained
        patch_embed_as_linear(model)
    if src.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(src.adapter))
    return model.to(device).eval(), tokenizer, vision


def reply(model, tokenizer, vision: VisionTokens, prompt: str, images: list[str], settings: tuple[int, float]) -> str:
    """One answer to ``prompt`` about ``images`` (paths, file:// or data: URLs); ``settings``: (max new tokens,
    temperature)."""
    import torch

    refs = [image_ref(path, Path.cwd(), f"--image {path}", "the working directory") for path in images]
    parts = [{"type": "image"} for _ in refs] + [{"type": "text", "text": prompt}]
    example = encode_prompt([{"role": "user", "content": parts}], refs, tokenizer, vision, "--prompt")
    batch = collate([example], tokenizer.pad_token_id, vision)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inputs = {k: v.to(model.device) for k, v in model_inputs(base, batch).items()}
    max_new_tokens, temperature = settings
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    stops = stop_ids(tokenizer, model)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=stops or None,
                             pad_token_id=tokenizer.pad_token_id, **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def run_generate_vision(origin: Origin, prompt: str | None, images: list[str], settings: tuple[int, float],
                        device: str, compare: bool) -> int:
    if prompt is None:
        raise UserError("generate --image needs --prompt TEXT (the question about the image).")
    src = resolve(origin.path, origin.base, origin.trust_remote_code)
    if src.run_config and not is_vision_run(src):
        raise UserError(f"--image needs a vision-language run (task=vlm); {origin.path} trained "
                        f"task={src.run_config.get('task')}.")
    for path in images:  # every image is checked before minutes of model loading
        check(image_ref(path, Path.cwd(), f"--image {path}", "the working directory"), f"--image {path}")
    if compare and src.adapter is None:
        raise UserError("--compare switches the adapter off for a second answer; this is a model directory "
                        "without an adapter.")
    found = None if src.run_config else vision_family(src.base)
    if found is not None:  # no run config names the task: the model's config.json did (as train and preview say)
        sys.stderr.write(f"note: {src.base} is a {found[1].name} vision-language model (config.json: model_type "
                         f"{found[0]}), so it answers as task: vlm does, about the --image files.\n")
    if not images:  # a text-only question is valid for these models (and in their data), so it is answered, but said
        sys.stderr.write("note: no --image given: the model answers the prompt alone and sees no image; pass "
                         "--image PHOTO.png to ask about one.\n")
    try:
        model, tok, vision = load(src, resolve_device(device))
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load {src.base}: {first_line(exc)}") from None
    if compare:
        with model.disable_adapter():
            sys.stdout.write(f"base:  {reply(model, tok, vision, prompt, images, settings)}\n")
        sys.stdout.write(f"tuned: {reply(model, tok, vision, prompt, images, settings)}\n")
    else:
        sys.stdout.write(reply(model, tok, vision, prompt, images, settings) + "\n")
    return 0
