"""Wan's registry hooks (task_registry.py; video-lora, image-lora): the media preview, the memory plan, the report's
samples note and the model card's loading lines. Torch-free at import."""

from __future__ import annotations

from pathlib import Path

from rocktune.task_registry import ReportHooks

REPORT = ReportHooks(no_samples="<h2>Samples</h2><p>Render clips with the trained LoRA: <code>rocktune generate "
                                "{run} --prompt \"...\" --compare</code> (docs/diffusion.md).</p>")


def plan(args) -> int:
    from rocktune.planner.budget import parse_size
    from rocktune.tasks.wan.plan import WanSpec, run_wan_plan

    width, height = parse_size(args.resolution, "--resolution")
    spec = WanSpec(width, height, args.frames, args.batch, args.text_tokens, args.lora_r, args.precision,
                   args.checkpointing)
    return run_wan_plan(args.model, args.task, spec, args.vram, args.json)


def card(base: str, run_dir: Path, data: dict) -> str:
    return (f"## Use it\n\n```bash\nrocktune generate {run_dir} --prompt \"...\" --compare\n```\n\n"
            f"For ComfyUI and diffusers' `load_lora_weights` use `{run_dir / 'wan_lora.safetensors'}` (Wan's original "
            "names); the `adapter_model.safetensors` here is PEFT's format for the diffusers transformer, which "
            "ComfyUI does not read.\n")
