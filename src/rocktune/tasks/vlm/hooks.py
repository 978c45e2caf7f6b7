"""task=vlm's registry hooks (task_registry.py): the conversations-with-images preview, the plan with image tokens
and the model card's loading lines. Torch-free at import."""

from __future__ import annotations

from pathlib import Path


def plan(args) -> int:
    from rocktune.errors import UserError
    from rocktune.planner.estimate import DTYPE_BYTES as DTYPES
    from rocktune.tasks.vlm.planner.vlm import VLMSpec
    from rocktune.planner.budget import parse_size
    from rocktune.tasks.vlm.plan import PlanRequest, run_vlm_plan

    if args.precision not in DTYPES or min(args.batch, args.global_batch, args.lora_r, args.max_length - 1) < 1:
        raise UserError(f"precision must be one of {', '.join(DTYPES)}; batch, global-batch and lora-r positive, "
                        "max-length at least 2.")
    size = parse_size(args.image_size, "--image-size") if args.image_size else None
    req = PlanRequest(args.model, args.data, args.max_pixels, args.min_pixels, size, args.images, args.text_tokens,
                      args.max_length, args.vram, args.device, args.json)
    spec = VLMSpec(micro_batch=args.batch, lora_r=args.lora_r, precision=args.precision,
                   checkpointing=args.checkpointing, attn="eager" if args.attn == "eager" else "sdpa",
                   loss_chunk=args.loss_chunk)
    return run_vlm_plan(req, spec, args.global_batch)


def card(base: str, run_dir: Path, data: dict) -> str:
    from rocktune.tasks.vlm.card import load_vision

    return load_vision(base, run_dir, data)
