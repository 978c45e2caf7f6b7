"""The tasks rocktune trains: one table keyed by ``task:``. Every other place derives from it: the config's choices,
its task sections and which of its keys apply (config.py's field tags), the CLI's ``--task`` choices (train, plan,
data preview, demo), the refusals before launch, the task object the worker builds (tasks/__init__.py), the report's
loss label and config sections, the model card's loading lines, export's prompt style and docs/architecture.md's list.

Standard library only: the config and the launching process read it without importing torch. A task's code is named
by ``module:attribute`` hooks and imported only where it runs (``load``), so adding a task is its folder plus one row
here; no caller tests a task's name. The hooks (each a ``module:attribute`` string):

- ``builder``: the task object with train/task.py's hooks (tasks/base.py's ``TaskBase`` gives the usual defaults)
- ``launch``: a module with ``refuse(cfg, options)`` and ``precheck(cfg)``, run in the launching process, torch-free
- ``sections``: the config sections the task reads, ``key=module:Class`` (a pydantic section); config.py composes
  ``RunConfig`` from the union of every row's sections, and a section's key is the tag its fields apply to
- ``preview``: ``preview(cfg, n_show, as_json, html) -> int``, ``rocktune data preview -c CONFIG`` for this task
  (the previews live in report/ or the task's data package: tasks/ may not import report/)
- ``plan``: ``plan(args) -> int``, ``rocktune plan --task NAME``
- ``demo``: ``demo(args) -> int``, ``rocktune demo --task NAME`` ("" = no demo: not among the demo's choices;
  the demos live in demo/)
- ``report``: a ``ReportHooks`` (the loss plot's label; the samples section's note when a run logs no samples)
- ``card``: ``card(base, run_dir, data) -> str``, the model card's "how to load it" lines
- ``style``: ``style(run_config) -> str | None``, the prompt style export and generate use ("" = the data's format)
- ``generate``: ``module:function`` of the task's own generate path ("" = the causal LM's): the diffusion and
  vision-language tasks are the rows with theirs (``DIFFUSION``, ``VISION`` derive from it)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any


@dataclass(frozen=True)
class TaskSpec:
    name: str  # the value of ``task:``
    summary: str  # one line: what it trains (--help, the config's description, docs)
    tags: frozenset[str]  # the config field tags that apply (config.py ``only``); untagged fields apply to all
    builder: str  # "module:Class" of the task object with train/task.py's hooks, built in the worker
    launch: str  # module with refuse(cfg, options) and precheck(cfg): run in the launching process, torch-free
    sections: tuple[str, ...] = ()  # "key=module:Class": the config sections it reads (config.py composes them)
    preview: str = "rocktune.report.preview_view:run_config_preview"  # data preview -c CONFIG
    plan: str = "rocktune.tasks.causal.hooks:plan"  # rocktune plan --task NAME
    demo: str = ""  # rocktune demo --task NAME ("": none)
    report: str = "rocktune.tasks.causal.hooks:REPORT"  # a ReportHooks
    card: str = "rocktune.tasks.causal.hooks:card"  # the model card's loading lines
    style: str = ""  # export's prompt style of a run ("": from the data's format, the LM default)
    generate: str = ""  # the task's own generate path ("": the causal LM's)
    docs: str = "docs/data.md"  # where its settings are described (the refusal of a key that does not apply)


@dataclass(frozen=True)
class ReportHooks:
    """What ``rocktune report`` says differently for a task."""

    loss_label: str = "cross-entropy per loss-bearing token"  # the loss plot's y label (when every run agrees)
    no_samples: str = ""  # HTML of the samples section when the run logged none ("": the default line)
    # "module:function" hooks in the task's report/ sub-folder (the report layer), "" for none:
    plots: str = ""  # (runs) -> {name: (title, PNG bytes)}: the task's own plots, after the common ones
    summary: str = ""  # (run) -> {label: value}: its lines in the summary table
    samples: str = ""  # (run) -> the HTML of its samples section, or "" for the default one


_LM_LAUNCH = "rocktune.tasks.causal.launch"  # the causal-LM kit's checks: lm, dpo, orpo
_WAN_GENERATE = "rocktune.tasks.wan.diffusion.generate_cli:main"  # Wan: video files, the ComfyUI LoRA
_VLM_GENERATE = "rocktune.tasks.vlm.export.vision_generate:run_generate_vision"  # generate --image
_PREFERENCE: dict[str, Any] = dict(sections=("preference=rocktune.tasks.preference.config:PreferenceConfig",),
                   preview="rocktune.tasks.preference.preview:run_pair_preview",
                   plan="rocktune.tasks.preference.hooks:plan",
                   report="rocktune.tasks.preference.hooks:REPORT", docs="docs/preference.md")
_WAN: dict[str, Any] = dict(sections=("diffusion=rocktune.tasks.wan.config:DiffusionConfig",),
                            preview="rocktune.tasks.wan.diffusion.preview:run_media_preview",
                            plan="rocktune.tasks.wan.hooks:plan", report="rocktune.tasks.wan.hooks:REPORT",
            card="rocktune.tasks.wan.hooks:card", generate=_WAN_GENERATE, docs="docs/diffusion.md")
TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (
    TaskSpec("lm", "LoRA for a causal language model on chat, instruction or text data (supervised, the default)",
             frozenset({"lm", "sft"}), "rocktune.tasks.lm.task:LMTask", _LM_LAUNCH,
             demo="rocktune.demo.run:demo"),
    TaskSpec("dpo", "preference tuning of a causal LM's LoRA on chosen/rejected pairs by DPO (the reference is the "
             "model with its adapter switched off)", frozenset({"lm", "preference", "dpo"}),
             "rocktune.tasks.preference.task:PreferenceTask", _LM_LAUNCH, **_PREFERENCE,
             demo="rocktune.tasks.preference.demo.run:demo"),
    TaskSpec("orpo", "preference tuning of a causal LM's LoRA on chosen/rejected pairs by ORPO (odds ratio plus the "
             "chosen answer's likelihood; no reference)", frozenset({"lm", "preference"}),
             "rocktune.tasks.preference.task:PreferenceTask", _LM_LAUNCH, **_PREFERENCE),
    TaskSpec("grpo", "reinforcement learning of a causal LM's LoRA with verifiable rewards by GRPO (DAPO, Dr. GRPO): "
             "rollouts on rocktune's own generation path, no vLLM", frozenset({"lm", "grpo"}),
             "rocktune.tasks.grpo.task:GRPOTask", "rocktune.tasks.grpo.launch",
             sections=("grpo=rocktune.tasks.grpo.config:GRPOConfig",),
             preview="rocktune.tasks.grpo.preview:run_prompt_preview",
             plan="rocktune.tasks.grpo.hooks:plan", demo="rocktune.tasks.grpo.demo.run:demo",
             report="rocktune.tasks.grpo.hooks:REPORT", style="rocktune.tasks.grpo.hooks:style", docs="docs/rl.md"),
    TaskSpec("vlm", "LoRA for a vision-language model's language model (Qwen2.5-VL, Qwen3-VL) on conversations "
             "with images; the vision tower and projector frozen", frozenset({"vlm"}),
             "rocktune.tasks.vlm.task:VLMTask", "rocktune.tasks.vlm.launch",
             preview="rocktune.tasks.vlm.preview:run_vision_preview",
             plan="rocktune.tasks.vlm.hooks:plan",
             card="rocktune.tasks.vlm.hooks:card", generate=_VLM_GENERATE, docs="docs/vision.md"),
    TaskSpec("video-lora", "LoRA for a Wan 2.1/2.2 text-to-video transformer on clips with captions",
             frozenset({"diffusion"}), "rocktune.tasks.wan.task:WanTask", "rocktune.tasks.wan.refuse", **_WAN),
    TaskSpec("image-lora", "LoRA for a Wan 2.1/2.2 transformer on still images with captions",
             frozenset({"diffusion"}), "rocktune.tasks.wan.task:WanTask", "rocktune.tasks.wan.refuse", **_WAN),
)}
# The tuples derived from TASKS are read from it at each access (a module ``__getattr__``), never cached at import:
# a row added later (a plug-in, a test's ``monkeypatch.setitem(TASKS, ...)``) is in them at once.
_DERIVED = {
    "NAMES": lambda: tuple(TASKS),
    "DIFFUSION": lambda: tuple(n for n, s in TASKS.items() if s.generate == _WAN_GENERATE),
    "VISION": lambda: tuple(n for n, s in TASKS.items() if s.generate == _VLM_GENERATE),
    "TEXT": lambda: tuple(n for n, s in TASKS.items() if "lm" in s.tags),  # tokenised text on a causal LM
}
if TYPE_CHECKING:
    NAMES: tuple[str, ...]
    DIFFUSION: tuple[str, ...]
    VISION: tuple[str, ...]
    TEXT: tuple[str, ...]


def __getattr__(name: str) -> tuple[str, ...]:
    if name in _DERIVED:
        return _DERIVED[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def spec(name: str) -> TaskSpec:
    return TASKS[name]


def demos() -> tuple[str, ...]:
    """The tasks ``rocktune demo --task`` offers: the rows with a demo hook."""
    return tuple(n for n, s in TASKS.items() if s.demo)


def sections() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Config section key -> (its ``module:Class``, the tasks that read it), over every row."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name, row in TASKS.items():
        for entry in row.sections:
            key, _, target = entry.partition("=")
            out[key] = (target, out.get(key, (target, ()))[1] + (name,))
    return out


def load(target: str) -> Any:
    """The object a ``module:attribute`` (or ``module``) string names, imported now, in the process that needs it."""
    module, _, attr = target.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded
