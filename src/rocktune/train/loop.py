"""The training loop. Read it top to bottom: setup, optional resume, one optimizer step per iteration, save.

No trainer class, no callbacks: every step is here. Shared numerics (loss normalisation, token counting) live in
``train/loss.py`` and ``data/batching.py`` so that the loop, the eval pass and the benchmarks agree. Reliability
pieces (checkpoints, guards, OOM recovery) are small modules the loop calls at the points where they act.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rocktune.config import RunConfig
from rocktune.data import checks
from rocktune.data.batching import loss_token_counts
from rocktune.data.dataset import prepare_data
from rocktune.model import trainable_parameters
from rocktune.platform.environment import apply_environment
from rocktune.train import (autofit, build, checkpoint, distributed, finish, preflight, resume, rundir, sinks,
                            summary)
from rocktune.train.autoconf import resolve_auto
from rocktune.train.evaluate import eval_sums
from rocktune.train.faults import Faults
from rocktune.train.feed import StepFeed
from rocktune.train.finish import save_adapter
from rocktune.train.guards import NumericGuard
from rocktune.train.interrupt import InterruptFlag
from rocktune.train.progress import MetricsLog, NullLog, ProgressBar
from rocktune.train.quant_gate import check_quantization
from rocktune.train.rundir import STOP_FILE
from rocktune.train.samples import Sampler
from rocktune.train.step import (LossModule, OutOfMemoryAtMinimum, StepRunner, finish_step, forward_backward,
                                 max_pieces, run_with_oom_recovery)


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    interrupted: bool = False
    model: object = None
    tokenizer: object = None


def train(cfg: RunConfig, overwrite: bool = False, resume_run: bool = False, resume_force: bool = False,
          quiet: bool = False, pieces: int = 1, faults: Faults | None = None, auto_fit: bool = False,
          vram_bytes: int | None = None, on_ready=None) -> TrainResult:
    """Train ``cfg``; ``on_ready(model)`` (benchmarks) is called once the model with its adapter is built."""
    # The runtime reads these variables when the device initialises: set them before anything touches it.
    env_notes = apply_environment()
    dist = distributed.from_env()  # one process unless torchrun started several
    distributed.device_for(dist)  # each rank's own GPU, before any self-test touches one
    choices = resolve_auto(cfg.training.device, cfg.training.precision, cfg.model.attn_implementation)
    device, precision = choices.device, choices.precision
    # Check, then write (train/preflight.py): data files, kernel gates and the model directory come first.
    vocab_size = preflight.check_run(cfg.model.name_or_path, cfg.data.train_file, cfg.data.eval_file, device,
                                     cfg.model.liger, choices.attn_implementation)
    fit_notes: list[str] = []
    predicted_peak = None
    if auto_fit:
        cfg, fit_notes, predicted_peak = autofit.apply_fit(cfg, precision, choices.attn_implementation, vram_bytes)
    t, m, d, rel = cfg.training, cfg.model, cfg.data, cfg.reliability
    quant_notes = check_quantization(m.quantization, m.name_or_path, precision, device, d.max_length, cfg.lora.r)
    faults = faults or Faults()
    run_dir = Path(cfg.output.dir)
    resolved = cfg.model_dump(mode="json")
    rundir.check_output_dir(run_dir, resolved, overwrite, resume_run)
    if resume_run:
        resume.check_config(run_dir, resolved, resume_force)
    if resume_run and summary.already_complete(run_dir, resume_force):
        fig = summary.report_complete(run_dir)
        return TrainResult(run_dir, fig.steps, eval_loss_before=fig.eval_before, eval_loss_after=fig.eval_after)
    build.seed_everything(t.seed)

    # Everything that can reject the input runs before the run directory is touched.
    sinks.require(cfg.output.tensorboard, cfg.output.wandb, cfg.output.mlflow)
    tokenizer = preflight.load_tokenizer(m.name_or_path, m.trust_remote_code)
    cache_dir = Path(d.cache_dir) if d.cache_dir else run_dir.resolve().parent / ".rocktune_cache"
    data_checks = lambda examples, shape: checks.enforce(checks.check_training_data(  # noqa: E731
        examples, tokenizer, shape, d.train_on_prompt, d.train_file, d.max_length), d.train_file)
    # Several ranks: the group is proven sound before anything is written, and rank 0 writes the token cache that
    # the others then read.
    distributed.init(dist, device, rel.collective_timeout_s, rel.preflight_timeout_s)
    dist.notes += distributed.preflight(dist, device, rel.preflight_timeout_s)
    # prepare_data writes its cache only after every file, the split and data_checks passed.
    train_set, eval_set, stats = distributed.main_first(dist, lambda: prepare_data(
        d.train_file, d.eval_file, d.eval_fraction, d.format, d.max_length, d.train_on_prompt, tokenizer, cache_dir,
        t.seed, d.truncation, vocab_size, check=data_checks), "preparing the data")
    distributed.same_run(dist, stats.fingerprint)
    lengths = train_set.lengths()
    compiled = build.want_compile(t.compile, choices.compile, device, t.batching, dist.world)
    parallel, parallel_notes = autofit.choose_parallel(cfg, dist.world, device, precision,
                                                       choices.attn_implementation, vram_bytes)
    strategy = distributed.strategy(dist, parallel, m.quantization)
    dist.notes += parallel_notes
    feeding, feed_notes, planned_peak = autofit.plan_feeding(cfg, device, precision, choices.attn_implementation,
                                                             lengths, vram_bytes, compiled, dist.world, parallel)
    predicted_peak = planned_peak or predicted_peak
    chunk = autofit.loss_chunk(t.loss_chunk_size, device)
    # FSDP loads on the CPU and moves each rank's shards to its GPU: the whole base need not fit one device.
    model, notes = build.model_with_adapter(m.name_or_path, precision, choices.attn_implementation,
                                            m.trust_remote_code, "cpu" if strategy == "fsdp" else device, m.liger,
                                            cfg.lora.r, cfg.lora.alpha,
                                            cfg.lora.dropout, cfg.lora.target_modules, m.gradient_checkpointing,
                                            compiled, m.quantization, m.double_quant)
    loss_module = distributed.wrap(LossModule(model, chunk, t.loss_impl == "chunked"), dist, device, strategy)
    if on_ready is not None:
        on_ready(model)
    params = trainable_parameters(model)
    idle = build.idle_batch(tokenizer.pad_token_id)  # a forward with no loss, for ranks that must keep in step
    runner = StepRunner(loss_module, device, build.autocast(device, precision),
                        torch.amp.GradScaler(device, enabled=precision == "fp16"), faults, dist.world,
                        after_backward=lambda: distributed.sync_gradients(dist, params, strategy),
                        lockstep_idle=idle if strategy == "fsdp" else None)
    optimizer = build.optimizer(params, t.optimizer, t.lr, t.weight_decay, device)
    # flash-attention only separates packed sequences within a single row, so its rows are joined into one.
    to_batch = build.make_collate(train_set, feeding.packed, tokenizer.pad_token_id,
                                  one_row=choices.attn_implementation == "flash_attention_2",
                                  pin=choices.pin_memory and device == "cuda",
                                  width=d.max_length if feeding.static_width else 0)
    # On a GPU the next step is collated while this one computes; on a CPU a thread would only compete for cores.
    loss_counts = loss_token_counts(train_set.labels)  # once: a resume builds the feed again
    new_feed = lambda **position: StepFeed(feeding, lengths, loss_counts, to_batch, device == "cuda",  # noqa: E731
                                           (dist.rank, dist.world), idle, strategy == "fsdp", **position)
    feed = new_feed()
    total_steps = t.max_steps or math.ceil(t.epochs * feed.steps_per_epoch)
    scheduler = build.scheduler(optimizer, t.scheduler, t.warmup_steps, total_steps)
    scaler, autocast = runner.scaler, runner.autocast
    guard = NumericGuard(rel.nan_patience, rel.zero_patience)
    eval_rows = max(t.micro_batch_size, feeding.rows_per_forward)  # no gradients: a forward's rows fit easily
    # Sharded weights are gathered from every rank in each forward: then every rank evaluates and samples in step.
    everyone = strategy == "fsdp"
    # DDP: each rank evaluates its share and the sums are added; FSDP: every rank runs every eval forward.
    eval_share = eval_set if everyone or not dist.enabled else \
        eval_set.subset(list(range(dist.rank, len(eval_set), dist.world)))
    evaluate = lambda: distributed.mean_over_ranks(dist, *eval_sums(  # noqa: E731
        model, eval_share, eval_rows, tokenizer.pad_token_id, device, autocast, chunk, t.loss_impl == "chunked"))

    def compile_failed(exc: BaseException) -> None:
        nonlocal compiled
        compiled = False
        build.uncompile_decoder(model)
        bar.log(f"[yellow]torch.compile failed ({str(exc).strip().splitlines()[0][:200]}); continuing without "
                "it (set training.compile=false to skip the attempt)[/]")

    result = TrainResult(run_dir=run_dir, steps=total_steps, model=model, tokenizer=tokenizer)
    ckpt_root = run_dir / "checkpoints"
    start_step = 0
    restored = None
    if resume_run:
        restored = distributed.main_first(dist, lambda: checkpoint.restore(ckpt_root, model, optimizer, scheduler,
                                                                           scaler), "restoring the checkpoint")
        resume.check_world(restored, dist.world, resume_force)
        resume.check_data(restored, stats.fingerprint, resume_force)
        resume.check_batching(restored, feeding.mode)
    if restored is None and dist.main:
        rundir.start(run_dir, resolved, wipe=overwrite and not resume_run)
        resume.truncate_metrics(run_dir / "metrics.jsonl", 0)  # a resume with no checkpoint starts over
    elif restored is not None:
        if dist.main:
            rundir.write_config(run_dir, resolved)  # a forced resume (e.g. the fp32 fallback) records what now runs
        distributed.restore_rng(dist, restored.extra.get("rank_rng"))
        start_step = restored.step
        feed.close()
        feed = new_feed(**restored.position)
        pieces = max(pieces, restored.extra.get("pieces", 1))
        guard.skipped_total = restored.extra.get("skipped_steps", 0)
        result.eval_loss_before = restored.extra.get("eval_loss_before")
        if dist.main:
            resume.truncate_metrics(run_dir / "metrics.jsonl", restored.extra["metrics_lines"])
    distributed.barrier(dist, "the start of the run")
    # Metrics, samples, eval, reports and the adapter come from rank 0; the other ranks train and stay quiet.
    log_to = MetricsLog(run_dir / "metrics.jsonl") if dist.main else NullLog()
    metrics = sinks.open_log(log_to, run_dir, start_step, cfg.output.tensorboard and dist.main,
                             cfg.output.wandb and dist.main, cfg.output.mlflow and dist.main)
    if dist.main:
        sinks.write_run_info(run_dir, device, precision, predicted_peak, env_notes + choices.messages + fit_notes +
                             feed_notes + notes + stats.notes, stats, lengths, len(eval_set))
    samples = dist.main or everyone
    sampler = Sampler.build(run_dir, tokenizer, stats.shape, eval_set, t.sample_count if samples else 0,
                            t.sample_prompts if samples else [], t.sample_max_new_tokens, device, autocast,
                            start_step, write=dist.main, synced=everyone)
    stop = InterruptFlag()
    space_skips = checkpoint.SpaceSkips()

    def save_checkpoint(step: int) -> None:
        rank_rng = distributed.gather_rng(dist)  # every rank takes part; rank 0 writes the checkpoint
        if not dist.main:
            return
        extra = {"pieces": pieces, "eval_loss_before": result.eval_loss_before, "data_fingerprint": stats.fingerprint,
                 "metrics_lines": metrics.lines(), "skipped_steps": guard.skipped_total, "batching": feeding.mode,
                 "world_size": dist.world, "rank_rng": rank_rng}
        need = sum(p.numel() * 4 * 3 for p in params) + rel.min_free_disk_mb * 2**20
        checkpoint.save(ckpt_root, step, model, optimizer, scheduler, scaler, feed.position(), extra,
                        rel.keep_checkpoints, need, before_commit=lambda: faults.checkpoint_write(step),
                        skips=space_skips)

    with ProgressBar(total_steps, start_step, quiet, silent=not dist.main) as bar, stop, contextlib.closing(feed):
        for msg in env_notes + choices.messages + quant_notes + fit_notes + feed_notes + dist.notes + notes + \
                stats.notes:
            bar.log(f"[dim]{msg}[/]")
        if restored is not None:
            for why in restored.skipped:
                bar.log(f"[yellow]warning: skipped damaged checkpoint {why}[/]")
            bar.log(f"resumed from {restored.path.name} (step {start_step} of {total_steps})")
        bar.log(f"{len(train_set)} train / {len(eval_set)} eval examples ({stats.shape}, cache "
                f"{'hit' if stats.cache_hit else 'written'}); {sum(p.numel() for p in params):,} trainable "
                f"parameters; {precision} on {device}")
        if restored is None:
            result.eval_loss_before = evaluate()
            metrics.write({"step": 0, "eval_loss": result.eval_loss_before})
            sampler.at(0, model, metrics, bar.log)
        model.train()
        run_peak = 0
        first_step = start_step + 1
        for step in range(first_step, total_steps + 1):
            t0 = time.perf_counter()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()  # the logged peak is this step's, not the eval pass's
            faults.slow_step()
            # Fetch the whole step first: the loss is normalised by the loss-bearing tokens of all its micro-batches.
            fed = feed.next()
            micro, step_tokens = fed.forwards, fed.loss_tokens
            check = rel.transfer_check_every and (step <= 3 or step % rel.transfer_check_every == 0)
            compiling = compiled and step == first_step
            if compiling:
                bar.log(f"step {step}: compiling the decoder (this step is left out of tokens/s)")
            try:
                with distributed.collective(dist, f"step {step}'s gradient all-reduce"):
                    step_loss, pieces = run_with_oom_recovery(
                        lambda n: forward_backward(runner, micro, step_tokens, n, step, bool(check)),
                        optimizer, pieces, max(max_pieces(b) for b in micro), bar.log,
                        # Dynamo may recompile at any step (new shapes); a rank of several cannot re-run alone
                        on_compile_error=compile_failed if compiled and not dist.enabled else None,
                        alone=not dist.enabled)
            except OutOfMemoryAtMinimum as exc:
                advice = autofit.oom_advice(m.name_or_path, d.max_length, cfg.lora.r, cfg.lora.target_modules,
                                            precision, choices.attn_implementation,
                                            t.micro_batch_size * t.grad_accum, t.loss_impl)
                raise OutOfMemoryAtMinimum(
                    f"out of memory at step {step} even with one example per forward ({exc}). {advice}") from None
            asked = stop.requested or (dist.main and (run_dir / STOP_FILE).exists())  # the supervisor's Ctrl-C
            update = finish_step(runner, optimizer, scheduler, params, t.max_grad_norm, guard, dist, step_loss,
                                 step_tokens, asked, step)
            loss, grad_norm, wait_s, stop.requested = update.loss, update.grad_norm, update.wait_s, update.stop
            if not update.applied:
                bar.log(f"[yellow]step {step}: non-finite loss or gradient, update skipped[/]")
            faults.after_update(step)

            elapsed = time.perf_counter() - t0
            result.losses.append(loss)
            lr = scheduler.get_last_lr()[0]
            mem = torch.cuda.max_memory_allocated() if device == "cuda" else None
            run_peak = max(run_peak, mem or 0)
            bar.update(step, loss, lr, step_tokens / elapsed, mem)
            if step % t.log_every == 0 or step == total_steps:
                metrics.write({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": step_tokens,
                               "batch_tokens": sum(b["input_ids"].numel() for b in micro),
                               "real_tokens": fed.real_tokens,
                               "forwards": len(micro), "pieces": pieces, "samples": _digest(micro),
                               "useful_tokens_per_s": step_tokens / elapsed, "step_s": elapsed,
                               "device_wait_s": wait_s, "compiling": compiling,
                               "epoch": feed.epoch, "peak_mem_bytes": mem})
            if t.eval_every and step % t.eval_every == 0 and step < total_steps and len(eval_set):
                ev = evaluate()
                metrics.write({"step": step, "eval_loss": ev})
                bar.log(f"step {step}: eval loss {ev:.4f}")
                sampler.at(step, model, metrics, bar.log)
            due = (rel.save_every and step % rel.save_every == 0) or step == total_steps or stop.requested
            saved = due and guard.nonfinite_in_row == 0 and checkpoint.save_or_warn(save_checkpoint, step, bar.log)
            if stop.requested:  # a rollback point must precede a non-finite streak, so none is written inside one
                where = f"checkpoint at step {step}" if saved else "the last good checkpoint is kept"
                bar.log(f"interrupted: {where}; continue with --resume")
                result.interrupted = True
                distributed.barrier(dist, "the interrupt checkpoint")  # no rank exits while rank 0 still writes
                return result
        result.eval_loss_after = evaluate()
        if everyone and not dist.main:
            sampler.at(total_steps, model, metrics, bar.log)  # in step with rank 0's generations
        if dist.main:
            # Final writes check free space first; a full disk stops the run with finish.DiskFullError (exit 5).
            need = finish.adapter_bytes(params)
            with finish.guarded(run_dir, "the final metrics and sample generations", need):
                metrics.write({"step": total_steps, "eval_loss": result.eval_loss_after})
                sampler.at(total_steps, model, metrics, bar.log)
            with finish.guarded(run_dir, f"the adapter to {run_dir / 'adapter'}", need, faults.final_write):
                save_adapter(model, run_dir / "adapter", run_dir / rundir.CONFIG_NAME)
            if space_skips.summary():
                bar.log(f"[yellow]{space_skips.summary()}[/]")
            summary.log_summary(run_dir, bar.log, time.perf_counter() - bar.t0, run_peak, predicted_peak)
        distributed.barrier(dist, "the end of the run")  # no rank leaves before the adapter is written
    return result


def _digest(micro: list[dict]) -> str:
    """Short hash of the step's token ids: two runs that log the same digests saw the same samples."""
    h = hashlib.blake2b(digest_size=6)
    for batch in micro:
        h.update(batch["input_ids"].numpy().tobytes())
    return h.hexdigest()
