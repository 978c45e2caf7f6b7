"""The Hugging Face Trainer + PEFT recipe, as users write it, instrumented but not altered.

Both sides get identical token ids and labels from rocktune's encoder (loss on completions only), so the tokens
are the same; from there the HF side uses its own pieces: ``AutoModelForCausalLM``, ``get_peft_model``,
``DataCollatorForSeq2Seq`` padding, the Trainer's sampler, forward/loss, optimizer, scheduler and clipping.
The only additions are measurements: a ``training_step`` override that counts tokens and keeps the returned
loss, and a callback that times each optimizer step.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time

import torch

IGNORE = -100


class SkipBaseline(Exception):
    """This baseline cannot run on this machine; the message says why (reported as skipped)."""


class _Rows(torch.utils.data.Dataset):
    def __init__(self, input_ids: list[list[int]], labels: list[list[int]]):
        self.rows = [{"input_ids": x, "labels": y, "attention_mask": [1] * len(x)} for x, y in zip(input_ids, labels)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def run_hf(model_dir: str, examples, recipe: dict, steps: int, common: dict, device: str, probe,
           order: list[int] | None = None) -> tuple[list[dict], dict]:
    """Train ``steps`` optimizer steps; returns per-step records and what the recipe resolved to."""
    if importlib.util.find_spec("accelerate") is None:
        raise SkipBaseline("the HF Trainer needs the accelerate package, which is not installed "
                           "(pip install 'rocktune[bench]')")
    from peft import LoraConfig, get_peft_model
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer,
                              TrainerCallback, TrainingArguments, set_seed)

    precision = _precision(recipe["precision"], device)
    set_seed(common["seed"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = {"dtype": torch.bfloat16 if precision == "bf16" else torch.float32}
    if recipe["attn_implementation"]:
        kwargs["attn_implementation"] = recipe["attn_implementation"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.config.use_cache = False
    lora = LoraConfig(r=common["lora_r"], lora_alpha=common["lora_alpha"], lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora).to(device)
    probe.mark_loaded(model)

    ids, labels = examples.input_ids, examples.labels
    if order is not None:  # loss parity: rocktune's micro-batches, in rocktune's order, not shuffled
        ids, labels = [ids[i] for i in order], [labels[i] for i in order]
    records: list[dict] = []
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="rocktune-hf-"), max_steps=steps,
        per_device_train_batch_size=common["micro_batch_size"],
        gradient_accumulation_steps=common["grad_accum"], learning_rate=common["lr"], weight_decay=0.0,
        lr_scheduler_type=common["scheduler"], warmup_steps=common["warmup_steps"], max_grad_norm=1.0,
        bf16=precision == "bf16", fp16=precision == "fp16", gradient_checkpointing=recipe["gradient_checkpointing"],
        dataloader_num_workers=0, logging_steps=20, save_strategy="no", eval_strategy="no", report_to="none",
        seed=common["seed"], remove_unused_columns=False, disable_tqdm=True, use_cpu=device == "cpu",
        train_sampling_strategy="sequential" if order is not None else recipe["sampler"],
    )
    collator = DataCollatorForSeq2Seq(tokenizer, padding=recipe["padding"], max_length=common["max_length"],
                                      label_pad_token_id=IGNORE)

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            records.append({**trainer.acc, "step": len(records) + 1, "step_s": now - self.t})
            trainer.acc = _zero()
            self.t = now

    class MeasuredTrainer(Trainer):
        acc = _zero()

        def training_step(self, model, inputs, num_items_in_batch=None):
            lab, mask = inputs["labels"], inputs["attention_mask"]
            self.acc["tokens"] += int((lab[:, 1:] != IGNORE).sum())
            self.acc["real_tokens"] += int(mask.sum())
            self.acc["batch_tokens"] += mask.numel()
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.acc["loss"] += float(loss)
            return loss

    trainer = MeasuredTrainer(model=model, args=args, train_dataset=_Rows(ids, labels), data_collator=collator,
                              processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    resolved = {"precision": precision, "attn_implementation": model.get_base_model().config._attn_implementation,
                "optimizer": str(args.optim), "loss_scaled_by_step_tokens": bool(trainer.model_accepts_loss_kwargs)}
    return records, resolved


def _zero() -> dict:
    return {"loss": 0.0, "tokens": 0, "real_tokens": 0, "batch_tokens": 0}


def _precision(setting: str, device: str) -> str:
    """``auto``: what rocktune's precision policy gives this device (bf16 where it has bf16 matrix units)."""
    if setting != "auto":
        return setting
    from rocktune.train.autoconf import resolve_auto

    return resolve_auto(device, "auto", "sdpa").precision
