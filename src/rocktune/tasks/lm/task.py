"""The LM task: LoRA on a causal LM over tokenised chat/instruction/text data.

Its setup in the order the engine calls it: ``check`` (data files, kernel gates, model directory, --auto, the
quantisation gate), then ``prepare`` (tokenizer, process group, data and token cache, feeding, the model with its
adapter and the loss module). The engine (train/loop.py) runs the steps.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, cast

from rocktune.kernels.attention import VARLEN
from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.data import checks
from rocktune.data.batching import loss_token_counts
from rocktune.data.flat import max_segment
from rocktune.data.dataset import Examples, prepare_data
from rocktune.models.load import trainable_parameters
from rocktune.readers.template import use_template
from rocktune.tasks.causal import autofit, build, preflight
from rocktune.tasks.lm.evaluate import eval_sums
from rocktune.tasks.causal.feed import Feeding, Share, StepFeed, resolve_mode
from rocktune.tasks.causal.loss import LossModule
from rocktune.tasks.causal.moe_metrics import RouterWatch
from rocktune.tasks.causal.quant_gate import check_quantization
from rocktune.tasks.causal.recurrent import unpacked
from rocktune.tasks.causal.samples import SampleSettings, Sampler
from rocktune.tasks.base import TaskBase
from rocktune.train import build as engine_build
from rocktune.train import distributed, resume
from rocktune.train.context import RunContext
from rocktune.train.heartbeat import phase
from rocktune.train.prelaunch import refuse_layout
from rocktune.train.request import RunOptions
from rocktune.train.task import Prepared


@dataclass(frozen=True)
class LMRun:
    """What ``prepare`` built and the later hooks use: set once, never changed (the loss module's ``compiled``
    flag is the module's own, turned off by the compile fallback)."""

    ctx: RunContext
    tokenizer: Any  # a transformers tokenizer
    eval_set: Examples  # the sampler's prompts
    shape: str  # the data's record shape (the sampler renders prompts like it)
    strategy: str  # single | ddp | fsdp
    feeding: Feeding
    model: Any  # the PEFT model
    loss: LossModule  # outside any DDP wrapper: the eval pass and the compile fallback use it
    idle: dict  # a batch without loss positions, for ranks that must keep in step
    collate: Callable[..., dict]  # index structure -> host batch
    lengths: list  # tokens per training example
    loss_counts: list  # loss-bearing tokens per training example
    eval_share: Examples  # this rank's eval examples
    eval_rows: int  # eval examples per forward
    autocast: Callable[[], Any]  # () -> the precision's autocast context


class LMTask(TaskBase):
    kind = "lm"
    samples_what = " and sample generations"

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.vocab_size: int | None = None  # check's findings, which prepare uses
        self.predicted_peak: int | None = None
        self.routers: RouterWatch | None = None  # set by start on an MoE model
        self.router_state: dict | None = None  # a resumed checkpoint's idle streaks, applied by start
        # prepare's result for the later hooks: the engine calls prepare before any of them (train/task.py)
        self.run: LMRun = cast(LMRun, None)

    def refuse(self, options: RunOptions) -> None:
        """What the config and the number of processes alone rule out (pydantic validated the rest)."""
        refuse_inapplicable(self.cfg)
        refuse_layout(options.processes, self.cfg.training.parallel, self.cfg.model.quantization)

    def check(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        train_file = cast(str, cfg.data.train_file)  # RunConfig's validator requires it
        self.vocab_size = preflight.check_run(cfg.model.name_or_path, train_file, cfg.data.eval_file, ctx.device,
                                              cfg.model.liger, ctx.attn)
        if ctx.options.auto_fit:
            ctx.cfg, fit_notes, self.predicted_peak = autofit.apply_fit(cfg, ctx.precision, ctx.attn,
                                                                        ctx.options.vram_bytes)
            ctx.notes += fit_notes
        ctx.cfg, packing_notes = unpacked(ctx.cfg, ctx.device)  # recurrent layers: no packed rows
        ctx.notes += packing_notes
        m, d = ctx.cfg.model, ctx.cfg.data
        ctx.notes += check_quantization(m.quantization, m.name_or_path, ctx.precision, ctx.device, d.max_length,
                                        ctx.cfg.lora.r, ctx.platform)
        self.cfg = ctx.cfg

    def prepare(self, ctx: RunContext) -> Prepared:
        cfg, dist, device = ctx.cfg, ctx.dist, ctx.device
        t, m, d, rel = cfg.training, cfg.model, cfg.data, cfg.reliability
        tokenizer = use_template(preflight.load_tokenizer(m.name_or_path, m.trust_remote_code), d.chat_template)

        def data_checks(examples, stats):
            return checks.enforce(checks.check_training_data(examples, tokenizer, stats.shape, d.train_on_prompt,
                                                             stats.probes), d.train_file)

        # Several ranks: the group is proven sound before anything is written, and rank 0 writes the token cache
        # that the others then read. prepare_data writes its cache only after every file and data_checks passed.
        distributed.init(dist, device, rel.collective_timeout_s, rel.preflight_timeout_s)
        ctx.notes += distributed.preflight(dist, device, rel.preflight_timeout_s)
        phase("reading and tokenising the data (or its cache)")  # the heartbeat names it while it lasts
        train_set, eval_set, stats = distributed.main_first(dist, lambda: prepare_data(
            d, tokenizer, ctx.cache_root, t.seed, self.vocab_size, check=data_checks), "preparing the data")
        distributed.same_run(dist, stats.fingerprint)
        lengths = train_set.lengths()
        compiled = build.want_compile(t.compile, ctx.choices.compile, device, t.batching, dist.world)
        refused = build.compile_refusal() if compiled else None
        if refused:  # known to fail with this torch's libraries: eager from the start, not a fallback mid-run
            compiled = False
            ctx.notes.append(f"torch.compile off: {refused}")
        parallel, notes = autofit.choose_parallel(cfg, dist.world, device, ctx.precision, ctx.attn,
                                                  ctx.options.vram_bytes)
        strategy = distributed.strategy(dist, parallel, m.quantization)
        # The attention is chosen before the forwards are sized: the planner sizes varlen by what it saves.
        packed = resolve_mode(t.batching, device) == "tokens" or d.packing
        attn, attn_note = build.attention(m.attn_implementation, ctx, packed, compiled, m)
        feeding, feed_notes, planned_peak = autofit.plan_feeding(cfg, ctx.choices, lengths, ctx.options.vram_bytes,
                                                                 compiled, dist.world, parallel, attn)
        chunk = autofit.loss_chunk(t.loss_chunk_size, device)
        # FSDP loads on the CPU and moves each rank's shards to its GPU: the whole base need not fit one device.
        model, model_notes = build.model_with_adapter(m, cfg.lora, ctx.precision, attn,
                                                      "cpu" if strategy == "fsdp" else device, compiled)
        ctx.notes += notes + feed_notes + [n for n in (attn_note,) if n] + model_notes + stats.notes
        fsdp = strategy == "fsdp"
        # The loss's chunk body compiles with the decoder, and falls back with it (uncompile).
        loss_module = LossModule(model, chunk, t.loss_impl == "chunked", compiled,
                                 max_segment(d.max_length) if feeding.flat_width else None)
        loss = distributed.wrap(loss_module, dist, device, strategy, ctx.notes)
        params = trainable_parameters(model)
        idle = build.idle_batch(tokenizer.pad_token_id)  # a forward with no loss, for ranks that must keep in step
        # flash-attention only separates packed sequences within a single row, so its rows are joined into one.
        collate = build.make_collate(train_set, feeding.packed, tokenizer.pad_token_id,
                                     one_row=attn == "flash_attention_2",
                                     pin=ctx.choices.pin_memory and device == "cuda",
                                     width=d.max_length if feeding.static_width else 0, segments=attn == VARLEN,
                                     flat=(feeding.flat_width, feeding.cu_slots) if feeding.flat_width else None)
        # DDP: each rank evaluates its share and the sums are added; FSDP: every rank runs every eval forward.
        eval_share = eval_set if fsdp or not dist.enabled else \
            eval_set.subset(list(range(dist.rank, len(eval_set), dist.world)))
        self.run = LMRun(ctx, tokenizer, eval_set, stats.shape, strategy, feeding, model, loss_module, idle, collate,
                         lengths, loss_token_counts(train_set.labels), eval_share,
                         max(t.micro_batch_size, feeding.rows_per_forward),  # no gradients: a forward fits easily
                         engine_build.autocast(device, ctx.precision))
        return Prepared(model, loss, stats.fingerprint,
                        f"{len(train_set)} train / {len(eval_set)} eval examples ({stats.shape}, cache "
                        f"{'hit' if stats.cache_hit else 'written'})",
                        _data_info(stats, lengths, len(eval_set)), planned_peak or self.predicted_peak, compiled,
                        lockstep=fsdp, idle=idle if fsdp else None, tokenizer=tokenizer,
                        after_backward=lambda: distributed.sync_gradients(dist, params, strategy))

    def new_feed(self, **position) -> StepFeed:
        # On a GPU the next step is collated while this one computes; on a CPU a thread would only compete for cores.
        r = self.run
        dist = r.ctx.dist
        return StepFeed(r.feeding, r.lengths, r.loss_counts, r.collate, r.ctx.device == "cuda",
                        Share(dist.rank, dist.world, r.idle, r.strategy == "fsdp"), **position)

    def evaluate(self) -> float | None:
        r = self.run
        return distributed.mean_over_ranks(r.ctx.dist, *eval_sums(
            r.loss, r.eval_share, r.eval_rows, r.tokenizer.pad_token_id, r.ctx.device, r.autocast))

    def check_resume(self, restored, force: bool) -> None:
        """Runs on the checkpoint read but not applied (checkpoint.restore): a refusal leaves the model as it was."""
        r = self.run
        resume.check_world(restored, r.ctx.dist.world, force)
        resume.check_batching(restored, r.feeding.mode)
        note = distributed.check_rng(r.ctx.dist, restored.extra.get("rank_rng"), force)
        if note:
            r.ctx.notes.append(note)

    def resumed(self, restored) -> None:
        distributed.restore_rng(self.run.ctx.dist, restored.extra.get("rank_rng"))
        self.router_state = restored.extra.get("router_watch")

    def checkpoint_extra(self) -> dict:
        r = self.run
        rank_rng = distributed.gather_rng(r.ctx.dist)  # every rank takes part; rank 0 writes the checkpoint
        routers = {"router_watch": self.routers.state()} if self.routers is not None else {}
        return {"batching": r.feeding.mode, "world_size": r.ctx.dist.world, "rank_rng": rank_rng, **routers}

    def start(self, redo_from: int, metrics, log) -> None:
        r = self.run
        t, dist = r.ctx.cfg.training, r.ctx.dist
        samples = dist.main or r.strategy == "fsdp"
        settings = SampleSettings(t.sample_count if samples else 0, t.sample_prompts if samples else [],
                                  t.sample_max_new_tokens, r.ctx.device, r.autocast)
        self.sampler = Sampler.build(r.ctx.run_dir, r.tokenizer, r.shape, r.eval_set, settings,
                                     redo_from, write=dist.main, synced=r.strategy == "fsdp")
        self.routers = RouterWatch.attach(r.model, log)  # MoE: expert load and router aux loss; None when dense
        if self.routers is not None:
            self.routers.keep_apart(r.loss)
            if self.router_state:
                self.routers.load_state(self.router_state)

    def record(self, fed) -> dict:
        return {"tokens": fed.loss_tokens, "batch_tokens": sum(b["input_ids"].numel() for b in fed.forwards),
                "real_tokens": fed.real_tokens, "samples": _digest(fed.forwards),
                **(self.routers.step_metrics() if self.routers else {})}

    def after_eval(self, step: int, metrics, log) -> None:
        self.sampler.at(step, self.run.model, metrics, log)

    def oom_message(self, step: int, exc: BaseException) -> str:
        ctx = self.run.ctx
        advice = autofit.oom_advice(ctx.cfg, ctx.precision, ctx.attn)
        return f"out of memory at step {step} even with one example per forward ({exc}). {advice}"

    def uncompile(self) -> None:
        build.uncompile_decoder(self.run.model)
        self.run.loss.compiled = False  # the loss module itself: its flag is what the compile fallback turns off


def _data_info(stats, train_lengths: list[int], n_eval: int) -> dict:
    """run_info.json's data section: the data statistics and the sizes a report shows."""
    from dataclasses import asdict

    data = {**asdict(stats), "n_train": len(train_lengths), "n_eval": n_eval,
            "train_tokens": sum(train_lengths), "max_example_tokens": max(train_lengths, default=0)}
    data.pop("notes", None)
    data.pop("probes", None)
    return data


def _digest(micro: list[dict]) -> str:
    """Short hash of the step's token ids: two runs that log the same digests saw the same samples."""
    h = hashlib.blake2b(digest_size=6)
    for batch in micro:
        h.update(batch["input_ids"].numpy().tobytes())
    return h.hexdigest()
