"""The LM task: LoRA on a causal LM over tokenised chat/instruction/text data.

Its setup in the order the engine calls it: ``check`` (data files, kernel gates, model directory, --auto, the
quantisation gate), then ``prepare`` (tokenizer, process group, data and token cache, feeding, the model with its
adapter and the loss module). The engine (train/loop.py) runs the steps.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from rocktune.attention import VARLEN
from rocktune.config import RunConfig
from rocktune.data import checks
from rocktune.data.batching import loss_token_counts
from rocktune.data.dataset import prepare_data
from rocktune.model import trainable_parameters
from rocktune.tasks.lm import autofit, build, preflight
from rocktune.tasks.lm.evaluate import eval_sums
from rocktune.tasks.lm.feed import Share, StepFeed, resolve_mode
from rocktune.tasks.lm.loss import LossModule
from rocktune.tasks.lm.quant_gate import check_quantization
from rocktune.tasks.lm.samples import SampleSettings, Sampler
from rocktune.train import build as engine_build
from rocktune.train import distributed, resume
from rocktune.train.context import RunContext
from rocktune.train.prelaunch import refuse_layout
from rocktune.train.request import RunOptions
from rocktune.train.task import Prepared


class LMTask:
    kind = "lm"
    samples_what = " and sample generations"

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.vocab_size: int | None = None
        self.predicted_peak: int | None = None

    def attn_setting(self) -> str:
        return self.cfg.model.attn_implementation

    def refuse(self, options: RunOptions) -> None:
        """What the config and the number of processes alone rule out (pydantic validated the rest)."""
        refuse_layout(options.processes, self.cfg.training.parallel, self.cfg.model.quantization)

    def check(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        self.vocab_size = preflight.check_run(cfg.model.name_or_path, cfg.data.train_file, cfg.data.eval_file,
                                              ctx.device, cfg.model.liger, ctx.attn)
        if ctx.options.auto_fit:
            ctx.cfg, fit_notes, self.predicted_peak = autofit.apply_fit(cfg, ctx.precision, ctx.attn,
                                                                        ctx.options.vram_bytes)
            ctx.notes += fit_notes
        m, d = ctx.cfg.model, ctx.cfg.data
        ctx.notes += check_quantization(m.quantization, m.name_or_path, ctx.precision, ctx.device, d.max_length,
                                        ctx.cfg.lora.r, ctx.platform)
        self.ctx, self.cfg = ctx, ctx.cfg

    def prepare(self, ctx: RunContext) -> Prepared:
        cfg, dist, device = ctx.cfg, ctx.dist, ctx.device
        t, m, d, rel = cfg.training, cfg.model, cfg.data, cfg.reliability
        tokenizer = preflight.load_tokenizer(m.name_or_path, m.trust_remote_code)
        self.tokenizer = tokenizer

        def data_checks(examples, stats):
            return checks.enforce(checks.check_training_data(examples, tokenizer, stats.shape, d.train_on_prompt,
                                                             stats.probes), d.train_file)

        # Several ranks: the group is proven sound before anything is written, and rank 0 writes the token cache
        # that the others then read. prepare_data writes its cache only after every file and data_checks passed.
        distributed.init(dist, device, rel.collective_timeout_s, rel.preflight_timeout_s)
        ctx.notes += distributed.preflight(dist, device, rel.preflight_timeout_s)
        train_set, eval_set, stats = distributed.main_first(dist, lambda: prepare_data(
            d, tokenizer, ctx.cache_root, t.seed, self.vocab_size, check=data_checks), "preparing the data")
        distributed.same_run(dist, stats.fingerprint)
        self.train_set, self.eval_set, self.stats = train_set, eval_set, stats
        lengths = train_set.lengths()
        compiled = build.want_compile(t.compile, ctx.choices.compile, device, t.batching, dist.world)
        parallel, notes = autofit.choose_parallel(cfg, dist.world, device, ctx.precision, ctx.attn,
                                                  ctx.options.vram_bytes)
        self.strategy = distributed.strategy(dist, parallel, m.quantization)
        # The attention is chosen before the forwards are sized: the planner sizes varlen by what it saves.
        packed = resolve_mode(t.batching, device) == "tokens" or d.packing
        attn, attn_note = build.attention(m.attn_implementation, ctx, packed, compiled, m)
        self.attn = attn
        feeding, feed_notes, planned_peak = autofit.plan_feeding(cfg, ctx.choices, lengths, ctx.options.vram_bytes,
                                                                 compiled, dist.world, parallel, attn)
        self.feeding = feeding
        chunk = autofit.loss_chunk(t.loss_chunk_size, device)
        # FSDP loads on the CPU and moves each rank's shards to its GPU: the whole base need not fit one device.
        model, model_notes = build.model_with_adapter(m, cfg.lora, ctx.precision, attn,
                                                      "cpu" if self.strategy == "fsdp" else device, compiled)
        ctx.notes += notes + feed_notes + [n for n in (attn_note,) if n] + model_notes + stats.notes
        self.model = model
        fsdp = self.strategy == "fsdp"
        # The loss's chunk body compiles with the decoder, and falls back with it (uncompile).
        self._loss = LossModule(model, chunk, t.loss_impl == "chunked", compiled)
        loss = distributed.wrap(self._loss, dist, device, self.strategy, ctx.notes)
        params = trainable_parameters(model)
        idle = build.idle_batch(tokenizer.pad_token_id)  # a forward with no loss, for ranks that must keep in step
        self._idle = idle
        # flash-attention only separates packed sequences within a single row, so its rows are joined into one.
        self._collate = build.make_collate(train_set, feeding.packed, tokenizer.pad_token_id,
                                           one_row=attn == "flash_attention_2",
                                           pin=ctx.choices.pin_memory and device == "cuda",
                                           width=d.max_length if feeding.static_width else 0,
                                           segments=attn == VARLEN)
        self._lengths, self._loss_counts = lengths, loss_token_counts(train_set.labels)  # once: resume rebuilds
        # DDP: each rank evaluates its share and the sums are added; FSDP: every rank runs every eval forward.
        self._eval_share = eval_set if fsdp or not dist.enabled else \
            eval_set.subset(list(range(dist.rank, len(eval_set), dist.world)))
        self._eval_rows = max(t.micro_batch_size, feeding.rows_per_forward)  # no gradients: a forward fits easily
        self._autocast = engine_build.autocast(device, ctx.precision)
        return Prepared(model, loss, stats.fingerprint,
                        f"{len(train_set)} train / {len(eval_set)} eval examples ({stats.shape}, cache "
                        f"{'hit' if stats.cache_hit else 'written'})",
                        _data_info(stats, lengths, len(eval_set)), planned_peak or self.predicted_peak, compiled,
                        lockstep=fsdp, idle=idle if fsdp else None, tokenizer=tokenizer,
                        after_backward=lambda: distributed.sync_gradients(dist, params, self.strategy))

    def new_feed(self, **position) -> StepFeed:
        # On a GPU the next step is collated while this one computes; on a CPU a thread would only compete for cores.
        dist = self.ctx.dist
        return StepFeed(self.feeding, self._lengths, self._loss_counts, self._collate, self.ctx.device == "cuda",
                        Share(dist.rank, dist.world, self._idle, self.strategy == "fsdp"), **position)

    def evaluate(self) -> float | None:
        return distributed.mean_over_ranks(self.ctx.dist, *eval_sums(
            self._loss, self._eval_share, self._eval_rows, self.tokenizer.pad_token_id, self.ctx.device,
            self._autocast))

    def check_resume(self, restored, force: bool) -> None:
        """Runs on the checkpoint read but not applied (checkpoint.restore): a refusal leaves the model as it was."""
        resume.check_world(restored, self.ctx.dist.world, force)
        resume.check_batching(restored, self.feeding.mode)
        note = distributed.check_rng(self.ctx.dist, restored.extra.get("rank_rng"), force)
        if note:
            self.ctx.notes.append(note)

    def resumed(self, restored) -> None:
        distributed.restore_rng(self.ctx.dist, restored.extra.get("rank_rng"))

    def checkpoint_extra(self) -> dict:
        rank_rng = distributed.gather_rng(self.ctx.dist)  # every rank takes part; rank 0 writes the checkpoint
        return {"batching": self.feeding.mode, "world_size": self.ctx.dist.world, "rank_rng": rank_rng}

    def start(self, start_step: int, metrics, log) -> None:
        t, dist = self.cfg.training, self.ctx.dist
        samples = dist.main or self.strategy == "fsdp"
        settings = SampleSettings(t.sample_count if samples else 0, t.sample_prompts if samples else [],
                                  t.sample_max_new_tokens, self.ctx.device, self._autocast)
        self.sampler = Sampler.build(self.ctx.run_dir, self.tokenizer, self.stats.shape, self.eval_set, settings,
                                     start_step, write=dist.main, synced=self.strategy == "fsdp")

    def record(self, fed) -> dict:
        return {"tokens": fed.loss_tokens, "batch_tokens": sum(b["input_ids"].numel() for b in fed.forwards),
                "real_tokens": fed.real_tokens, "samples": _digest(fed.forwards)}

    def after_eval(self, step: int, metrics, log) -> None:
        self.sampler.at(step, self.model, metrics, log)

    def final_files(self, run_dir: Path) -> list:
        return []

    def outputs(self, run_dir: Path) -> list[str] | None:
        return None

    def oom_message(self, step: int, exc: BaseException) -> str:
        advice = autofit.oom_advice(self.cfg, self.ctx.precision, self.ctx.attn)
        return f"out of memory at step {step} even with one example per forward ({exc}). {advice}"

    def uncompile(self) -> None:
        build.uncompile_decoder(self.model)
        self._loss.compiled = False


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
