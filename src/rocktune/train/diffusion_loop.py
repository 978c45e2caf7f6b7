"""The training loop for Wan LoRA (task: video-lora / image-lora). Read it top to bottom like the LM loop.

It is the LM loop's shape with the diffusion task's own data and objective: media checked and assigned to buckets,
latents and text embeddings cached once (diffusion/cache.py), then only the transformer trains, with flow matching
(diffusion/objective.py). Everything reliability-related is the LM path's own code: the step with OOM recovery
(train/step.py), the numeric guard, checkpoints with exact resume, Ctrl-C, the supervisor, progress and metrics.
One process: several ranks are refused before anything is written.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from pathlib import Path

import torch

from rocktune.config import RunConfig
from rocktune.diffusion import comfy, components, media
from rocktune.diffusion.cache import LatentSet, cache_latents
from rocktune.diffusion.objective import FlowMatchLoss
from rocktune.diffusion.steps import LatentFeed, Noise, eval_forwards
from rocktune.errors import UserError
from rocktune.model import DTYPES, trainable_parameters
from rocktune.platform.environment import apply_environment
from rocktune.train import build, checkpoint, distributed, finish, resume, rundir, sinks, summary
from rocktune.train.autoconf import resolve_auto
from rocktune.train.faults import Faults
from rocktune.train.finish import save_adapter
from rocktune.train.guards import NumericGuard
from rocktune.train.interrupt import InterruptFlag
from rocktune.train.loop import TrainResult
from rocktune.train.progress import MetricsLog, ProgressBar
from rocktune.train.rundir import STOP_FILE
from rocktune.train.step import (OutOfMemoryAtMinimum, StepRunner, finish_step, forward_backward, max_pieces,
                                 run_with_oom_recovery)

LORA_FILE = "wan_lora.safetensors"  # ComfyUI and diffusers' WanPipeline.load_lora_weights both load it


def train_diffusion(cfg: RunConfig, overwrite: bool = False, resume_run: bool = False, resume_force: bool = False,
                    quiet: bool = False, pieces: int = 1, faults: Faults | None = None, auto_fit: bool = False,
                    vram_bytes: int | None = None) -> TrainResult:
    """Train ``cfg`` (task video-lora / image-lora); the worker's arguments, as for ``train.loop.train``."""
    if auto_fit:
        raise UserError(f"--auto chooses LM settings; for task={cfg.task} see what fits with `rocktune plan "
                        f"{cfg.model.name_or_path} --task {cfg.task} --resolution WxH --frames N --vram ...`.")
    _refuse_lm_only(cfg)
    env_notes = apply_environment()
    dist = distributed.from_env()
    if dist.enabled:
        raise UserError(f"task={cfg.task} trains in one process; multi-GPU diffusion LoRA is not supported yet. "
                        "Run without --nproc (docs/diffusion.md).")
    t, m, d, rel, diff = cfg.training, cfg.model, cfg.data, cfg.reliability, cfg.diffusion
    choices = resolve_auto(t.device, t.precision, "sdpa")
    device, precision = choices.device, choices.precision
    # Check, then write: the checkpoint's layout, the buckets, the LoRA targets and every media file come first.
    layout = components.read_layout(m.name_or_path, diff.expert)
    frames = [1] if cfg.task == "image-lora" else diff.frames
    media.check_buckets(diff.resolutions, frames, layout.spatial_multiple, layout.temporal, cfg.task)
    comfy.check_targets(components.planned_targets(layout, cfg.lora.target_modules))
    train_media, eval_media = _split(_assigned(d.train_file, cfg, frames), d.eval_file, d.eval_fraction, t.seed,
                                     lambda source: _assigned(source, cfg, frames))
    # Before the (long) encode: the planner's peak for the largest bucket, and a warning when it exceeds the GPU.
    predicted_peak, plan_note = _predicted_peak(cfg, [b for _, b in train_media], precision, _device_bytes(device))
    faults = faults or Faults()
    run_dir = Path(cfg.output.dir)
    resolved = cfg.model_dump(mode="json")
    rundir.check_output_dir(run_dir, resolved, overwrite, resume_run)
    if resume_run:
        resume.check_config(run_dir, resolved, resume_force)
    if resume_run and summary.already_complete(run_dir, resume_force):
        fig = summary.report_complete(run_dir, _outputs(run_dir))
        return TrainResult(run_dir, fig.steps, eval_loss_before=fig.eval_before, eval_loss_after=fig.eval_after)
    build.seed_everything(t.seed)
    sinks.require(cfg.output.tensorboard, cfg.output.wandb, cfg.output.mlflow)

    # Encode once, then free the VAE and the text encoder: training holds only the transformer.
    cache_root = Path(d.cache_dir) if d.cache_dir else run_dir.resolve().parent / ".rocktune_cache"
    say = _console(quiet)
    say(plan_note if not plan_note.startswith("warning") else f"[yellow]{plan_note}[/]")
    encode_on = "cpu" if diff.cache_device == "cpu" else device
    train_set = cache_latents(train_media, layout, encode_on, diff.max_text_tokens, cache_root, say)
    eval_set = cache_latents(eval_media, layout, encode_on, diff.max_text_tokens, cache_root, say) \
        if eval_media else LatentSet([], "", True, [])
    shift = layout.shift(diff.shift)
    noise = Noise(diff.timestep_sampling, shift, layout.sigma_range)

    model = components.apply_lora(components.load_transformer(m.name_or_path, DTYPES[precision], device,
                                                              layout.subfolder),
                                  cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules,
                                  m.gradient_checkpointing)
    params = trainable_parameters(model)
    for p in params:  # the adapter trains in fp32 whatever the base's storage (autocast picks the matmul precision)
        p.data = p.data.float()
    loss_module = FlowMatchLoss(model)
    runner = StepRunner(loss_module, device, build.autocast(device, precision),
                        torch.amp.GradScaler(device, enabled=precision == "fp16"), faults)
    optimizer = build.optimizer(params, t.optimizer, t.lr, t.weight_decay, device)
    new_feed = lambda **position: LatentFeed(train_set.items, t.micro_batch_size,  # noqa: E731
                                             t.micro_batch_size * t.grad_accum, t.seed, noise,
                                             components.PIPELINE_TEXT_TOKENS, **position)
    feed = new_feed()
    total_steps = t.max_steps or math.ceil(t.epochs * feed.steps_per_epoch)
    scheduler = build.scheduler(optimizer, t.scheduler, t.warmup_steps, total_steps)
    scaler, autocast = runner.scaler, runner.autocast
    guard = NumericGuard(rel.nan_patience, rel.zero_patience)
    eval_fed = eval_forwards(eval_set.items, t.micro_batch_size, t.seed, noise, components.PIPELINE_TEXT_TOKENS)
    evaluate = lambda: _eval_loss(loss_module, eval_fed, device, autocast)  # noqa: E731

    result = TrainResult(run_dir=run_dir, steps=total_steps, model=model)
    ckpt_root = run_dir / "checkpoints"
    start_step = 0
    restored = None
    if resume_run:
        restored = checkpoint.restore(ckpt_root, model, optimizer, scheduler, scaler)
        resume.check_data(restored, train_set.fingerprint, resume_force)
    if restored is None:
        rundir.start(run_dir, resolved, wipe=overwrite and not resume_run)
        resume.truncate_metrics(run_dir / "metrics.jsonl", 0)
    else:
        rundir.write_config(run_dir, resolved)
        start_step = restored.step
        feed = new_feed(**restored.position)
        pieces = max(pieces, restored.extra.get("pieces", 1))
        guard.skipped_total = restored.extra.get("skipped_steps", 0)
        result.eval_loss_before = restored.extra.get("eval_loss_before")
        resume.truncate_metrics(run_dir / "metrics.jsonl", restored.extra["metrics_lines"])
    metrics = sinks.open_log(MetricsLog(run_dir / "metrics.jsonl"), run_dir, start_step, cfg.output.tensorboard,
                             cfg.output.wandb, cfg.output.mlflow)
    notes = env_notes + choices.messages + train_set.notes + eval_set.notes  # the plan note was said before encoding
    sinks.write_info(run_dir, device, precision, predicted_peak, notes + [plan_note],
                     _data_info(cfg, train_set, eval_set, shift))
    stop = InterruptFlag()
    space_skips = checkpoint.SpaceSkips()
    per_token = int(layout.vae.get("z_dim", 16)) * math.prod(layout.patch)  # latent values per transformer token

    def save_checkpoint(step: int) -> None:
        extra = {"pieces": pieces, "eval_loss_before": result.eval_loss_before, "data_fingerprint":
                 train_set.fingerprint, "metrics_lines": metrics.lines(), "skipped_steps": guard.skipped_total}
        need = sum(p.numel() * 4 * 3 for p in params) + rel.min_free_disk_mb * 2**20
        checkpoint.save(ckpt_root, step, model, optimizer, scheduler, scaler, feed.position(), extra,
                        rel.keep_checkpoints, need, before_commit=lambda: faults.checkpoint_write(step),
                        skips=space_skips)

    with ProgressBar(total_steps, start_step, quiet) as bar, stop:
        for msg in notes:
            bar.log(f"[dim]{msg}[/]")
        if restored is not None:
            for why in restored.skipped:
                bar.log(f"[yellow]warning: skipped damaged checkpoint {why}[/]")
            bar.log(f"resumed from {restored.path.name} (step {start_step} of {total_steps})")
        expert = "" if layout.sigma_range == (0.0, 1.0) else \
            f", {layout.subfolder}/ at noise levels {layout.sigma_range[0]:g}-{layout.sigma_range[1]:g}"
        bar.log(f"{len(train_set)} train / {len(eval_set)} eval clips ({cfg.task}, flow shift {shift:g}{expert}); "
                f"{sum(p.numel() for p in params):,} trainable parameters; {precision} on {device}")
        if restored is None:
            result.eval_loss_before = evaluate()
            metrics.write({"step": 0, "eval_loss": result.eval_loss_before})
        model.train()
        run_peak = 0
        for step in range(start_step + 1, total_steps + 1):
            t0 = time.perf_counter()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            faults.slow_step()
            fed = feed.next()
            check = rel.transfer_check_every and (step <= 3 or step % rel.transfer_check_every == 0)
            try:
                step_loss, pieces = run_with_oom_recovery(
                    lambda n: forward_backward(runner, fed.forwards, fed.loss_tokens, n, step, bool(check)),  # noqa: B023
                    optimizer, pieces, max(max_pieces(b) for b in fed.forwards), bar.log)
            except OutOfMemoryAtMinimum as exc:
                raise OutOfMemoryAtMinimum(
                    f"out of memory at step {step} even with one clip per forward ({exc}). {plan_note}; set "
                    "model.gradient_checkpointing=true, or use fewer frames or smaller resolutions in the "
                    "diffusion section (rocktune plan MODEL --task video-lora shows what fits).") from None
            asked = stop.requested or (run_dir / STOP_FILE).exists()  # the supervisor's Ctrl-C
            update = finish_step(runner, optimizer, scheduler, params, t.max_grad_norm, guard, dist, step_loss,
                                 fed.loss_tokens, asked, step)
            loss, stop.requested = update.loss, update.stop
            if not update.applied:
                bar.log(f"[yellow]step {step}: non-finite loss or gradient, update skipped[/]")
            faults.after_update(step)

            elapsed = time.perf_counter() - t0
            result.losses.append(loss)
            lr = scheduler.get_last_lr()[0]
            mem = torch.cuda.max_memory_allocated() if device == "cuda" else None
            run_peak = max(run_peak, mem or 0)
            tokens = fed.loss_tokens // per_token
            bar.update(step, loss, lr, tokens / elapsed, mem)
            if step % t.log_every == 0 or step == total_steps:
                metrics.write({"step": step, "loss": loss, "lr": lr, "grad_norm": update.grad_norm, "tokens": tokens,
                               "latent_values": fed.loss_tokens, "forwards": len(fed.forwards), "pieces": pieces,
                               "samples": _digest(fed.names), "useful_tokens_per_s": tokens / elapsed,
                               "step_s": elapsed, "device_wait_s": update.wait_s, "epoch": feed.epoch,
                               "peak_mem_bytes": mem})
            if t.eval_every and step % t.eval_every == 0 and step < total_steps and len(eval_set):
                ev = evaluate()
                metrics.write({"step": step, "eval_loss": ev})
                bar.log(f"step {step}: eval loss {ev:.4f}")
            due = (rel.save_every and step % rel.save_every == 0) or step == total_steps or stop.requested
            saved = due and guard.nonfinite_in_row == 0 and checkpoint.save_or_warn(save_checkpoint, step, bar.log)
            if stop.requested:
                where = f"checkpoint at step {step}" if saved else "the last good checkpoint is kept"
                bar.log(f"interrupted: {where}; continue with --resume")
                result.interrupted = True
                return result
        result.eval_loss_after = evaluate()
        need = finish.adapter_bytes(params) * 2
        with finish.guarded(run_dir, "the final metrics", need):
            metrics.write({"step": total_steps, "eval_loss": result.eval_loss_after})
        # The LoRA file first: adapter/ is what marks a run complete (summary.already_complete), so a crash between
        # the two leaves a run that --resume finishes instead of one that claims to be done without its file.
        with finish.guarded(run_dir, f"the LoRA to {run_dir / LORA_FILE}", need):
            _write_comfy(model, cfg, run_dir / LORA_FILE)
        with finish.guarded(run_dir, f"the adapter to {run_dir / 'adapter'}", need, faults.final_write):
            save_adapter(model, run_dir / "adapter", run_dir / rundir.CONFIG_NAME)
        if space_skips.summary():
            bar.log(f"[yellow]{space_skips.summary()}[/]")
        summary.log_summary(run_dir, bar.log, time.perf_counter() - bar.t0, run_peak, predicted_peak,
                            outputs=_outputs(run_dir))
    return result


def _refuse_lm_only(cfg: RunConfig) -> None:
    """Settings that mean something for LMs only: asked for explicitly, they are refused rather than ignored."""
    m, t = cfg.model, cfg.training
    settings = {"model.quantization": (m.quantization, {"none"}), "model.liger": (m.liger, {"auto", "off"}),
                "training.compile": (t.compile, {"auto", False}),
                "training.batching": (t.batching, {"auto", "examples"}),
                "data.packing": (cfg.data.packing, {False}), "training.sample_count": (t.sample_count, {0}),
                "training.sample_prompts": (tuple(t.sample_prompts), {()})}
    asked = [f"{key}={value}" for key, (value, harmless) in settings.items() if value not in harmless]
    if asked:
        raise UserError(f"{', '.join(asked)}: only for task=lm, not supported for task={cfg.task} "
                        "(docs/diffusion.md lists what is; render samples after training with rocktune generate); "
                        "remove it from the config.")


def _assigned(source, cfg: RunConfig, frames: list[int]) -> list[tuple[media.MediaItem, media.Bucket]]:
    diff = cfg.diffusion
    items = media.list_items(source, diff.media_field, diff.caption_field)
    return media.assign_buckets(items, diff.resolutions, frames, cfg.task)


def _split(assigned: list, eval_file: str | None, eval_fraction: float, seed: int, read) -> tuple[list, list]:
    """A separate eval source, else a seeded share of the training files (at least one when a share is asked and
    at least two files exist, so that eval loss is never silently absent)."""
    if eval_file:
        return assigned, read(eval_file)
    n_eval = min(max(round(len(assigned) * eval_fraction), 1 if eval_fraction > 0 else 0), len(assigned) - 1)
    if n_eval <= 0:
        return assigned, []
    order = list(range(len(assigned)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    return [a for i, a in enumerate(assigned) if i not in held], [a for i, a in enumerate(assigned) if i in held]


def _eval_loss(loss_module, fed, device: str, autocast) -> float | None:
    """Mean squared velocity error over the eval set's fixed noise and noise levels."""
    if not fed.forwards:
        return None
    loss_module.model.eval()
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for batch in fed.forwards:
            with autocast():
                total += loss_module({k: v.to(device) for k, v in batch.items()}).float()
    loss_module.model.train()
    return float(total) / fed.loss_tokens


def _predicted_peak(cfg: RunConfig, buckets: list[media.Bucket], precision: str,
                    device_bytes: int | None) -> tuple[int | None, str]:
    """The planner's estimate for the largest bucket in use, at the configured micro batch; when it exceeds the
    device (``device_bytes``), the note says so and what gradient checkpointing would need instead."""
    from rocktune.planner.wan import estimate_wan, load_wan_shape

    largest = max(buckets, key=lambda b: b.width * b.height * b.frames)
    try:
        shape = load_wan_shape(cfg.model.name_or_path)
    except UserError as exc:
        return None, f"planner: no estimate ({exc})"

    def peak(checkpointing: bool):
        return estimate_wan(shape, largest.width, largest.height, largest.frames, cfg.training.micro_batch_size,
                            components.PIPELINE_TEXT_TOKENS, cfg.lora.r, precision, checkpointing)

    est = peak(cfg.model.gradient_checkpointing)
    note = (f"planner: {_size(est.total_bytes)} predicted peak at {largest} x{cfg.training.micro_batch_size} "
            f"({est.tokens:,} latent tokens per forward)")
    if device_bytes and est.total_bytes > device_bytes:
        note = f"warning: {note}, more than this device's {_size(device_bytes)}"
        if not cfg.model.gradient_checkpointing:
            note += (f"; with model.gradient_checkpointing=true it is {_size(peak(True).total_bytes)}, "
                     "set it before the run reaches its first step")
    return est.total_bytes, note


def _device_bytes(device: str) -> int | None:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if device == "cuda" else None


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _write_comfy(model, cfg: RunConfig, out: Path) -> None:
    from peft import get_peft_model_state_dict

    comfy.write_lora(out, get_peft_model_state_dict(model), cfg.lora.r, cfg.lora.alpha,
                     {"base_model": cfg.model.name_or_path, "task": cfg.task})


def _outputs(run_dir: Path) -> list[str]:
    run = str(run_dir)
    return [f"  adapter         {run_dir / 'adapter'} (PEFT)",
            f"  LoRA file       {run_dir / LORA_FILE} (ComfyUI: models/loras; diffusers: "
            "WanPipeline.load_lora_weights)",
            "next:",
            f"  rocktune generate {run} --prompt \"...\" --compare   # render a clip with and without the LoRA",
            f"  rocktune report {run}                                # loss curves and run facts"]


def _data_info(cfg: RunConfig, train_set: LatentSet, eval_set: LatentSet, shift: float) -> dict:
    buckets: dict[str, int] = {}
    for item in train_set.items:
        buckets[str(item.bucket)] = buckets.get(str(item.bucket), 0) + 1
    return {"task": cfg.task, "n_train": len(train_set), "n_eval": len(eval_set), "buckets": buckets,
            "transformer": cfg.diffusion.expert,
            "cache_hit": train_set.cache_hit, "fingerprint": train_set.fingerprint, "flow_shift": shift,
            "timestep_sampling": cfg.diffusion.timestep_sampling}


def _digest(names: list[str]) -> str:
    """Short hash of the step's files, in order: two runs that log the same digests saw the same clips."""
    return hashlib.blake2b("\n".join(names).encode(), digest_size=6).hexdigest()


def _console(quiet: bool):
    if quiet:
        return lambda message: None
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    return lambda message: console.print(f"[dim]{message}[/]")

