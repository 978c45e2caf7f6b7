"""The tasks rocktune trains: one table keyed by ``task:``. Every other place derives from it: the config's choices
and which of its keys apply (config.py's field tags), the CLI's ``--task`` choices, the refusals before launch, the
task object the worker builds (tasks/__init__.py) and docs/architecture.md's list.

Standard library only: the config and the launching process read it without importing torch. A task's code is named
by ``module:attribute`` and imported only where it runs, so adding a task is its folder plus one row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskSpec:
    name: str  # the value of ``task:``
    summary: str  # one line: what it trains (--help, the config's description, docs)
    tags: frozenset[str]  # the config field tags that apply (config.py ``only``); untagged fields apply to all
    builder: str  # "module:Class" of the task object with train/task.py's hooks, built in the worker
    launch: str  # module with refuse(cfg, options) and precheck(cfg): run in the launching process, torch-free
    diffusion: bool = False  # Wan through diffusers: its own generate/export paths (video files, ComfyUI LoRA)
    pairs: bool = False  # trains on preference pairs (chosen, rejected)
    vision: bool = False  # a vision-language model: generate takes --image, the model card loads its own class


_LM_LAUNCH = "rocktune.tasks.causal.launch"  # the causal-LM kit's checks: lm, dpo, orpo
TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (
    TaskSpec("lm", "LoRA for a causal language model on chat, instruction or text data (supervised, the default)",
             frozenset({"lm", "sft"}), "rocktune.tasks.lm.task:LMTask", _LM_LAUNCH),
    TaskSpec("dpo", "preference tuning of a causal LM's LoRA on chosen/rejected pairs by DPO (the reference is the "
             "model with its adapter switched off)", frozenset({"lm", "preference", "dpo"}),
             "rocktune.tasks.preference.task:PreferenceTask", _LM_LAUNCH, pairs=True),
    TaskSpec("orpo", "preference tuning of a causal LM's LoRA on chosen/rejected pairs by ORPO (odds ratio plus the "
             "chosen answer's likelihood; no reference)", frozenset({"lm", "preference"}),
             "rocktune.tasks.preference.task:PreferenceTask", _LM_LAUNCH, pairs=True),
    TaskSpec("grpo", "reinforcement learning of a causal LM's LoRA with verifiable rewards by GRPO (DAPO, Dr. GRPO): "
             "rollouts on rocktune's own generation path, no vLLM", frozenset({"lm", "grpo"}),
             "rocktune.tasks.grpo.task:GRPOTask", "rocktune.tasks.grpo.launch"),
    TaskSpec("vlm", "LoRA for a vision-language model's language model (Qwen2.5-VL, Qwen3-VL) on conversations "
             "with images; the vision tower and projector frozen", frozenset({"vlm"}),
             "rocktune.tasks.vlm.task:VLMTask", "rocktune.tasks.vlm.launch", vision=True),
    TaskSpec("video-lora", "LoRA for a Wan 2.1/2.2 text-to-video transformer on clips with captions",
             frozenset({"diffusion"}), "rocktune.tasks.wan.task:WanTask", "rocktune.tasks.wan.refuse",
             diffusion=True),
    TaskSpec("image-lora", "LoRA for a Wan 2.1/2.2 transformer on still images with captions",
             frozenset({"diffusion"}), "rocktune.tasks.wan.task:WanTask", "rocktune.tasks.wan.refuse",
             diffusion=True),
)}
NAMES: tuple[str, ...] = tuple(TASKS)
DIFFUSION: tuple[str, ...] = tuple(n for n, s in TASKS.items() if s.diffusion)
TEXT: tuple[str, ...] = tuple(n for n, s in TASKS.items() if "lm" in s.tags)  # tokenised text on a causal LM


def spec(name: str) -> TaskSpec:
    return TASKS[name]


def load(target: str):
    """The object a ``module:attribute`` (or ``module``) string names, imported now, in the process that needs it."""
    module, _, attr = target.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded
