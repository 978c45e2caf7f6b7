"""The vision-language task (task: vlm): LoRA on a vision-language model's language model, trained on conversations
with images (tasks/vlm/data/vision.py). The vision tower and projector stay frozen unless lora.target_modules reaches
them.

Everything a run does the same way whatever it trains (steps, OOM split, guards, the training-path tripwire,
checkpoints, exact resume, Ctrl-C, the final writes) is the engine's; this task brings the data (every row and
image read and checked before anything is written), the model (build.py), the feed (feed.py) and the loss
(loss.py). Several processes train by DDP (each rank its round-robin share of a step's micro-batches).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from rocktune.kernels.attention import VARLEN, choose
from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.data import sources
from rocktune.tasks.vlm.data import vision_cache
from rocktune.data.dataset import Pending
from rocktune.data.truncate import cut_note
from rocktune.tasks.vlm.data.vision import VisionExample, VisionTokens, encode, to_conversation
from rocktune.tasks.vlm.data.vision_batch import collate, idle_batch
from rocktune.tasks.vlm.data.vision_pack import collate_packed
from rocktune.tasks.vlm.data.vision_source import read_rows
from rocktune.errors import UserError
from rocktune.models.load import DTYPES
from rocktune.tasks.causal import autofit, preflight
from rocktune.tasks.vlm import autofit as vlm_autofit
from rocktune.tasks.vlm import build, launch
from rocktune.tasks.vlm.vision.model import (check_data_settings, model_type, recurrent_notes, vision_tokens,
                                             with_processor_template)
from rocktune.tasks.causal.feed import Feeding
from rocktune.tasks.vlm.feed import TokenVisionFeed, VisionFeed
from rocktune.tasks.causal.samples import SampleSettings
from rocktune.tasks.vlm.loss import VisionLoss
from rocktune.tasks.vlm.samples import VisionSampler
from rocktune.tasks.base import TaskBase
from rocktune.train import build as engine_build
from rocktune.train import distributed, resume
from rocktune.train.context import RunContext
from rocktune.train.request import RunOptions
from rocktune.train.task import Prepared


@dataclass(frozen=True)
class VisionRun:
    """What ``prepare`` built and the later hooks use: set once, never changed."""

    ctx: RunContext
    train: list[VisionExample]
    held: list[VisionExample]
    loss: VisionLoss
    pad_id: int
    vision: VisionTokens
    tokenizer: Any  # the processor's tokenizer
    feeding: Feeding  # how a step is cut into forwards (training.batching)


class VLMTask(TaskBase):
    kind = "vlm"
    samples_what = " and sample generations"

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        # prepare's result for the later hooks: the engine calls prepare before any of them (train/task.py)
        self.run: VisionRun = cast(VisionRun, None)
        self.predicted_peak: int | None = None  # --auto: the planner's figure

    def attn_setting(self) -> str:
        return self.cfg.model.attn_implementation  # auto, varlen or sdpa (launch.refuse): the language model's

    def refuse(self, options: RunOptions) -> None:
        refuse_inapplicable(self.cfg)
        launch.refuse(self.cfg, options)

    def check(self, ctx: RunContext) -> None:
        if importlib.util.find_spec("PIL") is None:
            raise UserError("task=vlm reads images with Pillow, which is not installed: "
                            "pip install 'rocktune[vision]'.")
        d = ctx.cfg.data
        for key, file in (("data.train_file", d.train_file), ("data.eval_file", d.eval_file)):
            if file:
                sources.check_spec(file, key)
                if Path(file).is_file() and Path(file).suffix.lower() not in (".json", ".jsonl", ".parquet",
                                                                               ".arrow"):
                    raise UserError(f"{key}={file}: task=vlm reads JSON/JSONL, parquet and Arrow files, save_to_disk "
                                    "folders and hub ids (docs/vision.md).")
        packing = launch.packing_setting(ctx.cfg)
        check_data_settings(model_type(ctx.cfg.model.name_or_path), d.min_pixels, d.max_pixels, packing)
        ctx.notes += recurrent_notes(ctx.cfg.model.name_or_path, packing)
        if ctx.options.auto_fit:
            self._fit(ctx)

    def _fit(self, ctx: RunContext) -> None:
        """--auto: every row and image read as training reads them (into a temporary folder: check writes nothing),
        then the planner's max_pixels, micro-batch and checkpointing for the budget; prepare reads the data again at
        the chosen resolution."""
        import tempfile

        cfg = ctx.cfg
        m, d = cfg.model, cfg.data
        from transformers import AutoConfig

        tokenizer = with_processor_template(preflight.load_tokenizer(m.name_or_path, False), m.name_or_path)
        vision = vision_tokens(m.name_or_path, AutoConfig.from_pretrained(m.name_or_path), tokenizer, d.min_pixels,
                               d.max_pixels)
        with tempfile.TemporaryDirectory(prefix="rocktune-auto-") as tmp:
            pending = Pending.start(Path(tmp))  # nothing of it is committed: the folder goes with its entries
            train, held = _read(cfg, tokenizer, vision, Path(tmp), pending)
            pending.discard()
        ctx.cfg, notes, self.predicted_peak = vlm_autofit.apply_fit(cfg, ctx.precision, ctx.options.vram_bytes,
                                                                    (train + held, vision), ctx.device)
        ctx.notes += notes
        self.cfg = ctx.cfg

    def prepare(self, ctx: RunContext) -> Prepared:
        cfg, device = ctx.cfg, ctx.device
        m, d = cfg.model, cfg.data
        from transformers import AutoConfig

        tokenizer = with_processor_template(preflight.load_tokenizer(m.name_or_path, False), m.name_or_path)
        vision = vision_tokens(m.name_or_path, AutoConfig.from_pretrained(m.name_or_path), tokenizer, d.min_pixels,
                               d.max_pixels)
        pending = Pending.start(ctx.cache_root)
        try:
            train, held = _read(cfg, tokenizer, vision, ctx.cache_root, pending)
        except BaseException:  # a rejected source leaves no Arrow copy and no token cache entry behind
            pending.discard()
            raise
        cached = "hit" if not pending.entries else "written"
        pending.commit()
        # Several ranks (DDP): every rank reads the token cache, or encodes and checks the data itself when there is
        # none yet (a lost race to commit the same entry is harmless), and the group proves it holds the same rows
        # before training.
        dist, rel = ctx.dist, cfg.reliability
        distributed.init(dist, device, rel.collective_timeout_s, rel.preflight_timeout_s)
        ctx.notes += distributed.preflight(dist, device, rel.preflight_timeout_s)
        fingerprint = _fingerprint(train)
        distributed.same_run(dist, fingerprint)
        feeding, feed_notes, planned_peak = vlm_autofit.plan_feeding(cfg, device, ctx.precision, train,
                                                                     ctx.options.vram_bytes)
        attn, attn_note = choose(m.attn_implementation, ctx.attn, device, (feeding.packed, False),
                                 DTYPES[ctx.precision])
        model, notes = build.model_with_adapter(m, cfg.lora, ctx.precision, attn, device, ctx.platform)
        cut = sum(e.truncated for e in [*train, *held])
        ctx.notes += feed_notes + [n for n in (attn_note,) if n] + notes + cut_note(
            cut, len(train) + len(held), "conversations", d.max_length, "each loses its last tokens and with them, "
            "usually, the end-of-turn token the model learns to stop at (a cut through an image is refused)")
        loss = VisionLoss(model, autofit.loss_chunk(cfg.training.loss_chunk_size, device), attn == VARLEN)
        wrapped = distributed.wrap(loss, dist, device, distributed.strategy(dist, "ddp", "none"), ctx.notes)
        self.run = VisionRun(ctx, train, held, loss, tokenizer.pad_token_id, vision, tokenizer, feeding)
        lengths = [len(e.input_ids) for e in train]
        n_images = sum(len(e.images) for e in train)
        info = {"task": "vlm", "shape": "vision-language conversations", "n_train": len(train), "n_eval": len(held),
                "train_tokens": sum(lengths), "max_example_tokens": max(lengths), "train_images": n_images,
                "image_tokens": sum(e.image_tokens for e in train),
                "n_truncated": sum(e.truncated for e in train), "packing": cfg.data.packing, "fingerprint": fingerprint,
                "cache_hit": cached == "hit", "batching": feeding.mode}
        return Prepared(model, wrapped, fingerprint,
                        f"{len(train)} train / {len(held)} eval conversations with {n_images} images (vlm, cache "
                        f"{cached})", info, predicted_peak=planned_peak or self.predicted_peak, tokenizer=tokenizer)

    def new_feed(self, **position) -> VisionFeed:
        r, t = self.run, self.cfg.training
        # On a GPU the next step's images are processed while this one computes; on a CPU a thread would compete.
        dist, f = r.ctx.dist, r.feeding
        shape, prefetch = (t.micro_batch_size, t.grad_accum, t.seed), r.ctx.device == "cuda"
        share = (dist.rank, dist.world, idle_batch(r.pad_id, r.vision))
        if f.mode == "tokens":
            return TokenVisionFeed(r.train, shape, self._packed_batch, prefetch, share,
                                   (f.max_length, f.rows_per_forward), **position)
        packing = self.cfg.data.packing
        return VisionFeed(r.train, shape, self._packed_batch if packing else self._batch, prefetch, share,
                          self.cfg.data.max_length if packing else 0, order=self.cfg.data.batch_order, **position)

    def _batch(self, examples: list[VisionExample]) -> dict:
        return collate(examples, self.run.pad_id, self.run.vision)

    def _packed_batch(self, rows: list[list[VisionExample]]) -> dict:
        return collate_packed(rows, self.run.pad_id, self.run.vision)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean token loss over the eval conversations (several ranks: each its round-robin share, summed)."""
        r = self.run
        if not r.held:
            return None
        dist = r.ctx.dist
        mine = r.held[dist.rank :: dist.world]
        model = r.loss.model
        was_training = model.training
        model.eval()
        autocast = engine_build.autocast(r.ctx.device, r.ctx.precision)
        total, count = 0.0, 0
        size = self.cfg.training.micro_batch_size
        for start in range(0, len(mine), size):
            batch = self._batch(mine[start : start + size])
            with autocast():
                loss, n = r.loss.sum_and_count({k: v.to(r.ctx.device) for k, v in batch.items()})
            total, count = total + float(loss), count + n
        model.train(was_training)
        return distributed.mean_over_ranks(dist, total, count)

    def check_resume(self, restored, force: bool) -> None:
        dist = self.run.ctx.dist
        resume.check_world(restored, dist.world, force)
        resume.check_batching(restored, self.run.feeding.mode)  # a position counts micro-batches or whole steps
        note = distributed.check_rng(dist, restored.extra.get("rank_rng"), force)
        if note:
            self.run.ctx.notes.append(note)

    def resumed(self, restored) -> None:
        distributed.restore_rng(self.run.ctx.dist, restored.extra.get("rank_rng"))

    def checkpoint_extra(self) -> dict:
        dist = self.run.ctx.dist
        return {"batching": self.run.feeding.mode, "world_size": dist.world, "rank_rng": distributed.gather_rng(dist)}

    def start(self, redo_from: int, metrics, log) -> None:
        """The sampler (training.sample_count eval conversations with their images), on rank 0 only."""
        r = self.run
        t, main = r.ctx.cfg.training, r.ctx.dist.main
        settings = SampleSettings(t.sample_count if main else 0, [], t.sample_max_new_tokens, r.ctx.device,
                                  engine_build.autocast(r.ctx.device, r.ctx.precision), "messages")
        self.sampler = VisionSampler.for_examples(r.ctx.run_dir, r.tokenizer, r.held, r.vision, settings, redo_from,
                                                  write=main)

    def record(self, fed) -> dict:
        return {"tokens": fed.loss_tokens, "batch_tokens": sum(b["input_ids"].numel() for b in fed.forwards),
                "real_tokens": fed.real_tokens, "images": sum(int(b["image_counts"].sum()) for b in fed.forwards),
                "samples": _digest(fed.forwards)}

    def after_eval(self, step: int, metrics, log) -> None:
        self.sampler.at(step, self.run.loss.model, metrics, log)

    def outputs(self, run_dir: Path) -> list[str] | None:
        """The LM's next commands, with the image; GGUF export writes the vision projector too."""
        return [f"  adapter         {run_dir / 'adapter'} (PEFT; base {self.cfg.model.name_or_path})", "next:",
                f"  rocktune generate {run_dir} --image PHOTO.png --prompt \"...\" --compare   # with and without "
                "the adapter", f"  rocktune export {run_dir} --to gguf   # llama.cpp: model + mmproj",
                f"  rocktune report {run_dir}   # loss curves and run facts"]

    def oom_message(self, step: int, exc: BaseException) -> str:
        return (f"out of memory at step {step} even with one conversation per forward ({exc}); lower data.max_pixels "
                "(fewer tokens per image), lower data.max_length or turn on model.gradient_checkpointing.")


def _read(cfg: RunConfig, tokenizer, vision: VisionTokens, cache_root: Path, pending: Pending):
    """(train, eval) examples: every row of every source encoded, every image opened, before anything is written;
    or the token cache's, when nothing that determines them changed (tasks/vlm/data/vision_cache.py)."""
    d = cfg.data
    read = (cache_root, pending)
    train = _encode_source(cast(str, d.train_file), d, (tokenizer, vision), read, "data.train_file")
    if d.eval_file:
        return train, _encode_source(d.eval_file, d, (tokenizer, vision), read, "data.eval_file")
    order = list(range(len(train)))
    random.Random(cfg.training.seed).shuffle(order)
    n_eval = int(len(train) * d.eval_fraction) or (1 if d.eval_fraction and len(train) > 1 else 0)
    held = set(order[:n_eval])
    return [e for i, e in enumerate(train) if i not in held], [train[i] for i in sorted(held)]


def _encode_source(spec: str, d, parts: tuple, read: tuple, key: str) -> list[VisionExample]:
    """``read``: (the cache folder, the ``Pending`` that a new cache entry joins)."""
    (tokenizer, vision), (cache_root, pending) = parts, read
    rows, base = read_rows(spec, d, cache_root, key)
    refs = [to_conversation(rec, base, str(loc))[1] for loc, rec in rows]  # no image opened: their references
    entry_key = vision_cache.key(spec, rows, refs, tokenizer, vision, d)
    cached = vision_cache.load(cache_root, entry_key, refs)
    if cached is not None:
        return cached
    examples = [encode(rec, base, tokenizer, vision, d.max_length, str(loc)) for loc, rec in rows]
    pending.entries.append(vision_cache.stage(cache_root, entry_key, examples))
    return examples


def _fingerprint(examples: list[VisionExample]) -> str:
    """Of the tokens, labels and images (a file by its path, size and modification time; embedded bytes by hash)."""
    h = hashlib.blake2b(digest_size=16)
    for e in examples:
        h.update(json.dumps([e.input_ids, e.labels, e.grids]).encode())
        for ref in e.images:
            if ref.path is not None:
                st = ref.path.stat()
                h.update(f"{ref.path}:{st.st_size}:{st.st_mtime_ns}".encode())
            else:
                h.update(hashlib.blake2b(cast(bytes, ref.data), digest_size=16).digest())
    return h.hexdigest()


def _digest(forwards: list[dict]) -> str:
    h = hashlib.blake2b(digest_size=6)
    for batch in forwards:
        h.update(batch["input_ids"].numpy().tobytes())
    return h.hexdigest()

