"""The adapter's own description: ``adapter/README.md`` (PEFT writes an empty model-card template there) and an
absolute base model path in ``adapter_config.json``, so the adapter loads from any directory.

Everything comes from the run's ``config.yaml`` and ``metrics.jsonl``, already written when the adapter is saved.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import yaml

from rocktune import task_registry
from rocktune.train.summary import read_figures


def describe_adapter(adapter_dir: Path, run_dir: Path) -> None:
    """Rewrite ``adapter_dir``'s README.md; a relative local base model (``runs/demo/base_model``) means this working
    directory, so the adapter's two records of it (``adapter_config.json``, ``rocktune_config.yaml``) are made
    absolute: ``generate`` or ``export`` run from elsewhere would otherwise look for it there, or on the hub."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    base = str(config.get("model", {}).get("name_or_path", ""))
    if base and not Path(base).is_absolute() and Path(base).expanduser().is_dir():
        base = str(Path(base).expanduser().resolve())
        _set_base(adapter_dir, base)
    (adapter_dir / "README.md").write_text(card(config, base, run_dir.resolve()), encoding="utf-8")


def _set_base(adapter_dir: Path, base: str) -> None:
    meta = adapter_dir / "adapter_config.json"
    if meta.is_file():
        data = json.loads(meta.read_text(encoding="utf-8"))
        data["base_model_name_or_path"] = base
        meta.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
    copy = adapter_dir / "rocktune_config.yaml"
    if copy.is_file():
        config = yaml.safe_load(copy.read_text(encoding="utf-8")) or {}
        config.setdefault("model", {})["name_or_path"] = base
        copy.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def _task(name: str) -> str:
    """The task and what it trains, from the registry (a run of a task since removed is named as it is)."""
    tasks = task_registry.TASKS
    return f"{name}: {tasks[name].summary}" if name in tasks else name


def card(config: dict, base: str, run_dir: Path) -> str:
    fig = read_figures(run_dir / "metrics.jsonl")
    lora, data, t = config.get("lora", {}), config.get("data", {}), config.get("training", {})
    evals = (f"{fig.eval_before:.4f} → {fig.eval_after:.4f}" if fig.eval_before is not None
             and fig.eval_after is not None else "not measured (no eval data)")
    length = f"{t.get('max_steps')} steps" if t.get("max_steps") else f"{t.get('epochs')} epochs"
    rows = [("base model", f"`{base}`"), ("task", _task(config.get("task", "lm"))),
            ("train data", f"`{data.get('train_file')}`"),
            ("eval data", f"`{data.get('eval_file')}`" if data.get("eval_file") else
             f"{data.get('eval_fraction', 0):g} of the train data held out" if data.get("eval_fraction") else "none"),
            ("LoRA", f"r={lora.get('r')}, alpha={lora.get('alpha')}, dropout={lora.get('dropout')}, "
                     f"target modules {lora.get('target_modules')}"),
            ("training", f"{length} (trained {fig.steps}), lr {t.get('lr')}, {t.get('micro_batch_size')} examples "
                         f"per micro-batch x {t.get('grad_accum')} accumulated, precision {t.get('precision')}"),
            ("eval loss before → after", evals)]
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    return (f"# LoRA adapter for {base}\n\nTrained by rocktune; the whole resolved config is `rocktune_config.yaml` "
            f"beside this file, the run's metrics are in `{run_dir / 'metrics.jsonl'}`.\n\n{table}\n"
            + _use_it(config, base, run_dir, data))


def _use_it(config: dict, base: str, run_dir: Path, data: dict) -> str:
    """How to load the adapter: the task's own lines (its registry row's ``card`` hook); a causal LM's for a task
    this version does not know."""
    row = task_registry.TASKS.get(config.get("task", "lm"))
    return task_registry.load(row.card)(base, run_dir, data) if row else load_lm(base, run_dir)


def _load_vision(base: str, run_dir: Path, data: dict | None = None) -> str:
    # The table of families task=vlm trains (each exports to llama.cpp), named as the card's reader knows them.
    from rocktune.tasks.vlm.vision.families import vision_checkpoint
    from rocktune.tasks.vlm.vision.table import names

    found = vision_checkpoint(base)
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


def load_lm(base: str, run_dir: Path) -> str:
    return (f"## Use it\n\n```bash\nrocktune generate {run_dir} --chat\nrocktune export {run_dir} --to gguf\n```\n\n"
            f"In Python (PEFT):\n\n```python\nfrom peft import PeftModel\n"
            f"from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"base = AutoModelForCausalLM.from_pretrained({base!r})\n"
            f"model = PeftModel.from_pretrained(base, {str(run_dir / 'adapter')!r})\n"
            f"tokenizer = AutoTokenizer.from_pretrained({base!r})\n```\n")
