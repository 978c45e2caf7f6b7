"""The registry hooks of a task on a causal LM (task_registry.py's defaults): ``data preview``, ``plan``, the
report's words and the model card's loading lines. Torch-free at import: the launching CLI calls them."""

from __future__ import annotations

from pathlib import Path

from rocktune.task_registry import ReportHooks

REPORT = ReportHooks()


def plan(args) -> int:
    return plan_causal(args)


def plan_causal(args, sequences_per_example: int = 1, completion: bool = False) -> int:
    """``rocktune plan`` for a causal LM. ``sequences_per_example``: a preference pair is two sequences in one
    forward. ``completion`` (GRPO): the update's rows are prompt + completion, and the rollout's KV cache holds every
    completion of a step."""
    from rocktune.planner.estimate import RunSpec
    from rocktune.planner.report import run_plan

    targets = args.targets if args.targets in ("all-linear", "all") else \
        tuple(t.strip() for t in args.targets.split(",") if t.strip())
    rollout = (args.rollout_rows or args.global_batch, args.max_length, args.completion_length) if completion \
        else (0, 0, 0)
    spec = RunSpec(micro_batch=args.batch * sequences_per_example,
                   seq_len=args.max_length + (args.completion_length if completion else 0),
                   rollout_rows=rollout[0], rollout_prompt=rollout[1], rollout_new=rollout[2], lora_r=args.lora_r,
                   targets=targets,
                   precision=args.precision, quant=args.quant, attn=args.attn, checkpointing=args.checkpointing,
                   lora_dropout=args.lora_dropout, loss_mode=args.loss, loss_chunk=args.loss_chunk, ranks=args.nproc,
                   parallel=args.parallel, compiled=args.compiled)
    return run_plan(args.model, args.vram, spec, args.global_batch, args.json, args.device)


def card(base: str, run_dir: Path, data: dict) -> str:
    from rocktune.train.model_card import load_lm

    return load_lm(base, run_dir)
