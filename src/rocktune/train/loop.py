"""The training loop, written once for every task. Read it top to bottom: ``run`` checks and sets up, ``_steps``
runs one optimizer step per iteration, ``_finish`` evaluates and writes the results.

No trainer class, no callbacks: every step is here. What differs between tasks (data, model, loss, evaluation,
samples, extra files) comes from a task object (train/task.py; every task in task_registry.py). Reliability pieces
(checkpoints, guards, OOM recovery, interrupts) are small modules called at the points where they act.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from rocktune.atomic import kill_point
from rocktune.errors import first_line
from rocktune.models.load import trainable_parameters
from rocktune.train import build, checkpoint, distributed, finish, memory, resume, rundir, sinks, summary
from rocktune.train.collector import Collector
from rocktune.train.context import RunContext
from rocktune.train.finish import save_adapter
from rocktune.train.estimate import Estimate, MemoryFacts, machine_memory, memory_note
from rocktune.train.guards import NumericGuard
from rocktune.train.heartbeat import Heartbeat
from rocktune.train.interrupt import InterruptFlag
from rocktune.train.progress import MetricsLog, NullLog, ProgressBar
from rocktune.train.rundir import STOP_FILE
from rocktune.train.step import (OutOfMemoryAtMinimum, StepRunner, finish_step, forward_backward,
                                 is_compile_error, run_with_oom_recovery)
from rocktune.train.task import Feed, Prepared, Task
from rocktune.train.tripwire import Tripwire


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    interrupted: bool = False
    peak_mem_bytes: int = 0  # the largest step's device peak (0 on a CPU)
    model: object = None
    tokenizer: object = None


@dataclass
class Run:
    """What the steps share once setup is done."""

    ctx: RunContext
    task: Task
    parts: Prepared
    params: list  # the trainable parameters (the adapter's)
    runner: StepRunner
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    guard: NumericGuard
    feed: Feed
    total_steps: int
    start_step: int
    pieces: int
    restored: checkpoint.Restored | None
    result: TrainResult
    metrics: sinks.LiveLog = cast("sinks.LiveLog", None)  # opened by _begin, before any step
    space_skips: checkpoint.SpaceSkips = field(default_factory=checkpoint.SpaceSkips)
    compiled: bool = False  # the decoder is compiled now (a compile failure turns it off, once)
    fallback: str | None = None  # that failure, for the metrics row of the step it happened in (the bench reports it)
    tripwire: Tripwire = cast(Tripwire, None)  # set by _setup right after the Run is built
    collector: Collector = field(default_factory=Collector)  # the objects alive after the first step, never scanned
    beat: Heartbeat = cast(Heartbeat, None)  # the run's heartbeat (heartbeat.py), set by run
    estimate: Estimate = cast(Estimate, None)  # the time left, from the steps and evals timed so far

    @property
    def state(self) -> checkpoint.TrainState:
        return checkpoint.TrainState(self.parts.model, self.optimizer, self.scheduler, self.runner.scaler)


def run(task: Task, ctx: RunContext, on_ready=None) -> TrainResult:
    """Train ``task``; ``on_ready(model)`` (benchmarks) is called once the model with its adapter is built."""
    # A line at least every Heartbeat.EVERY_S seconds from here on (rank 0): loading, tokenising, steps, evals.
    with Heartbeat(_console_log(), enabled=ctx.dist.main and not ctx.quiet) as beat:
        return _run(task, ctx, on_ready, beat)


def _console_log():
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    return lambda line: console.print(line, highlight=False)


def _run(task: Task, ctx: RunContext, on_ready, beat: Heartbeat) -> TrainResult:
    # The run directory first (seconds, no model touched) unless --auto, whose fitted config is what it compares.
    early = not ctx.options.auto_fit
    done = _check_run_dir(task, ctx) if early else None
    if done is None:
        task.check(ctx)  # check, then write: every input the task can check without writing
        done = None if early else _check_run_dir(task, ctx)
    if done is not None:
        return done
    cfg = ctx.cfg
    resolved = cfg.model_dump(mode="json")
    build.seed_everything(cfg.training.seed)
    sinks.require(cfg.output.tensorboard, cfg.output.wandb, cfg.output.mlflow)
    beat.phase("preparing the data and the model")  # a task may name its own parts (heartbeat.phase)
    parts = task.prepare(ctx)
    if on_ready is not None:
        on_ready(parts.model)
    beat.phase("setting up the run")
    r = _setup(task, ctx, parts)
    r.beat, r.estimate = beat, Estimate(r.total_steps, cfg.training.eval_every, done=r.start_step)
    beat.estimate = r.estimate
    _begin(r, resolved)
    # The feed's collate thread and the metric sinks (TensorBoard, W&B, MLflow runs) end with the run, however it ends.
    with ProgressBar(r.total_steps, r.start_step, ctx.quiet, silent=not ctx.dist.main) as bar, \
            InterruptFlag() as stop, contextlib.closing(r.feed), contextlib.closing(r.metrics), \
            contextlib.closing(r.collector):
        bar.estimate, bar.printed, beat.log = r.estimate, beat.said, bar.log
        for msg in ctx.notes:
            bar.log(f"[dim]{msg}[/]")
        if r.restored is not None:
            for why in r.restored.skipped:
                bar.log(f"[yellow]warning: skipped damaged checkpoint {why}[/]")
            bar.log(f"resumed from {r.restored.path.name} (step {r.start_step} of {r.total_steps})")
        bar.log(f"{parts.intro}; {sum(p.numel() for p in r.params):,} trainable parameters; {ctx.precision} on "
                f"{ctx.device}")
        task.start(sinks.redo_from(r.start_step, r.total_steps), r.metrics, bar.log)
        if r.restored is None:
            r.result.eval_loss_before = _evaluate(r, bar)
            r.metrics.write({"step": 0, "eval_loss": r.result.eval_loss_before})
            task.after_eval(0, r.metrics, bar.log)
        if _steps(r, bar, stop):
            _finish(r, bar)
    return r.result


def _check_run_dir(task: Task, ctx: RunContext) -> TrainResult | None:
    """Refuse a run directory that holds another run; a finished run given --resume: its summary, as the result."""
    opts = ctx.options
    if opts.resume:
        ctx.notes += resume.keep_earlier_defaults(ctx.run_dir, ctx.cfg)
    resolved = ctx.cfg.model_dump(mode="json")
    rundir.check_output_dir(ctx.run_dir, resolved, opts.overwrite, opts.resume)
    if opts.resume:
        resume.check_config(ctx.run_dir, resolved, opts.resume_force)
    if opts.resume and summary.already_complete(ctx.run_dir, opts.resume_force):
        fig = summary.report_complete(ctx.run_dir, task.outputs(ctx.run_dir))
        return TrainResult(ctx.run_dir, fig.steps, eval_loss_before=fig.eval_before, eval_loss_after=fig.eval_after)
    return None


def _setup(task: Task, ctx: RunContext, parts: Prepared) -> Run:
    t, rel = ctx.cfg.training, ctx.cfg.reliability
    params = trainable_parameters(parts.model)
    feed = task.new_feed()
    total = t.max_steps or math.ceil(t.epochs * feed.steps_per_epoch)
    optimizer = build.optimizer(params, t.optimizer, t.lr, t.weight_decay, ctx.device)
    scheduler = build.scheduler(optimizer, t.scheduler, t.warmup_steps, total)
    runner = StepRunner(parts.loss, ctx.device, build.autocast(ctx.device, ctx.precision),
                        torch.amp.GradScaler(ctx.device, enabled=ctx.precision == "fp16"), ctx.faults, ctx.dist.world,
                        parts.after_backward, parts.idle, optimizer, scheduler, params, t.max_grad_norm,
                        NumericGuard(rel.nan_patience, rel.zero_patience), ctx.dist)
    result = TrainResult(run_dir=ctx.run_dir, steps=total, model=parts.model, tokenizer=parts.tokenizer)
    r = Run(ctx, task, parts, params, runner, optimizer, scheduler, runner.guard, feed, total, 0, ctx.options.pieces,
            None, result, compiled=parts.compiled)
    r.tripwire = Tripwire(parts.model, runner.loss_of, ctx.device, runner.autocast, ctx.precision, t.optimizer,
                          lambda: r.feed, rel.check_path_every,
                          lambda: r.compiled)

    def check(found) -> None:  # before the checkpoint is applied: a refused resume changes nothing
        task.check_resume(found, ctx.options.resume_force)
        resume.check_data(found, parts.fingerprint, ctx.options.resume_force)

    if ctx.options.resume:
        r.restored = distributed.main_first(ctx.dist, lambda: checkpoint.restore(ctx.run_dir / "checkpoints",
                                                                                 r.state, check),
                                            "restoring the checkpoint")
    if r.restored is not None:
        task.resumed(r.restored)
        r.start_step, r.pieces = r.restored.step, max(r.pieces, r.restored.extra.get("pieces", 1))
        feed.close()
        r.feed = task.new_feed(**r.restored.position)
        r.guard.skipped_total = r.restored.extra.get("skipped_steps", 0)
        result.eval_loss_before = r.restored.extra.get("eval_loss_before")
    return r


def _begin(r: Run, resolved: dict) -> None:
    """Rank 0 starts (or continues) the run directory; metrics and run_info.json are opened."""
    ctx, run_dir = r.ctx, r.ctx.run_dir
    if ctx.dist.main and r.restored is None:
        rundir.start(run_dir, resolved, wipe=ctx.options.overwrite and not ctx.options.resume)
        if ctx.run_lock is not None:
            ctx.run_lock.take()  # a new run directory is locked once it exists (runlock.py)
        resume.truncate_metrics(run_dir / "metrics.jsonl", 0)  # a resume with no checkpoint starts over
    elif ctx.dist.main:
        rundir.write_config(run_dir, resolved)  # a forced resume (e.g. the fp32 fallback) records what now runs
        restored = cast(checkpoint.Restored, r.restored)  # not None: this branch is the resumed one
        ctx.notes += resume.truncate_metrics(run_dir / "metrics.jsonl", restored.extra["metrics_lines"])
    distributed.barrier(ctx.dist, "the start of the run")
    # Metrics, samples, eval, reports and the adapter come from rank 0; the other ranks train and stay quiet.
    main, out = ctx.dist.main, ctx.cfg.output
    r.metrics = sinks.open_log(MetricsLog(run_dir / "metrics.jsonl") if main else NullLog(), run_dir,
                               sinks.redo_from(r.start_step, r.total_steps), out.tensorboard and main,
                               out.wandb and main, out.mlflow and main)
    if main:
        sinks.write_info(run_dir, ctx.device, ctx.precision, r.parts.predicted_peak, ctx.notes, r.parts.data_info)


def _steps(r: Run, bar, stop: InterruptFlag) -> bool:
    """One optimizer step per iteration; False when interrupted (a checkpoint was written)."""
    ctx, task, parts, t, rel = r.ctx, r.task, r.parts, r.ctx.cfg.training, r.ctx.cfg.reliability
    dist, faults, run_peak = ctx.dist, ctx.faults, 0
    parts.model.train()
    first_step = r.start_step + 1
    r.tripwire.first = first_step
    for step in range(first_step, r.total_steps + 1):
        t0, compiling = time.perf_counter(), r.compiled and step == first_step
        r.beat.phase(f"step {step}/{r.total_steps}{' (compiling the decoder)' if compiling else ''}", counted=True)
        if ctx.device == "cuda":
            torch.cuda.reset_peak_memory_stats()  # the logged peak is this step's, not the eval pass's
        faults.slow_step()
        # Fetch the whole step first: the loss is normalised by the loss-bearing units of all its micro-batches.
        fed = r.feed.next()
        check = rel.transfer_check_every and (step <= 3 or step % rel.transfer_check_every == 0)
        if compiling:
            bar.log(f"step {step}: compiling the decoder (this step is left out of tokens/s)")
        try:
            with distributed.collective(dist, f"step {step}'s gradient all-reduce"):
                step_loss, r.pieces = run_with_oom_recovery(
                    lambda n: forward_backward(r.runner, fed.forwards, fed.loss_tokens, n, step, bool(check),  # noqa: B023 -- called before the next iteration
                                               r.feed.split),
                    r.optimizer, r.pieces, max(r.feed.max_pieces(b) for b in fed.forwards), bar.log,
                    # Dynamo may recompile at any step (new shapes); a rank of several cannot re-run alone
                    on_compile_error=(lambda exc: _compile_failed(r, exc, bar)) if r.compiled and not dist.enabled
                    else None,
                    alone=not dist.enabled)
        except OutOfMemoryAtMinimum as exc:
            raise OutOfMemoryAtMinimum(task.oom_message(step, exc)) from None
        asked = stop.requested or (dist.main and (ctx.run_dir / STOP_FILE).exists())  # the supervisor's Ctrl-C
        r.tripwire.check_path(step, fed.forwards[0], bar.log)
        lr_used = cast(float, r.scheduler.get_last_lr()[0])
        update = finish_step(r.runner, step_loss, fed.loss_tokens, asked, step, getattr(fed, "zero_expected", ()))
        r.tripwire.check_update(step, update.applied, lr_used, update.grad_norm)
        stop.requested = update.stop
        if not update.applied:
            bar.log(f"[yellow]step {step}: non-finite loss or gradient, update skipped[/]")
        if ctx.on_step_done is not None:
            ctx.on_step_done(step)
        faults.after_update(step)

        elapsed = time.perf_counter() - t0
        r.result.losses.append(update.loss)
        lr = r.scheduler.get_last_lr()[0]
        mem = torch.cuda.max_memory_allocated() if ctx.device == "cuda" else None
        run_peak = max(run_peak, mem or 0)
        record = task.record(fed)
        timed = r.estimate.left_s() is not None
        r.estimate.stepped(step, elapsed, compiling)
        bar.update(step, update.loss, lr, record["tokens"] / elapsed, mem, task.progress(record))
        if not timed and r.estimate.left_s() is not None and step < r.total_steps:
            bar.log(r.estimate.first_line())
        if step == first_step:
            bar.log(_memory_line(r, mem))
        if step % t.log_every == 0 or step == r.total_steps:
            r.metrics.write({"step": step, "loss": update.loss, "lr": lr, "grad_norm": update.grad_norm, **record,
                             "forwards": len(fed.forwards), "pieces": r.pieces,
                             "useful_tokens_per_s": record["tokens"] / elapsed, "step_s": elapsed,
                             "device_wait_s": update.wait_s, "compiling": compiling, "epoch": r.feed.epoch,
                             "peak_mem_bytes": mem, **memory.held(ctx.device),
                             **({"compile_fallback": r.fallback} if r.fallback else {})})
            r.fallback = None
        if t.eval_every and step % t.eval_every == 0 and step < r.total_steps:
            ev = _evaluate(r, bar)
            if ev is not None:
                r.metrics.write({"step": step, "eval_loss": ev})
                bar.log(f"step {step}: eval loss {ev:.4f}")
            task.after_eval(step, r.metrics, bar.log)  # a task without an eval loss (GRPO's held-out reward) too
        if step == first_step:
            r.collector.settle()  # model, optimizer and compiled graphs in place: out of later collections' scans
        due = (rel.save_every and step % rel.save_every == 0) or step == r.total_steps or stop.requested
        if due:
            r.beat.phase(f"saving the checkpoint of step {step}")
        saved = due and r.guard.nonfinite_in_row == 0 and checkpoint.save_or_warn(
            lambda at: _save_checkpoint(r, at), step, bar.log)
        if stop.requested:  # a rollback point must precede a non-finite streak, so none is written inside one
            where = f"checkpoint at step {step}" if saved else "the last good checkpoint is kept"
            bar.log(f"interrupted: {where}; continue with --resume")
            r.result.interrupted = True
            distributed.barrier(dist, "the interrupt checkpoint")  # no rank exits while rank 0 still writes
            return False
    r.result.peak_mem_bytes = run_peak
    return True


def _compile_failed(r: Run, exc: BaseException, bar) -> None:
    r.compiled, r.fallback = False, first_line(exc)
    r.task.uncompile()
    bar.log(f"[yellow]torch.compile failed ({first_line(exc)}); continuing without it (set training.compile=false "
            "to skip the attempt)[/]")


def _evaluate(r: Run, bar) -> float | None:
    """The task's eval pass. The first forward of a compiled decoder is often the eval before step 1, so a compile
    failure there falls back to eager as one in a step does (one process: a rank of several cannot alone)."""
    done, t0 = r.estimate.done, time.perf_counter()
    r.beat.phase("the eval before step 1" if done == r.start_step == 0 else
                 "the final eval" if done == r.total_steps else f"the eval at step {done}")
    try:
        loss = r.task.evaluate()
    except Exception as exc:  # noqa: BLE001 -- only the compiler's own failures are handled; the rest re-raised
        if not (r.compiled and not r.ctx.dist.enabled and is_compile_error(exc)):
            raise
        _compile_failed(r, exc, bar)
        loss = r.task.evaluate()
    r.estimate.evaluated(time.perf_counter() - t0)
    return loss


def _memory_line(r: Run, device_peak: int | None) -> str:
    """The first step's peak beside the machine's memory, with what lowers it when it takes most of it."""
    cfg, gpu = r.ctx.cfg, device_peak is not None
    # read by name: the engine knows no task, and not every task's sections have every key
    return memory_note(MemoryFacts(
        peak=device_peak if device_peak is not None else summary.peak_rss(),
        machine=r.ctx.vram_bytes() if gpu else machine_memory(), gpu=gpu, model=cfg.model.name_or_path,
        checkpointing=bool(getattr(cfg.model, "gradient_checkpointing", True)),
        micro_batch=cfg.training.micro_batch_size, max_length=getattr(cfg.data, "max_length", None),
        precision=r.ctx.precision))


def _save_checkpoint(r: Run, step: int) -> None:
    ctx, rel = r.ctx, r.ctx.cfg.reliability
    extra = r.task.checkpoint_extra()  # every rank takes part (e.g. gathering RNG states); rank 0 writes
    if not ctx.dist.main:
        return
    r.metrics.sync()  # the lines the checkpoint counts are on the disk before it is
    extra.update({"pieces": r.pieces, "eval_loss_before": r.result.eval_loss_before,
                  "data_fingerprint": r.parts.fingerprint, "metrics_lines": r.metrics.lines(),
                  "skipped_steps": r.guard.skipped_total})
    need = sum(p.numel() * 4 * 3 for p in r.params) + rel.min_free_disk_mb * 2**20
    checkpoint.save(ctx.run_dir / "checkpoints", step, r.state, r.feed.position(), extra, rel.keep_checkpoints, need,
                    before_commit=lambda: ctx.faults.checkpoint_write(step), skips=r.space_skips)


def _finish(r: Run, bar) -> None:
    """The final eval and, on rank 0, the final writes (free space checked first; a full disk stops the run with
    finish.DiskFullError, exit 5). The adapter comes last: adapter/ is what marks a run complete."""
    ctx, task, run_dir, total = r.ctx, r.task, r.ctx.run_dir, r.total_steps
    r.result.eval_loss_after = _evaluate(r, bar)
    if ctx.dist.main:
        r.beat.phase("writing the final metrics, files and the adapter")
        need = finish.adapter_bytes(r.params)
        kill_point("finish.evaluated")
        with finish.guarded(run_dir, "the final metrics" + task.samples_what, need):
            rss = {} if ctx.device == "cuda" else {"peak_rss_bytes": summary.peak_rss()}  # the report's memory
            r.metrics.write({"step": total, "eval_loss": r.result.eval_loss_after, **rss})
            task.after_eval(total, r.metrics, bar.log)
        kill_point("finish.logged")
        for what, write in task.final_files(run_dir):
            with finish.guarded(run_dir, what, need):
                write()
        with finish.guarded(run_dir, f"the adapter to {run_dir / 'adapter'}", need, ctx.faults.final_write):
            save_adapter(r.parts.model, run_dir / "adapter", run_dir / rundir.CONFIG_NAME)
        if r.space_skips.summary():
            bar.log(f"[yellow]{r.space_skips.summary()}[/]")
        summary.log_summary(run_dir, bar.log, time.perf_counter() - bar.t0, r.result.peak_mem_bytes,
                            r.parts.predicted_peak, outputs=task.outputs(run_dir), prompt=ctx.options.next_prompt)
    elif r.parts.lockstep:
        task.after_eval(total, r.metrics, bar.log)  # in step with rank 0's generations
    distributed.barrier(ctx.dist, "the end of the run")  # no rank leaves before the adapter is written
