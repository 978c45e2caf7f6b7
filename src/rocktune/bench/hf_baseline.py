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
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments, set_seed

    precision = _precision(recipe["precision"], device)
    set_seed(common["seed"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = {"dtype": torch.bfloat16 if precision == "bf16" else torch.float32}
    attn = _attention(recipe["attn_implementation"], device)
    if attn:
        kwargs["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.config.use_cache = False
    lora = LoraConfig(r=common["lora_r"], lora_alpha=common["lora_alpha"], lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora).to(device)
    probe.mark_loaded(model)

    ids, labels = examples.input_ids, examples.labels
    if order is not None:  # loss parity: rocktune's micro-batches, in rocktune's order, not shuffled
        ids, labels = [ids[i] for i in order], [labels[i] for i in order]
    collator = _collator(recipe, attn, tokenizer, common["max_length"])
    micro, accum = fixed_micro_batch(recipe.get("micro_batch"), common)
    records: list[dict] = []
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="rocktune-hf-"), max_steps=steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accum, learning_rate=common["lr"],
        weight_decay=0.0,
        lr_scheduler_type=common["scheduler"], warmup_steps=common["warmup_steps"], max_grad_norm=1.0,
        bf16=precision == "bf16", fp16=precision == "fp16", gradient_checkpointing=recipe["gradient_checkpointing"],
        dataloader_num_workers=0, logging_steps=20, save_strategy="no", eval_strategy="no", report_to="none",
        seed=common["seed"], remove_unused_columns=False, disable_tqdm=True, use_cpu=device == "cpu",
        train_sampling_strategy="sequential" if order is not None else recipe["sampler"],
        use_liger_kernel=_liger(recipe.get("liger", False), device), **expert_arguments(recipe, device),
    )

    trainer = measured_training(model, args, _Rows(ids, labels), collator, tokenizer, (probe, device, records))
    resolved = {"precision": precision, "attn_implementation": model.get_base_model().config._attn_implementation,
                "micro_batch_size": micro, "grad_accum": accum, "collator": type(collator).__name__,
                "liger": bool(args.use_liger_kernel), "torch_compile": bool(args.torch_compile),
                "optimizer": str(args.optim), "loss_scaled_by_step_tokens": bool(trainer.model_accepts_loss_kwargs)}
    return records, resolved


def measured_training(model, args, dataset, collator, tokenizer, measure: tuple):
    """The Trainer run as configured, measured: ``measure`` is (the probe, the device, the list each optimizer
    step's record is appended to: tokens counted from the host batches, the loss, the step's time)."""
    from transformers import Trainer, TrainerCallback

    probe, device, records = measure

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            acc = {**trainer.acc, "loss": float(trainer.acc["loss"])}  # after the step's sync: costs nothing
            records.append({**acc, "step": len(records) + 1, "step_s": now - self.t})
            probe.log_step(records[-1])
            trainer.acc = _zero()
            self.t = now

    class MeasuredTrainer(Trainer):
        acc = _zero()

        def training_step(self, model, inputs, num_items_in_batch=None):
            # The inputs are still host tensors here (the Trainer moves them inside): counting them costs no sync.
            lab = inputs["labels"]
            self.acc["tokens"] += int((lab[:, 1:] != IGNORE).sum())
            self.acc["real_tokens"] += real_token_count(inputs)
            self.acc["batch_tokens"] += lab.numel()
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.acc["loss"] = self.acc["loss"] + loss.detach().float()  # on the device: no sync per micro-batch
            return loss

    trainer = MeasuredTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                              processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    return trainer


def _zero() -> dict:
    return {"loss": 0.0, "tokens": 0, "real_tokens": 0, "batch_tokens": 0}


def _precision(setting: str, device: str) -> str:
    """``auto``: what rocktune's precision policy gives this device (bf16 where it has bf16 matrix units)."""
    if setting != "auto":
        return setting
    from rocktune.train.autoconf import resolve_auto

    return resolve_auto(device, "auto", "sdpa").precision


def real_token_count(inputs: dict) -> int:
    """Non-pad tokens of a collated batch: the attention mask's ones, or every token of a flattened (padding-free)
    batch, which has no mask."""
    mask = inputs.get("attention_mask")
    return int(mask.sum()) if mask is not None else inputs["input_ids"].numel()


def fixed_micro_batch(micro: int | None, common: dict) -> tuple[int, int]:
    """(per-device batch, accumulation): the recipe's fixed micro-batch where it divides the global batch (which is
    kept), else the common one."""
    total = common["micro_batch_size"] * common["grad_accum"]
    if not micro or total % micro:
        return common["micro_batch_size"], common["grad_accum"]
    return micro, total // micro


def expert_arguments(recipe: dict, device: str) -> dict:
    """The Trainer's own switches an expert turns on, on a GPU: ``torch_compile`` and the fused AdamW (no extra
    package). On a CPU compilation would cost more than the bench's few steps and fused AdamW is CUDA's."""
    if device != "cuda":
        return {}
    return {**({"torch_compile": True} if recipe.get("compile") else {}),
            **({"optim": recipe["optim"]} if recipe.get("optim") else {})}


def _collator(recipe: dict, attn: str | None, tokenizer, max_length: int):
    """``flatten``: padding-free rows (DataCollatorWithFlattening) with per-example position ids, from which
    transformers keeps the examples apart under flash-attention (varlen), flex attention (a document block mask) and
    SDPA (a block-diagonal mask)."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    padding = recipe["padding"]
    if padding == "flatten":
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE)
    return DataCollatorForSeq2Seq(tokenizer, padding=padding, max_length=max_length, label_pad_token_id=IGNORE)


def _attention(setting: str | None, device: str = "cpu") -> str | None:
    """``best``: flash-attention 2 when the flash_attn package is installed, else flex attention on a GPU (needs no
    package: a block mask from the flattened rows' position ids, compiled by transformers), else SDPA."""
    if setting != "best":
        return setting
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "flex_attention" if device == "cuda" else "sdpa"


def _liger(setting: bool, device: str) -> bool:
    """Liger's Triton kernels when asked for, on a GPU, with liger-kernel installed (the Trainer's own switch)."""
    return bool(setting) and device == "cuda" and importlib.util.find_spec("liger_kernel") is not None
