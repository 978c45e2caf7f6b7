"""The adapter card's "Use it" section of a task=vlm run: generate --image, the PEFT code with the processor, what
transformers' ``AutoProcessor`` needs beyond rocktune's install, and the llama.cpp / Ollama commands the export
prints (the registry's ``card`` hook; train/model_card.py writes the rest of the card)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def load_vision(base: str, run_dir: Path, data: dict | None = None) -> str:
    # The table of families task=vlm trains (each exports to llama.cpp), named as the card's reader knows them.
    from rocktune.tasks.vlm.vision.families import vision_family
    from rocktune.tasks.vlm.vision.table import names

    found = vision_family(base)
    return (f"## Use it\n\n```bash\nrocktune generate {run_dir} --image PHOTO.png --prompt \"...\" --compare\n```\n\n"
            f"In Python (PEFT):\n\n```python\nfrom PIL import Image\nfrom peft import PeftModel\n"
            f"from transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
            f"base = AutoModelForImageTextToText.from_pretrained({base!r})\n"
            f"model = PeftModel.from_pretrained(base, {str(run_dir / 'adapter')!r})\n"
            f"processor = AutoProcessor.from_pretrained({base!r})\n"
            "messages = [{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': '...'}]}]\n"
            "text = processor.apply_chat_template(messages, add_generation_prompt=True)\n"
            "inputs = processor(text=[text], images=[Image.open('PHOTO.png')], return_tensors='pt')\n"
            "out = model.generate(**inputs, max_new_tokens=64)\n"
            "print(processor.decode(out[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True))\n```\n\n"
            + processor_needs(found[0] if found else None)
            + f"For llama.cpp and Ollama: `rocktune export {run_dir} --to gguf` writes the language model and its "
            f"vision projector ({names()})"
            + _llama_cpp(base, run_dir, found[1].name if found else None, data or {}))


def _llama_cpp(base: str, run_dir: Path, family: str | None, data: dict) -> str:
    """The commands ``rocktune export`` prints after ``then:`` for this run's GGUF files (``--to gguf``, and
    ``--to gguf-lora --with-base``: the base, the LoRA applied, and the base's mmproj), with the run's image-token
    limits, which llama.cpp reads from no file for Qwen (``tasks/vlm/vision/families.py``: ``ImageTokens``, export's
    own)."""
    from rocktune.errors import UserError, first_line
    from rocktune.tasks.vlm.vision.families import run_image_tokens

    out = run_dir / "export"
    refused = ""
    try:
        tokens = run_image_tokens(base, data) if family else None
    except UserError as exc:  # the export would refuse the same: the card says why rather than fail the run's end
        tokens, refused = None, f" (`--to gguf` refuses this run's pixel limits: {first_line(exc)})"
    flags = tokens.flags() if tokens else []
    merged = _mtmd(out / "model-f16.gguf", out / "mmproj-f16.gguf", flags)
    lora = _mtmd(out / "base-f16.gguf", out / "mmproj-base-f16.gguf", flags, out / "adapter-f32.gguf")
    why = ""
    if tokens:
        why = (f" (`--image-min-tokens` / `--image-max-tokens`: the {tokens.low} to {tokens.high} image tokens an "
               f"image this run trained with, which llama.cpp reads from no file for {family}; without them it "
               "resizes images by limits of its own and answers otherwise"
               + (f"; {tokens.note()}" if tokens.note() else "") + ")")
    ollama = (" (Ollama runs Qwen-VL models with at least 1024 image tokens an image, which a Modelfile cannot "
              "change: the export says what that changes)") if tokens else ""
    return (f", run as `{merged}`{why}{refused}; `rocktune export {run_dir} --to gguf-lora --with-base` writes the "
            f"language model's LoRA alone with the base and its projector, run as `{lora}`; `--to ollama` writes both "
            f"with a Modelfile{ollama} (docs/vision.md).\n")


def _mtmd(model: Path, mmproj: Path, flags: list[str], lora: Path | None = None) -> str:
    """``llama-mtmd-cli`` as the export's ``then:`` line writes it (export/next_command.py's ``llama_argv``)."""
    argv = ["llama-mtmd-cli", "-m", str(model), *(["--lora", str(lora)] if lora else []), "--mmproj", str(mmproj),
            *flags, "--image", "PHOTO.png", "-p", "..."]
    return shlex.join(argv)


def processor_needs(model_type: str | None) -> str:
    """What ``AutoProcessor`` needs beyond rocktune's install, for the card: transformers' combined processor of
    Qwen2/2.5/3-VL and SmolVLM also builds a video processor, and every video processor of transformers 5 needs
    torchvision (there is no Pillow backend for video, as there is for images); SmolVLM's constructor also needs
    ``num2words`` (its module imports it for video prompts; 5.24 checked, Idefics3's does not). rocktune itself uses
    the tokenizer and the image processor only, so it installs neither. Asked of the installed transformers, not a
    list."""
    import torch
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(model_type or "")
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        return ""
    parts = cls.get_attributes() if hasattr(cls, "get_attributes") else getattr(cls, "attributes", [])
    needs = []
    if "video_processor" in parts:
        release, _, build = torch.__version__.partition("+")
        needs.append(f"its video half needs torchvision, which rocktune does not install (it needs only the "
                     f"tokenizer and the image processor): `pip install torchvision=={torchvision_for(release)}`, the "
                     f"release built for this torch ({torch.__version__}), from the same package index as "
                     f"torch{f' and of the same build (+{build})' if build else ''}")
    if "num2words" in getattr(sys.modules.get(cls.__module__), "__dict__", {}):
        needs.append("its constructor needs the `num2words` package (for video prompts), which rocktune does not "
                     f"install{' either' if needs else ''}: `pip install num2words`")
    if not needs:
        return ""
    return (f"`AutoProcessor` builds transformers' `{name}`: {'; '.join(needs)}. Without "
            f"{'them' if len(needs) > 1 else 'it'}, `rocktune generate` above answers about images.\n\n")


def torchvision_for(torch_release: str) -> str:
    """torchvision's release for a torch 2.x release: minor + 15, the same patch (torchvision's README table: torch
    2.4 -> 0.19, 2.6 -> 0.21, 2.9 -> 0.24, ...)."""
    major, minor, patch = (torch_release.split(".") + ["0", "0"])[:3]
    return f"0.{int(minor) + 15}.{patch}" if major == "2" else "(the release its README pairs with your torch)"
