"""The preference task (task: dpo / orpo): a causal LM's LoRA trained on chosen/rejected pairs.

It reuses the LM task's model building (tokenizer, kernels, QLoRA, LoRA, attention) and the engine's everything
else (steps, OOM split, guards, checkpoints, resume, several ranks); what is its own is the data (pairs.py,
screened by signal.py), the feed (one pair per row, feed.py) and the loss (loss.py). The reference DPO compares
with is the same model with the adapter switched off.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from rocktune.kernels.attention import VARLEN
from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.readers.template import use_template
from rocktune.data.rows import read_rows
from rocktune.tasks.preference import pairs as prefdata
from rocktune.data.dataset import Pending
from rocktune.data.truncate import cut_note
from rocktune.errors import UserError
from rocktune.models.load import trainable_parameters
from rocktune.tasks.causal import build, preflight
from rocktune.tasks.causal.quant_gate import check_quantization
from rocktune.tasks.preference.feed import PairFeed, collate_pairs, idle_pairs
from rocktune.tasks.preference.loss import Objective, PreferenceLoss
from rocktune.tasks.base import TaskBase
from rocktune.train import build as engine_build
from rocktune.train import distributed, resume
from rocktune.train.context import RunContext
from rocktune.train.prelaunch import refuse_layout
from rocktune.train.request import RunOptions
from rocktune.train.task import Prepared


@dataclass(frozen=True)
class PairRun:
    """What ``prepare`` built and the later hooks use: set once, never changed."""

    ctx: RunContext
    pairs: prefdata.PairSet
    eval_pairs: prefdata.PairSet
    loss: PreferenceLoss
    pad_id: int
    segments: bool  # varlen attention: rows carry their document bounds


class PreferenceTask(TaskBase):

    def __init__(self, cfg: RunConfig):
        self.cfg, self.kind = cfg, cfg.task
        self.vocab_size: int | None = None
        # prepare's result for the later hooks: the engine calls prepare before any of them (train/task.py)
        self.run: PairRun = cast(PairRun, None)
        self.eval_stats: dict[str, float] = {}

    def refuse(self, options: RunOptions) -> None:
        refuse_inapplicable(self.cfg)
        if options.auto_fit:
            raise UserError(f"--auto fits supervised LM runs; for task={self.cfg.task} set training.micro_batch_size "
                            f"(pairs per forward) yourself: `rocktune plan MODEL --task {self.cfg.task} --batch N` "
                            "shows what fits.")
        if self.cfg.training.parallel == "fsdp":
            raise UserError(f"task={self.cfg.task} trains with training.parallel=ddp (or one process); fsdp is not "
                            "supported for preference pairs yet.")
        if self.cfg.data.chat_template in ("always", "never"):  # instruction records: SFT's; a .jinja file applies
            raise UserError(f"data.chat_template={self.cfg.data.chat_template} decides how SFT renders instruction "
                            f"records and does nothing for task={self.cfg.task}; remove it (a .jinja file is used).")
        refuse_layout(options.processes, self.cfg.training.parallel, self.cfg.model.quantization)

    def check(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        train_file = cast(str, cfg.data.train_file)  # RunConfig's validator requires it
        self.vocab_size = preflight.check_run(cfg.model.name_or_path, train_file, cfg.data.eval_file, ctx.device,
                                              cfg.model.liger, ctx.attn)
        m = cfg.model
        ctx.notes += check_quantization(m.quantization, m.name_or_path, ctx.precision, ctx.device,
                                        2 * cfg.data.max_length, cfg.lora.r, ctx.platform)

    def prepare(self, ctx: RunContext) -> Prepared:
        cfg, dist, device = ctx.cfg, ctx.dist, ctx.device
        m, rel = cfg.model, cfg.reliability
        tokenizer = use_template(preflight.load_tokenizer(m.name_or_path, m.trust_remote_code),
                                 cfg.data.chat_template)
        distributed.init(dist, device, rel.collective_timeout_s, rel.preflight_timeout_s)
        ctx.notes += distributed.preflight(dist, device, rel.preflight_timeout_s)
        (train, held, notes) = _read_pairs(cfg, tokenizer, ctx.cache_root)
        distributed.same_run(dist, train.fingerprint)
        strategy = distributed.strategy(dist, "ddp", m.quantization)  # fsdp is refused (refuse)
        attn, attn_note = build.attention(m.attn_implementation, ctx, True, False, m)
        if attn == "flash_attention_2":
            raise UserError(f"task={cfg.task} packs each pair into one row of several rows per forward, which "
                            "flash_attention_2 cannot separate; set model.attn_implementation to varlen or sdpa.")
        model, model_notes = build.model_with_adapter(m, cfg.lora, ctx.precision, attn, device, False)
        ctx.notes += notes + [n for n in (attn_note,) if n] + model_notes
        p = cfg.preference
        loss = PreferenceLoss(model, Objective(cfg.task, p.beta, p.loss_type, p.label_smoothing))
        wrapped = distributed.wrap(loss, dist, device, strategy, ctx.notes)
        params = trainable_parameters(model)
        self.run = PairRun(ctx, train, held, loss, tokenizer.pad_token_id, attn == VARLEN)
        info = {"task": cfg.task, "shape": "preference pairs", "n_train": len(train), "n_eval": len(held),
                "train_tokens": sum(train.lengths()), "max_example_tokens": max(train.lengths(), default=0),
                "n_truncated": sum(p.truncated for p in train.pairs), "fingerprint": train.fingerprint}
        return Prepared(model, wrapped, train.fingerprint,
                        f"{len(train)} train / {len(held)} eval pairs ({cfg.task}, beta {p.beta:g})", info,
                        tokenizer=tokenizer,
                        after_backward=lambda: distributed.sync_gradients(dist, params, strategy))

    def new_feed(self, **position) -> PairFeed:
        r, t = self.run, self.cfg.training
        dist = r.ctx.dist
        pin = r.ctx.choices.pin_memory and r.ctx.device == "cuda"

        def collate(idx, scale):
            batch = collate_pairs(r.pairs, idx, r.pad_id, scale, r.segments)
            return {k: v.pin_memory() for k, v in batch.items()} if pin else batch
        return PairFeed(r.pairs, t.micro_batch_size, t.grad_accum, t.seed, collate,
                        (dist.rank, dist.world, idle_pairs(r.pad_id)), order=self.cfg.data.batch_order, **position)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean per-pair loss over this rank's share of the eval pairs; the reward statistics kept for
        ``after_eval``. ORPO's likelihood term is the token mean over all eval pairs, as over a step."""
        r = self.run
        dist, pairs = r.ctx.dist, r.eval_pairs
        mine = list(range(dist.rank, len(pairs), dist.world))
        if not mine:
            return distributed.mean_over_ranks(dist, 0.0, 0)
        model = r.loss.model
        was_training = model.training
        model.eval()
        scale = len(pairs) / max(sum(len(p.chosen[0]) - 1 for p in pairs.pairs), 1)
        autocast = engine_build.autocast(r.ctx.device, r.ctx.precision)
        total = torch.zeros((), device=r.ctx.device)
        with r.loss.separate_stats():
            for start in range(0, len(mine), self.cfg.training.micro_batch_size):
                batch = collate_pairs(pairs, mine[start : start + self.cfg.training.micro_batch_size], r.pad_id,
                                      scale, r.segments)
                with autocast():
                    total += r.loss({k: v.to(r.ctx.device) for k, v in batch.items()}).float()
            self.eval_stats = {f"eval_{k}": v for k, v in r.loss.take_stats().items()}
        model.train(was_training)
        return distributed.mean_over_ranks(dist, float(total), len(mine))

    def check_resume(self, restored, force: bool) -> None:
        resume.check_world(restored, self.run.ctx.dist.world, force)
        note = distributed.check_rng(self.run.ctx.dist, restored.extra.get("rank_rng"), force)
        if note:
            self.run.ctx.notes.append(note)

    def resumed(self, restored) -> None:
        distributed.restore_rng(self.run.ctx.dist, restored.extra.get("rank_rng"))

    def checkpoint_extra(self) -> dict:
        return {"world_size": self.run.ctx.dist.world, "rank_rng": distributed.gather_rng(self.run.ctx.dist)}

    def record(self, fed) -> dict:
        """The step's pair statistics (TRL's names: rewards/chosen, rewards/margins, logps/chosen, ...); tokens:
        the answer tokens scored, the throughput's unit."""
        answers = sum(int((b["labels"][:, 1:] != -100).sum()) for b in fed.forwards)
        return {"tokens": answers, "batch_tokens": sum(b["input_ids"].numel() for b in fed.forwards),
                "real_tokens": fed.real_tokens, "pairs": fed.loss_tokens, "samples": _digest(fed.forwards),
                **self.run.loss.take_stats()}

    def after_eval(self, step: int, metrics, log) -> None:
        if self.eval_stats:
            metrics.write({"step": step, **self.eval_stats})
            acc = self.eval_stats.get("eval_rewards/accuracies")
            if acc is not None:
                log(f"step {step}: eval reward accuracy {acc:.3f}, margin "
                    f"{self.eval_stats['eval_rewards/margins']:.4f}")
            self.eval_stats = {}

    def oom_message(self, step: int, exc: BaseException) -> str:
        return (f"out of memory at step {step} even with one pair per forward ({exc}); lower data.max_length, turn "
                "on model.gradient_checkpointing, or use model.quantization=nf4.")


def _read_pairs(cfg: RunConfig, tokenizer, cache_root: Path):
    """(train pairs, eval pairs, notes): every row read and checked before anything is trained. A rejected source
    leaves no Arrow copy behind (parquet, CSV and hub sources are read through datasets' cache)."""
    pending = Pending.start(cache_root)
    try:
        return _read_checked(cfg, tokenizer, cache_root)
    except BaseException:
        pending.discard()
        raise


def _read_checked(cfg: RunConfig, tokenizer, cache_root: Path):
    d, policy = cfg.data, cfg.preference.no_signal
    train_file = cast(str, d.train_file)  # RunConfig's validator requires it
    train_rows = read_rows(train_file, d, cache_root, "data.train_file")
    train, cut, notes = prefdata.encode_screened(train_rows, tokenizer, d, policy, train_file)
    n_pairs = len(train)
    if d.eval_file:
        eval_rows = read_rows(d.eval_file, d, cache_root, "data.eval_file", True)
        held, cut_eval, eval_notes = prefdata.encode_screened(eval_rows, tokenizer, d, policy, d.eval_file)
        cut, notes, n_pairs = cut + cut_eval, notes + eval_notes, n_pairs + len(held)
    else:
        train, held = prefdata.split_pairs(train, d.eval_fraction, cfg.training.seed)
    lost = ("the prompt loses its start first, then both answers their end alike" if d.truncation == "prompt" else
            "both answers lose their end alike")
    notes += cut_note(cut, n_pairs, "pairs", d.max_length, lost)
    return prefdata.pair_set(train), prefdata.pair_set(held), notes


def _digest(forwards: list[dict]) -> str:
    h = hashlib.blake2b(digest_size=6)
    for batch in forwards:
        h.update(batch["input_ids"].numpy().tobytes())
    return h.hexdigest()
