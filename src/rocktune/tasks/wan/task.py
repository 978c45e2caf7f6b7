"""The Wan LoRA task (task: video-lora / image-lora): LoRA on a Wan 2.1/2.2 transformer through diffusers.

Media checked and assigned to buckets, latents and text embeddings cached once (diffusion/cache.py here), then only the
transformer trains, with flow matching (diffusion/objective.py). The engine (train/loop.py) runs the steps with the
same step, guard, checkpoint and interrupt code as the LM task. One process: several ranks are refused before
anything is written.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from rocktune.config import RunConfig
from rocktune.tasks.wan.diffusion import comfy, components, media
from rocktune.tasks.wan.diffusion.cache import LatentSet, cache_latents
from rocktune.tasks.wan.diffusion.comfy import LORA_FILE
from rocktune.tasks.wan.diffusion.objective import FlowMatchLoss
from rocktune.tasks.wan.diffusion.steps import LatentFeed, Noise, eval_forwards
from rocktune.errors import UserError
from rocktune.tasks.wan import inputs
from rocktune.tasks.wan import refuse as refusals
from rocktune.models.load import DTYPES, trainable_parameters
from rocktune.tasks.base import TaskBase
from rocktune.train import build
from rocktune.train.context import RunContext
from rocktune.train.request import RunOptions
from rocktune.train.task import Prepared


class WanTask(TaskBase):
    samples_what = ""  # renders come after training: rocktune generate

    def __init__(self, cfg: RunConfig):
        self.cfg, self.kind = cfg, cfg.task

    def attn_setting(self) -> str:
        return "sdpa"  # diffusers' Wan attention processor calls SDPA itself

    def refuse(self, options: RunOptions) -> None:
        refusals.refuse(self.cfg, options)

    def check(self, ctx: RunContext) -> None:
        """The checkpoint's layout, the buckets, the LoRA targets and every media file, before anything is written."""
        if ctx.dist.enabled:
            raise UserError(f"task={self.cfg.task} trains in one process; multi-GPU diffusion LoRA is not supported "
                            "yet. Run without --nproc (docs/diffusion.md).")
        cfg, diff, d = self.cfg, self.cfg.diffusion, self.cfg.data
        self.ctx = ctx
        self.layout = layout = components.read_layout(cfg.model.name_or_path, diff.expert)
        frames = [1] if cfg.task == "image-lora" else diff.frames
        media.check_buckets(diff.resolutions, frames, layout.spatial_multiple, layout.temporal, cfg.task)
        comfy.check_targets(components.planned_targets(layout, cfg.lora.target_modules))
        self.train_media, self.eval_media = inputs.split(inputs.assigned(d.train_file, cfg, frames), d.eval_file,
                                                         d.eval_fraction, cfg.training.seed,
                                                         lambda source: inputs.assigned(source, cfg, frames))
        # Before the (long) encode: the planner's peak for the largest bucket, and a warning when it exceeds the GPU.
        buckets = [b for _, b in self.train_media]
        self.predicted_peak, self.plan_note = inputs.predicted_peak(cfg, buckets, ctx.precision, ctx.vram_bytes())

    def prepare(self, ctx: RunContext) -> Prepared:
        """Encode once, then free the VAE and the text encoder: training holds only the transformer."""
        cfg, diff, t, layout = self.cfg, self.cfg.diffusion, self.cfg.training, self.layout
        say = _console(ctx.quiet)
        say(self.plan_note if not self.plan_note.startswith("warning") else f"[yellow]{self.plan_note}[/]")
        encode_on = "cpu" if diff.cache_device == "cpu" else ctx.device
        train_set = cache_latents(self.train_media, layout, encode_on, diff.max_text_tokens, ctx.cache_root, say)
        eval_set = cache_latents(self.eval_media, layout, encode_on, diff.max_text_tokens, ctx.cache_root, say) \
            if self.eval_media else LatentSet([], "", True, [])
        self.train_set = train_set
        shift = layout.shift(diff.shift)
        self.noise = Noise(diff.timestep_sampling, shift, layout.sigma_range)
        transformer = components.load_transformer(cfg.model.name_or_path, DTYPES[ctx.precision], ctx.device,
                                                  layout.subfolder)
        self.model = model = components.apply_lora(transformer, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout,
                                                   cfg.lora.target_modules, cfg.model.gradient_checkpointing)
        for p in trainable_parameters(model):  # the adapter trains in fp32 whatever the base's storage
            p.data = p.data.float()  # (autocast picks the matmul precision)
        self.loss = FlowMatchLoss(model)
        self._eval_fed = eval_forwards(eval_set.items, t.micro_batch_size, t.seed, self.noise,
                                       components.PIPELINE_TEXT_TOKENS)
        self._autocast = build.autocast(ctx.device, ctx.precision)
        self._per_token = int(layout.vae.get("z_dim", 16)) * math.prod(layout.patch)  # latent values per token
        ctx.notes += train_set.notes + eval_set.notes + [self.plan_note]  # the plan note was said before encoding
        expert = "" if layout.sigma_range == (0.0, 1.0) else \
            f", {layout.subfolder}/ at noise levels {layout.sigma_range[0]:g}-{layout.sigma_range[1]:g}"
        return Prepared(model, self.loss, train_set.fingerprint,
                        f"{len(train_set)} train / {len(eval_set)} eval clips ({cfg.task}, flow shift {shift:g}"
                        f"{expert})", _data_info(cfg, train_set, eval_set, shift), self.predicted_peak)

    def new_feed(self, **position) -> LatentFeed:
        t = self.cfg.training
        return LatentFeed(self.train_set.items, t.micro_batch_size, t.micro_batch_size * t.grad_accum, t.seed,
                          self.noise, components.PIPELINE_TEXT_TOKENS, **position)

    def evaluate(self) -> float | None:
        return _eval_loss(self.loss, self._eval_fed, self.ctx.device, self._autocast)

    def record(self, fed) -> dict:
        return {"tokens": fed.loss_tokens // self._per_token, "latent_values": fed.loss_tokens,
                "samples": _digest(fed.names)}

    def after_eval(self, step: int, metrics, log) -> None:
        """No samples during training: rendering a clip takes far longer than a step."""

    def final_files(self, run_dir: Path) -> list:
        # Before adapter/, which is what marks a run complete (summary.already_complete): a crash between the two
        # leaves a run that --resume finishes instead of one that claims to be done without its LoRA file.
        out = run_dir / LORA_FILE
        return [(f"the LoRA to {out}", lambda: _write_comfy(self.model, self.cfg, out))]

    def outputs(self, run_dir: Path) -> list[str]:
        return _outputs(run_dir)

    def oom_message(self, step: int, exc: BaseException) -> str:
        return (f"out of memory at step {step} even with one clip per forward ({exc}). {self.plan_note}; set "
                "model.gradient_checkpointing=true, or use fewer frames or smaller resolutions in the diffusion "
                "section (rocktune plan MODEL --task video-lora shows what fits).")


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

