"""The named benchmark configurations.

Every configuration trains the same model on the same data for the same number of optimizer steps with the same
samples per step (micro-batch x accumulation = 8, seed 002's effective batch), the same LoRA (r 16, alpha 32, all
linear layers), learning-rate schedule and clipping. What differs is listed in ``settings``: for rocktune dotted
config overrides, for the Hugging Face baselines the recipe's knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rocktune.errors import UserError


@dataclass(frozen=True)
class BenchConfig:
    name: str
    kind: str  # "rocktune" (rocktune's loop) | "hf" (transformers Trainer + PEFT)
    description: str
    settings: dict = field(default_factory=dict)
    baseline: bool = False
    needs_gpu: bool = False
    in_default_set: bool = True  # part of a plain `rocktune bench`
    default_on_cpu: bool = True
    nproc: int = 1  # ranks (rocktune train --nproc): bench --nproc N adds rocktune's defaults on N ranks


# The recipe knobs of the HF baselines: precision (fp32 | auto = rocktune's precision policy for the device),
# padding (max_length | longest), checkpointing, attention (None = transformers' default), sampler.
HF_SEED = {"precision": "fp32", "padding": "max_length", "gradient_checkpointing": True, "attn_implementation": None,
           "sampler": "random"}
HF_TUNED = {"precision": "auto", "padding": "longest", "gradient_checkpointing": False,
            "attn_implementation": "sdpa", "sampler": "group_by_length"}

# An expert's HF setup today, with nothing the machine lacks: bf16, padding-free flattened rows with per-example
# position ids (DataCollatorWithFlattening: transformers separates the examples from the position ids), attention
# flash-attention 2 when flash_attn is installed, else flex attention on a GPU (a document block mask, no dense
# square), SDPA on a CPU; fused AdamW and the Trainer's torch_compile on a GPU; Liger when installed; a fixed
# per-device batch of 8 examples, the global batch kept: 8 rows of up to 2,048 tokens fit an 80 GB GPU with the full
# logits too (Liger absent), and fixing it costs nothing, where probing the largest OOM by OOM took over 100 s of
# the H200's time-boxed run (docs/gpu-runs/2026-11-26-h200).
HF_BEST = {"precision": "auto", "padding": "flatten", "gradient_checkpointing": False, "attn_implementation": "best",
           "sampler": "group_by_length", "liger": True, "micro_batch": 8, "compile": True,
           "optim": "adamw_torch_fused"}

CONFIGS: dict[str, BenchConfig] = {c.name: c for c in [
    BenchConfig("hf-seed", "hf", "HF Trainer + PEFT, seed 002: fp32, pad to max_length, checkpointing, batch 2x4",
                HF_SEED, baseline=True),
    BenchConfig("hf-tuned", "hf", "HF Trainer + PEFT, careful: bf16 where supported, sdpa, group_by_length, "
                "dynamic padding, no checkpointing", HF_TUNED, baseline=True),
    BenchConfig("hf-best", "hf", "HF Trainer + PEFT as an expert sets it up: bf16, padding-free flattening with "
                "position ids, FA2 when installed else flex attention, fused AdamW, torch_compile, Liger when "
                "installed, 8 examples per device batch",
                HF_BEST, baseline=True, default_on_cpu=False),
    BenchConfig("rocktune", "rocktune", "rocktune defaults: on a GPU token batching (packed rows, planner-sized "
                "forwards, compile where sound, Liger), on a CPU micro-batches in data.batch_order; chunked loss at "
                "loss positions only, foreach/fused AdamW, no checkpointing", {}),
    BenchConfig("rt-examples", "rocktune", "batching=examples on a GPU too: micro_batch_size examples per forward "
                "(the defaults before token batching)", {"training.batching": "examples"}, default_on_cpu=False),
    BenchConfig("rt-no-compile", "rocktune", "torch.compile off (on where the platform knowledge allows it)",
                {"training.compile": False}, needs_gpu=True, default_on_cpu=False),
    BenchConfig("rt-packing", "rocktune", "packing rows of max_length (per-sequence positions), 1 row x 4",
                {"data.packing": True, "training.micro_batch_size": 1}),
    BenchConfig("rt-full-loss", "rocktune", "chunked loss off: HF's full-logits loss path",
                {"training.loss_impl": "full"}),
    BenchConfig("rt-checkpointing", "rocktune", "gradient checkpointing on", {"model.gradient_checkpointing": True}),
    BenchConfig("rt-adamw-torch", "rocktune", "foreach/fused AdamW off: the per-parameter for-loop AdamW",
                {"training.optimizer": "adamw_torch"}),
    BenchConfig("rt-no-liger", "rocktune", "Liger kernels off", {"model.liger": "off"}, needs_gpu=True),
    # The pair that settles the default under compile: rocktune (auto: Inductor's own fusion) against this.
    BenchConfig("rt-liger", "rocktune", "Liger's kernels on under torch.compile too (auto leaves a compiled layer "
                "to Inductor's fusion)", {"model.liger": "on"}, needs_gpu=True, default_on_cpu=False),
    BenchConfig("rt-compile", "rocktune", "torch.compile on the decoder, whatever the platform default",
                {"training.compile": True}, in_default_set=False),
    BenchConfig("rt-mb8", "rocktune", "micro-batch 8 x accumulation 1", {"training.micro_batch_size": 8,
                "training.grad_accum": 1}, in_default_set=False),
    BenchConfig("rt-mb4", "rocktune", "micro-batch 4 x accumulation 2", {"training.micro_batch_size": 4,
                "training.grad_accum": 2}, in_default_set=False),
]}

# The loss-parity pair: both fp32, rocktune in its own batch order, HF fed those very micro-batches in that order.
PARITY = {
    "parity-rocktune": BenchConfig("parity-rocktune", "rocktune", "rocktune defaults in fp32, its batch order",
                                   {"training.precision": "fp32", "training.batching": "examples"}),
    "parity-hf": BenchConfig("parity-hf", "hf", "HF Trainer + PEFT in fp32 (dynamic padding, sdpa), fed rocktune's "
                             "micro-batches in rocktune's order", {**HF_TUNED, "precision": "fp32",
                                                                    "sampler": "rocktune-order"}),
}
# ``rocktune bench --suite vlm`` (tasks/vlm/bench/vlm.py): task=vlm against the HF Trainer on a vision-language model.
# Apart from the text rows: they need that model and data, so neither --configs all nor a default set includes them.
VLM_CONFIGS = {c.name: c for c in [
    BenchConfig("vlm-hf", "hf", "HF Trainer + PEFT on the vision-language model: fp32, sdpa, LoRA on the language "
                "model, a collator that pads and runs the image processor, random sampler", {"task": "vlm"},
                baseline=True),
    BenchConfig("vlm-rocktune", "rocktune", "rocktune task=vlm defaults in fp32 (chunked loss at loss positions, "
                "foreach AdamW, the vision side frozen)", {"task": "vlm", "training.precision": "fp32"}),
]}
BASELINES = [n for n, c in CONFIGS.items() if c.baseline]


def on_ranks(nproc: int) -> BenchConfig:
    """rocktune's defaults on ``nproc`` processes (the same global batch), registered so reports can name it."""
    cfg = BenchConfig(f"rocktune-x{nproc}", "rocktune", f"rocktune defaults on {nproc} processes (torchrun: DDP; "
                      "gloo on a CPU, threads split between the ranks)", {}, nproc=nproc)
    CONFIGS[cfg.name] = cfg
    return cfg


def default_names(device: str) -> list[str]:
    return [n for n, c in CONFIGS.items() if c.in_default_set and (device != "cpu" or c.default_on_cpu)]


def select(names: str | None, device: str) -> list[BenchConfig]:
    """``names``: comma-separated, ``all``, or None for the default set of this device."""
    if names is None:
        chosen = default_names(device)
    elif names.strip() == "all":
        chosen = list(CONFIGS)
    else:
        chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in CONFIGS and n not in PARITY]
    if unknown or not chosen:
        raise UserError(f"unknown bench configuration {', '.join(unknown) or '(none given)'}; known: "
                        f"{', '.join(CONFIGS)} (or 'all'); see `rocktune bench --list`.")
    return [CONFIGS.get(n) or PARITY[n] for n in dict.fromkeys(chosen)]
