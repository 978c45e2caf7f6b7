"""A plain transformers + PEFT training loop: the yardstick a default batch order is held to.

What a user writes without a framework: ``get_peft_model`` on the model's linear layers, a ``DataLoader`` with
``shuffle=True`` (micro-batches drawn uniformly, so a batch never correlates with its examples' answers), the model's
own loss, AdamW, a cosine schedule after a linear warmup, clipping at 1.0. Both sides get identical token ids and
labels from rocktune's encoder, so only the batch order and the loop differ. ``order`` feeds the loop a given list
of micro-batches instead (rocktune's, say), which isolates the order from everything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class PlainSettings:
    steps: int
    micro_batch_size: int = 8
    lr: float = 5e-3
    warmup_steps: int = 5
    lora_r: int = 16
    lora_alpha: int = 32
    max_length: int = 64
    seed: int = 0


def vlm_accuracy(model, tokenizer, vision, eval_file: Path, max_new_tokens: int = 12) -> float:
    """Held-out greedy exact match of a vision-language model (``messages`` rows with one image and the question),
    through ``generate --image``'s own reply path, whatever trained the model."""
    import json

    from rocktune.tasks.vlm.export.vision_generate import reply

    rows = [json.loads(line) for line in eval_file.read_text().splitlines()]
    right = 0
    for row in rows:
        question, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        image = str(eval_file.parent / question[0]["image_url"]["url"])
        right += reply(model, tokenizer, vision, question[1]["text"], [image], (max_new_tokens, 0.0)).strip() == answer
    return right / len(rows)


def shuffled_batches(n: int, settings: PlainSettings) -> list[list[int]]:
    """``settings.steps`` micro-batches as torch's ``DataLoader(shuffle=True, drop_last=False)`` draws them, epoch
    after epoch (a reshuffle each epoch), seeded."""
    generator = torch.Generator().manual_seed(settings.seed)
    batches: list[list[int]] = []
    while len(batches) < settings.steps:
        loader = torch.utils.data.DataLoader(range(n), batch_size=settings.micro_batch_size, shuffle=True,
                                             generator=generator)
        batches += [b.tolist() for b in loader]
    return batches[: settings.steps]


def train_plain(model, rows: list[dict], collate, settings: PlainSettings, order: list[list[int]] | None = None):
    """Train ``model`` (a PEFT model) in place on ``rows`` through ``collate``; one micro-batch per step."""
    from transformers import get_cosine_schedule_with_warmup

    torch.manual_seed(settings.seed)
    batches = order if order is not None else shuffled_batches(len(rows), settings)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    schedule = get_cosine_schedule_with_warmup(opt, settings.warmup_steps, settings.steps)
    model.train()
    losses = []
    for batch in batches[: settings.steps]:
        loss = model(**collate([rows[i] for i in batch])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def plain_vlm(model_dir: Path, train_file: Path, settings: PlainSettings, order: list[list[int]] | None = None):
    """(the trained PEFT model, rocktune's tokenizer and vision tokens for scoring it, the losses): a
    vision-language model's language-model LoRA trained by the plain loop."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from rocktune.tasks.vlm.bench.hf_vlm import ImageCollator, encoded
    from rocktune.tasks.vlm.vision.model import language_targets

    torch.manual_seed(settings.seed)
    examples, tokenizer, vision = encoded(str(model_dir), str(train_file), settings.max_length)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32,
                                                        attn_implementation="sdpa")
    model.config.use_cache = False
    lora = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0,
                      target_modules=language_targets(model), task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    rows = [{"input_ids": e.input_ids, "labels": e.labels, "images": e.images} for e in examples]
    collate = ImageCollator(vision.image_processor, tokenizer.pad_token_id, vision.image_token_id)
    losses = train_plain(model, rows, collate, settings, order)
    return model, tokenizer, vision, losses


def plain_lm(model_dir: Path, train_file: Path, settings: PlainSettings, cache_dir: Path):
    """(the trained PEFT model, its tokenizer, the losses): a causal LM's all-linear LoRA trained by the plain loop
    on rocktune's token ids and labels (loss on the completions only), padded by ``data.batching.collate``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rocktune.config import DataConfig
    from rocktune.data.batching import collate
    from rocktune.data.dataset import prepare_data
    from rocktune.models.load import load_tokenizer

    torch.manual_seed(settings.seed)
    tokenizer = load_tokenizer(str(model_dir), False)
    d = DataConfig(train_file=str(train_file), eval_fraction=0.0, max_length=settings.max_length)
    examples, _, _ = prepare_data(d, tokenizer, cache_dir, settings.seed)
    rows = [(list(examples.input_ids[i]), list(examples.labels[i])) for i in range(len(examples))]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))

    def pad(batch):
        return collate([x for x, _ in batch], [y for _, y in batch], tokenizer.pad_token_id)
    return model, tokenizer, train_plain(model, rows, pad, settings)
