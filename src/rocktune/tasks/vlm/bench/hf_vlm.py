"""The Hugging Face Trainer + PEFT recipe for a vision-language model, as users write it, measured as the text
baseline is (bench/hf_baseline.py's ``measured_training``).

Both sides get identical token ids and labels from rocktune's encoder (tasks/vlm/data/vision.py: loss on the assistant's
tokens only), so the tokens are the same. From there the HF side uses its own pieces: ``AutoModelForImageTextToText``,
``get_peft_model`` with LoRA on the same modules as rocktune (the language model's linear layers: the usual recipe
freezes the vision tower), a collator that pads the rows and runs the image processor on the batch's images (what a
user's collator does with the processor), the Trainer's sampler, forward with the model's own loss, optimizer,
scheduler and clipping.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rocktune.bench.hf_baseline import IGNORE, SkipBaseline, measured_training

if TYPE_CHECKING:
    from rocktune.tasks.vlm.data.vision import VisionExample, VisionTokens


class _Conversations(torch.utils.data.Dataset):
    def __init__(self, examples):
        self.rows = [{"input_ids": e.input_ids, "labels": e.labels, "images": e.images} for e in examples]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class ImageCollator:
    """Right padding, the attention mask, the image processor's pixels and grids for the batch's images, and which
    tokens are the image's (``mm_token_type_ids``, as the model's full processor returns them). Without that key,
    transformers 5's Qwen-VL models fall back to 1-D positions without a word, and a model trained so answers at
    other positions than the image-aware ones it meets at inference (chance-level answers, measured)."""

    def __init__(self, image_processor, pad_id: int, image_token_id: int):
        self.image_processor, self.pad_id, self.image_token_id = image_processor, pad_id, image_token_id

    def __call__(self, rows: list[dict]) -> dict:
        from rocktune.tasks.vlm.data.images import load

        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
        images = [load(ref, "bench") for r in rows for ref in r["images"]]
        pixels = self.image_processor(images=images, return_tensors="pt")
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels["pixel_values"],
                "image_grid_thw": pixels["image_grid_thw"], "mm_token_type_ids": (ids == self.image_token_id).long()}


def encoded(model_dir: str, data_file: str, max_length: int) -> tuple[list[VisionExample], Any, VisionTokens]:
    """(the conversations as rocktune's encoder gives them, the tokenizer, the vision tokens), as task=vlm reads
    them."""
    from transformers import AutoConfig

    from rocktune.config import DataConfig
    from rocktune.tasks.vlm.data.vision import encode
    from rocktune.tasks.vlm.data.vision_source import read_rows
    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.vision.model import vision_tokens, with_processor_template

    tokenizer = with_processor_template(load_tokenizer(model_dir, False), model_dir)
    vision = vision_tokens(model_dir, AutoConfig.from_pretrained(model_dir), tokenizer, None, None)
    with tempfile.TemporaryDirectory() as tmp:
        d = DataConfig(train_file=data_file, eval_fraction=0.0, max_length=max_length)
        rows, base = read_rows(data_file, d, Path(tmp), "data.train_file")
        examples = [encode(rec, base, tokenizer, vision, max_length, str(loc)) for loc, rec in rows]
    return examples, tokenizer, vision


def run_hf_vlm(spec: dict, probe) -> tuple[list[dict], dict]:
    """Train ``spec["steps"]`` optimizer steps in fp32 (the CPU's precision); returns per-step records and what the
    recipe resolved to."""
    if importlib.util.find_spec("accelerate") is None:
        raise SkipBaseline("the HF Trainer needs the accelerate package, which is not installed "
                           "(pip install 'rocktune[bench]')")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, TrainingArguments, set_seed

    from rocktune.tasks.vlm.vision.model import language_targets

    c, device = spec["common"], spec["device"]
    set_seed(c["seed"])
    examples, tokenizer, vision = encoded(spec["model_dir"], spec["data_file"], c["max_length"])
    model = AutoModelForImageTextToText.from_pretrained(spec["model_dir"], dtype=torch.float32,
                                                        attn_implementation="sdpa")
    model.config.use_cache = False
    lora = LoraConfig(r=c["lora_r"], lora_alpha=c["lora_alpha"], lora_dropout=0.0,
                      target_modules=language_targets(model), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora).to(device)
    probe.mark_loaded(peft_model)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="rocktune-hf-vlm-"), max_steps=spec["steps"],
        per_device_train_batch_size=c["micro_batch_size"], gradient_accumulation_steps=c["grad_accum"],
        learning_rate=c["lr"], weight_decay=0.0, lr_scheduler_type=c["scheduler"], warmup_steps=c["warmup_steps"],
        max_grad_norm=1.0, dataloader_num_workers=0, logging_steps=20, save_strategy="no", eval_strategy="no",
        report_to="none", seed=c["seed"], remove_unused_columns=False, disable_tqdm=True, use_cpu=device == "cpu")
    records: list[dict] = []
    trainer = measured_training(peft_model, args, _Conversations(examples), ImageCollator(vision.image_processor,
                                tokenizer.pad_token_id, vision.image_token_id), tokenizer, (probe, device, records))
    resolved = {"precision": "fp32", "attn_implementation": "sdpa", "micro_batch_size": c["micro_batch_size"],
                "grad_accum": c["grad_accum"], "collator": "ImageCollator (pad + image processor)",
                "lora_targets": "the language model's linear layers (as rocktune)", "optimizer": str(args.optim),
                "loss_scaled_by_step_tokens": bool(trainer.model_accepts_loss_kwargs)}
    return records, resolved
