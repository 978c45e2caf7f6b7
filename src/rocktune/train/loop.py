"""The training loop. Read it top to bottom: setup, then one optimizer step per iteration, then save.

No trainer class, no callbacks: every step is here. Shared numerics (loss normalisation, token counting) live in
``train/loss.py`` and ``data/batching.py`` so that the loop, the eval pass and the benchmarks agree.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rocktune.config import RunConfig
from rocktune.data.batching import BatchStream, collate, count_loss_tokens
from rocktune.data.dataset import prepare_data
from rocktune.model import apply_lora, load_model, load_tokenizer, trainable_parameters
from rocktune.platform.autoconf import resolve_auto
from rocktune.train import rundir
from rocktune.train.evaluate import eval_loss
from rocktune.train.loss import causal_lm_loss_sum, step_normalised
from rocktune.train.progress import MetricsLog, ProgressBar


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    model: object = None
    tokenizer: object = None


def train(cfg: RunConfig, overwrite: bool = False, quiet: bool = False) -> TrainResult:
    t, m, d = cfg.training, cfg.model, cfg.data
    run_dir = Path(cfg.output.dir)
    resolved = cfg.model_dump(mode="json")
    rundir.check_output_dir(run_dir, resolved, overwrite)
    choices = resolve_auto(t.device, t.precision, m.attn_implementation)
    device, precision = choices.device, choices.precision
    _seed_everything(t.seed)

    # Everything that can reject the input runs before the run directory is touched.
    tokenizer = load_tokenizer(m.name_or_path, m.trust_remote_code)
    cache_dir = Path(d.cache_dir) if d.cache_dir else run_dir.resolve().parent / ".rocktune_cache"
    train_set, eval_set, stats = prepare_data(d.train_file, d.eval_file, d.eval_fraction, d.format, d.max_length,
                                              d.train_on_prompt, tokenizer, cache_dir, t.seed)
    model = load_model(m.name_or_path, precision, choices.attn_implementation, m.trust_remote_code, device)
    model = apply_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules,
                       m.gradient_checkpointing)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, foreach=True)
    stream = BatchStream(train_set.lengths(), t.micro_batch_size, t.seed)
    total_steps = t.max_steps or math.ceil(t.epochs * len(stream) / t.grad_accum)
    scheduler = _scheduler(optimizer, t.scheduler, t.warmup_steps, total_steps)
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")
    autocast = _autocast(device, precision)
    pad_id = tokenizer.pad_token_id

    rundir.start(run_dir, resolved, overwrite)
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    result = TrainResult(run_dir=run_dir, steps=total_steps, model=model, tokenizer=tokenizer)
    n_train = sum(p.numel() for p in params)
    with ProgressBar(total_steps, 0, quiet) as bar:
        for msg in choices.messages + stats.notes:
            bar.log(f"[dim]{msg}[/]")
        bar.log(f"{len(train_set)} train / {len(eval_set)} eval examples ({stats.shape}, cache "
                f"{'hit' if stats.cache_hit else 'written'}); {n_train:,} trainable parameters; {precision} on {device}")
        result.eval_loss_before = eval_loss(model, eval_set, t.micro_batch_size, pad_id, device, autocast,
                                            t.loss_chunk_size)
        metrics.write({"step": 0, "eval_loss": result.eval_loss_before})
        model.train()
        for step in range(1, total_steps + 1):
            t0 = time.perf_counter()
            # Fetch the whole step first: the loss is normalised by the loss-bearing tokens of all its micro-batches.
            micro = [collate([train_set.input_ids[i] for i in idx], [train_set.labels[i] for i in idx], pad_id)
                     for idx in (stream.next() for _ in range(t.grad_accum))]
            step_tokens = sum(count_loss_tokens(b["labels"]) for b in micro)
            step_loss = 0.0
            for batch in micro:
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                with autocast():
                    loss_sum, _ = causal_lm_loss_sum(model, batch, t.loss_chunk_size)
                scaler.scale(step_normalised(loss_sum, step_tokens)).backward()
                step_loss += float(loss_sum.detach())
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm or float("inf"))
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            elapsed = time.perf_counter() - t0
            loss = step_loss / max(step_tokens, 1)
            result.losses.append(loss)
            lr = scheduler.get_last_lr()[0]
            mem = torch.cuda.max_memory_allocated() if device == "cuda" else None
            bar.update(step, loss, lr, step_tokens / elapsed, mem)
            if step % t.log_every == 0 or step == total_steps:
                metrics.write({"step": step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                               "tokens": step_tokens, "useful_tokens_per_s": step_tokens / elapsed,
                               "step_s": elapsed, "epoch": stream.epoch, "peak_mem_bytes": mem})
            if t.eval_every and step % t.eval_every == 0 and step < total_steps:
                ev = eval_loss(model, eval_set, t.micro_batch_size, pad_id, device, autocast, t.loss_chunk_size)
                metrics.write({"step": step, "eval_loss": ev})
                bar.log(f"step {step}: eval loss {ev:.4f}")
        result.eval_loss_after = eval_loss(model, eval_set, t.micro_batch_size, pad_id, device, autocast,
                                           t.loss_chunk_size)
        metrics.write({"step": total_steps, "eval_loss": result.eval_loss_after})
        save_adapter(model, run_dir / "adapter", run_dir / rundir.CONFIG_NAME)
        bar.log(f"adapter saved to {run_dir / 'adapter'}")
    return result


def save_adapter(model, out: Path, config_file: Path) -> None:
    """PEFT format (adapter_config.json + adapter_model.safetensors), written beside, then swapped in."""
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "rocktune_config.yaml").write_text(config_file.read_text())
    if out.exists():
        old = out.with_name(out.name + ".old")
        out.rename(old)
        tmp.rename(out)
        import shutil

        shutil.rmtree(old)
    else:
        tmp.rename(out)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _scheduler(optimizer, kind: str, warmup: int, total: int):
    from transformers import get_scheduler

    return get_scheduler(kind if kind != "constant" else "constant_with_warmup", optimizer,
                         num_warmup_steps=min(warmup, total), num_training_steps=total)


def _autocast(device: str, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device_type=device, dtype=dtype)
