"""The typed run configuration: the single source of defaults.

A YAML file only overrides fields; dotted ``key=value`` overrides on the command line apply last. Every error
names the key path (and the YAML file:line when the key came from a file) and what is allowed.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

import yaml
from pydantic import (BaseModel, Field, PositiveInt, ValidationError, create_model, field_validator,
                      model_validator)

from rocktune.dtypes import canonical
from rocktune.errors import UserError, first_line
from rocktune.readers.yaml_file import read_yaml
from rocktune import task_registry
from rocktune.task_registry import TaskSpec
from rocktune.config_base import _Section, home, only  # noqa: F401 (only: the tag, used by the sections)


class ModelConfig(_Section):
    name_or_path: str = Field("Qwen/Qwen2.5-0.5B-Instruct", description="HF hub id or local directory of a causal LM.")
    trust_remote_code: bool = Field(False, description="Run Python code shipped with the model (off: it executes).",
        json_schema_extra=only("lm"))
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "varlen", "flex_attention"] = Field(
        "auto", description="Attention kernel; auto: varlen on a GPU over packed rows when its self-test passes, "
        "else flex attention (compile on), else the platform advice (sdpa). task=vlm: auto, varlen or sdpa, for the "
        "language model (the vision tower keeps sdpa).",
        json_schema_extra=only("lm", "vlm", harmless=("sdpa",))
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    liger: Literal["auto", "on", "off"] = Field(
        "auto", description="Liger fused kernels (RMSNorm, SwiGLU, RoPE); auto: on for ROCm/CUDA when installed.",
        json_schema_extra=only("lm", harmless=("off",))
    )
    quantization: Literal["none", "nf4", "fp4", "int8"] = Field(
        "none", description="QLoRA: load the base's linear weights quantised by bitsandbytes (nf4/fp4 4-bit, int8 "
        "LLM.int8); computation follows training.precision. Refused before loading where the platform knowledge "
        "says the installed bitsandbytes cannot run it (docs/qlora.md). Needs the qlora extra.",
        json_schema_extra=only("lm")
    )
    double_quant: bool = Field(
        True, description="nf4/fp4: quantise the per-block scales too (about 0.4 bit per weight less memory).",
        json_schema_extra=only("lm")
    )

    vision_patch_embed: Literal["auto", "conv3d", "linear"] = Field(
        "auto", description="task=vlm: how the vision tower's patch embedding runs. conv3d: the model's own Conv3d; "
        "linear: the same projection as one matmul (stride equals kernel, so the two are equal; the weights and saved "
        "files unchanged), for ROCm builds where that Conv3d was reported to crash; auto: conv3d, with the platform "
        "knowledge's note where it applies.", json_schema_extra=only("vlm"))

    @field_validator("name_or_path", mode="before")
    @classmethod
    def expand_home(cls, value):
        return home(value)


class LoraConfig(_Section):
    r: int = Field(16, gt=0, le=4096, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear' for every linear layer but the head."
    )
    vision: Literal["none", "projector", "all"] = Field(
        "none", description="task=vlm with target_modules all-linear: LoRA on the vision side too. none: the language "
        "model only (the vision tower and projector frozen); projector: also the projector (the merger that maps "
        "image features into the language model); all: also every linear layer of the vision tower.",
        json_schema_extra=only("vlm"))
    train_router: bool = Field(
        False, description="Mixture-of-experts models: train the routers (the gates that pick each token's experts) "
        "too, as full weights saved with the adapter. Off by default: a moved router re-routes tokens to experts the "
        "adapter did not train for them, and the expert load (metrics, report) shows the shift.",
        json_schema_extra=only("lm"))


class DataConfig(_Section):
    train_file: str | None = Field(
        None, description="Training data. LM: a JSON/JSONL, parquet, CSV or Arrow file, a datasets save_to_disk "
        "folder, or a hub dataset id (see split/subset/revision; offline: the local datasets cache); docs/data.md, "
        "shapes in the README. Video/image LoRA: a media folder or manifest (docs/diffusion.md)."
    )
    eval_file: str | None = Field(None, description="Separate eval data, any kind train_file takes; when absent "
                                  "eval_fraction is split off.")
    columns: dict[str, str] = Field(
        default_factory=dict, description="Source column for each record key the shape needs, e.g. {prompt: "
        "question, completion: answer} (keys: text, prompt, completion, instruction, input, output, messages, "
        "conversations, system, tools, history; dpo/orpo also chosen, rejected; vlm: messages, conversations, "
        "images, image).",
        json_schema_extra=only("lm", "vlm"),
    )
    roles: dict[str, Literal["system", "user", "assistant", "tool", "function_call"]] = Field(
        default_factory=dict, description="Role tags of a conversation mapped to roles, on top of the known ones "
        "(ShareGPT's human/gpt/system/function_call/observation and OpenAI's user/assistant/system/tool), e.g. "
        "{bot: assistant, customer: user}; a role is one of system, user, assistant, tool, function_call.",
        json_schema_extra=only("sft"),
    )
    chat_template: str = Field(
        "auto", description="Render Alpaca and prompt/completion records through the model's chat template as "
        "single-turn conversations. auto: Alpaca yes where the tokenizer has a template (as LLaMA-Factory does), "
        "prompt/completion no (as TRL does); always; never. Or a .jinja file: the chat template to use instead of "
        "the tokenizer's (e.g. one that renders tools), as auto otherwise; or builtin-tools: rocktune's own "
        "tool-calling template in the model's turn format (ChatML, Llama 3 or Gemma turns), for a model whose "
        "template ignores tools; it adds no system prompt or identity of its own (docs/data.md). Export and "
        "generate follow what was trained.", json_schema_extra=only("lm"),
    )
    tools: Literal["render", "drop"] = Field(
        "render", description="Tool lists, assistant tool calls and tool results of conversations. render: through "
        "the chat template, and a record whose tools or calls the template does not render is refused (it would "
        "train empty answers; chat_template: builtin-tools renders them for a model whose template does not); "
        "drop: removed before rendering (a conversation left without an answer is dropped, counted), to train a "
        "template without tool support on the text turns alone.",
        json_schema_extra=only("sft"),
    )
    text_split: Literal["auto", "document", "paragraph", "line"] = Field(
        "auto", description="Plain .txt/.md files and folders of them: one example per file (document), per "
        "blank-line block (paragraph) or per line. auto: document for a folder, paragraph for a single file.",
        json_schema_extra=only("sft"),
    )
    text_stride: PositiveInt | None = Field(
        None, description="Text data (documents: text records, a text column, .txt/.md): each document is cut into "
        "windows of max_length tokens starting every text_stride tokens; a token an earlier window trained is "
        "context in the next, never trained twice. Default max_length - 1 (one token of context, every token "
        "trained once); smaller: more context per window, more windows.", json_schema_extra=only("sft")
    )
    split: str = Field("train", description="Split of a hub dataset or save_to_disk DatasetDict for train_file.",
        json_schema_extra=only("lm", "vlm"))
    eval_split: str = Field("validation", description="Split of eval_file when it is a hub id or DatasetDict folder.",
        json_schema_extra=only("lm", "vlm"))
    subset: str | None = Field(None, description="Subset (configuration) of a hub dataset.",
        json_schema_extra=only("lm", "vlm"))
    revision: str | None = Field(None, description="Revision (branch, tag or commit) of a hub dataset.",
        json_schema_extra=only("lm", "vlm"))
    streaming: bool = Field(
        False, description="Read the source as a stream (datasets' IterableDataset): no Arrow copy of it is made "
        "first; batches are tokenised over num_proc processes as they arrive. For sets larger than the room for a "
        "copy; a streamed hub id needs the network.", json_schema_extra=only("sft")
    )
    num_proc: PositiveInt | None = Field(
        None, description="Processes that tokenise; default: all of the machine's cores (a small set uses one).",
        json_schema_extra=only("sft")
    )
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of train_file held out for eval.")
    format: Literal["auto", "text", "prompt_completion", "messages", "alpaca"] = Field(
        "auto", description="Record shape; auto detects it per file from the first record's keys.",
        json_schema_extra=only("sft")
    )
    max_length: int = Field(1024, gt=1, description="Tokens per example; longer examples are truncated (counted); "
        "text documents are cut into windows of this length instead (text_stride).",
        json_schema_extra=only("lm", "vlm"))
    truncation: Literal["prompt", "end"] = Field(
        "prompt", description="How an example longer than max_length is cut. prompt: the start of the prompt (or the "
        "oldest turns) first, keeping its end next to the completion; the completion is cut at its end only when it "
        "alone does not fit (the prompt then keeps its last max_length/4 tokens). end: keep the first max_length "
        "tokens.", json_schema_extra=only("lm")
    )
    lossy_truncation: Literal["error", "drop", "keep"] = Field(
        "error", description="An example whose cut to max_length removes its system prompt, its tool list or any "
        "part of its last trained answer (what it was written to teach). error: a check failure (train stops; data "
        "preview names them, the lengths and the max_length that keeps them whole); drop: such examples are left out "
        "(counted in the notes); keep: trained as cut, with a warning. Shortening only older turns or a long prompt's "
        "start is not judged.", json_schema_extra=only("sft")
    )
    train_on_prompt: bool = Field(False, description="Put loss on prompt/user tokens too, not only on completions.",
        json_schema_extra=only("sft"))
    train_reasoning: bool = Field(
        False, description="Also train the reasoning a chat template writes as a message of its own ahead of the "
        "answer (gpt-oss's Harmony analysis channel, from a turn's thinking / reasoning_content). Off: the final "
        "answer and tool calls bear loss, the analysis is prompt. Reasoning inside the reply (Qwen3.5's think "
        "block) is trained as the template renders it either way (docs/data.md).", json_schema_extra=only("sft"))
    packing: bool = Field(
        False, description="Pack several examples per row (block-diagonal attention) instead of padded micro-batches; "
        "task=vlm: conversations with their images, rows of data.max_length tokens.",
        json_schema_extra=only("sft", "vlm")
    )
    batch_order: Literal["mixed", "length", "shuffled"] = Field(
        "mixed", description="How an epoch's examples are cut into micro-batches (batching=examples, not packed). "
        "mixed: each length is blurred by a random amount (up to 64 tokens + 25% of itself, drawn each epoch) "
        "before a length sort, so padding stays low where lengths differ widely while examples that differ by a "
        "word (a label, a class) are mixed as a shuffled loop mixes them. length: sorted by length (the least "
        "padding; where the answer decides the length, most micro-batches hold one answer and the model learns "
        "worse: docs/speed.md). shuffled: uniformly random micro-batches.",
        json_schema_extra=only("sft", "preference", "vlm"))
    cache_dir: str | None = Field(None, description="Tokenised-data cache; default: <output.dir>/../.rocktune_cache.")
    min_pixels: PositiveInt | None = Field(
        None, description="task=vlm: the fewest pixels an image is resized to (the image processor's min_pixels); "
        "default: the model's preprocessor_config.json.", json_schema_extra=only("vlm"))
    max_pixels: PositiveInt | None = Field(
        None, description="task=vlm: the most pixels an image is resized to (the image processor's max_pixels): "
        "bounds each image's tokens (one per 28x28 pixels on Qwen2.5-VL) and so the memory; default: the model's "
        "preprocessor_config.json.", json_schema_extra=only("vlm"))

    @field_validator("chat_template", mode="after")
    @classmethod
    def template_file(cls, value: str) -> str:
        if value in ("auto", "always", "never", "builtin-tools"):
            return value
        if not value.endswith(".jinja"):
            raise ValueError("must be auto, always, never, builtin-tools, or a chat template file ending in .jinja")
        # absolute, so that export and generate, run from elsewhere, find the template the run trained with
        return str(Path(home(value)).absolute())

    @field_validator("train_file", "eval_file", "cache_dir", mode="before")
    @classmethod
    def expand_home(cls, value):
        return home(value)


class TrainingConfig(_Section):
    epochs: float = Field(1.0, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps; overrides epochs.")
    micro_batch_size: int = Field(4, gt=0, description="Examples per forward/backward (batching=examples).")
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step. The global batch, in examples "
                            "per optimizer step, is micro_batch_size x grad_accum in either batching mode.")
    parallel: Literal["auto", "ddp", "fsdp"] = Field(
        "auto", description="Several processes (--nproc): ddp replicates the frozen base on every rank and all-reduces "
        "the adapter's gradients; fsdp shards the decoder layers' weights across ranks (FSDP2), for a base that does "
        "not fit one device. auto: ddp.", json_schema_extra=only("lm")
    )
    batching: Literal["auto", "examples", "tokens"] = Field(
        "auto", description="How a step's examples become forwards. examples: micro_batch_size examples per forward "
        "(in data.batch_order, or packed with data.packing); tokens: the step's examples packed without padding into "
        "rows of data.max_length, micro_batch_tokens per forward. auto: tokens on ROCm/CUDA (a GPU is bound by "
        "launches with small forwards), examples on CPU (small forwards are fastest there, per rocktune bench); "
        "task=vlm: examples on every device (tokens not yet measured there).",
        json_schema_extra=only("sft", "vlm", harmless=("examples",))
    )
    micro_batch_tokens: PositiveInt | Literal["auto"] = Field(
        "auto", description="Token budget of one forward with batching=tokens, rounded down to whole rows of "
        "data.max_length. auto: the planner's largest budget that fits the device (headroom kept), capped at what "
        "a step holds; on CPU 2 rows.", json_schema_extra=only("sft", "vlm")
    )
    lr: float = Field(2e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps.")
    scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; null disables.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 where the arch has bf16 matrix units, fp32 on CPU/gfx906. torch's names "
        "(float32, bfloat16, float16) are accepted for the same."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="cuda also means ROCm (HIP) builds.")
    seed: int = Field(42, description="Seed for model init of LoRA, data order and dropout.")
    eval_every: int = Field(50, ge=0, description="Optimizer steps between eval passes (0: only at start/end).")
    log_every: int = Field(1, gt=0, description="Optimizer steps between metrics.jsonl lines.")
    sample_count: int = Field(
        0, ge=0, description="Eval examples whose prompts (every token before the first loss-bearing one) are "
        "completed greedily at each eval pass (start, every eval_every steps, end); kept in samples.jsonl, shown in "
        "the progress output and the report (task=vlm: with the example's images). 0: none.",
        json_schema_extra=only("sft", "vlm")
    )
    sample_prompts: list[str] = Field(
        default_factory=list, description="Extra fixed prompts completed with the samples, rendered like the data's "
        "prompts (the chat template's user turn for messages data, the Alpaca template for alpaca data).",
        json_schema_extra=only("sft")
    )
    sample_max_new_tokens: int = Field(48, gt=0, description="Longest sample completion, in tokens.",
        json_schema_extra=only("sft", "vlm"))
    loss_impl: Literal["chunked", "full"] = Field(
        "chunked", description="chunked: head + cross-entropy only at loss positions, in chunks; full: HF logits.",
        json_schema_extra=only("sft")
    )
    optimizer: Literal["auto", "adamw_fused", "adamw_foreach", "adamw_torch"] = Field(
        "auto", description="AdamW implementation over the adapter; auto: fused on GPU, foreach on CPU."
    )
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the decoder. auto: on with batching=tokens where the platform knowledge "
        "calls it sound (Linux; CUDA sm_70+, Instinct gfx908+; never gfx906, RDNA not yet measured, never CPU); "
        "the first step then shows as compiling and is left out of tokens/s. A compile failure falls back to eager. "
        "Off by default with several processes (a rank cannot fall back alone).",
        json_schema_extra=only("sft", harmless=(False,))
    )
    loss_chunk_size: PositiveInt | Literal["auto"] = Field(
        "auto", description="Loss positions per cross-entropy chunk; bounds the fp32 logits held at once. auto: 256 "
        "on CPU (measured fastest there), 2048 on ROCm/CUDA (fewer, larger head matmuls; 1.2 GiB of fp32 logits at a "
        "152k vocabulary).", json_schema_extra=only("lm")
    )

    @field_validator("precision", mode="before")
    @classmethod
    def _torch_dtype_names(cls, value: object) -> object:
        return canonical(value)  # training.precision=float32 as well as fp32; others fail the Literal check


class ReliabilityConfig(_Section):
    save_every: int = Field(50, ge=0, description="Optimizer steps between checkpoints (0: only at the end).")
    keep_checkpoints: int = Field(2, gt=0, description="Checkpoints kept; older ones are deleted.")
    max_restarts: int = Field(3, ge=0, description="Times the supervisor restarts a crashed run from a checkpoint.")
    nan_patience: int = Field(3, gt=0, description="Non-finite steps in a row before rolling back to fp32.")
    zero_patience: int = Field(5, gt=0, description="Steps in a row with loss or gradients exactly 0 before stopping.")
    transfer_check_every: int = Field(
        100, ge=0, description="Verify the device copy of a batch against the host on the first 3 steps and every N."
    )
    collective_timeout_s: float = Field(
        600.0, gt=0, description="Several processes: seconds a collective may take before the rank gives up, names "
        "the ranks that stopped answering and stops the group (the supervisor restarts it from a checkpoint)."
    )
    preflight_timeout_s: float = Field(
        60.0, gt=0, description="Several processes: seconds for the start-up barrier and the test all-reduce."
    )
    rendezvous_timeout_s: float = Field(
        300.0, gt=0, description="Several nodes: seconds the nodes wait for each other (and for a free "
        "--master-port) before the missing ones are named and nothing is started; --rendezvous-timeout overrides."
    )
    min_free_disk_mb: int = Field(256, ge=0, description="Free space required beyond a checkpoint's own size.")
    check_path_every: int = Field(
        500, ge=0, description="The training-path tripwire: at steps 1 and 2 and every N, one small piece of the "
        "batch through the run's own forward and backward and through PEFT's reference forward must agree, and the "
        "update must move the adapter; otherwise the run stops with the cause (0: steps 1 and 2 only)."
    )


class OutputConfig(_Section):
    dir: str = Field("runs/default", description="Run directory: adapter, config, metrics.jsonl, checkpoints.")
    tensorboard: bool = Field(
        False, description="Also write TensorBoard event files to <dir>/tensorboard (loss, eval loss, lr, grad norm, "
        "tokens/s, memory, samples as text). Needs the tensorboard extra."
    )
    wandb: bool = Field(False, description="Also log to Weights & Biases through its own client (installed and "
                        "logged in by you; project rocktune, run named after dir).")
    mlflow: bool = Field(False, description="Also log to MLflow through its own client (MLFLOW_TRACKING_URI as you "
                         "set it; experiment rocktune).")

    @field_validator("dir", mode="before")
    @classmethod
    def expand_home(cls, value):
        return home(value)


class _RunConfigBase(_Section):
    """What every task's config has besides its fields (composed by ``compose`` from the registry)."""

    if TYPE_CHECKING:  # the fields compose() adds: the common sections, and the task sections (Any to mypy)
        task: str
        model: ModelConfig
        lora: LoraConfig
        data: DataConfig
        training: TrainingConfig
        reliability: ReliabilityConfig
        output: OutputConfig

        def __getattr__(self, name: str) -> Any: ...

    @property
    def spec(self) -> TaskSpec:
        """This run's row of task_registry.TASKS."""
        return task_registry.TASKS[self.task]

    @property
    def is_diffusion(self) -> bool:
        return self.task in task_registry.DIFFUSION

    @model_validator(mode="after")
    def _check_cross_fields(self) -> _RunConfigBase:
        if self.data.train_file is None:
            raise ValueError("data.train_file is required: the data to train on, a JSON/JSONL, parquet, CSV or Arrow "
                             "file, a save_to_disk folder or a hub dataset id (video-lora/image-lora: a folder of "
                             "media with .txt captions, or a JSONL manifest)")
        if self.is_diffusion and self.model.name_or_path == ModelConfig.model_fields["name_or_path"].default:
            raise ValueError(f"task={self.task} needs model.name_or_path set to a diffusers Wan checkpoint (hub id "
                             "such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers, or a local directory with model_index.json)")
        return self


# The task sections in the order saved config files have always had them; a new task's sections follow.
_SAVED_ORDER = ("diffusion", "preference", "grpo")


def compose() -> type[_RunConfigBase]:
    """The config model of the registry as it is now: ``task`` (one of its names), the sections every task has and
    the sections its rows list (``TaskSpec.sections``, loaded by ``module:Class``), each tagged with its key so that
    it applies to the tasks that list it (``only``)."""
    tasks = task_registry.TASKS
    fields: dict[str, Any] = {
        "task": (Literal[tuple(tasks)], Field(  # type: ignore[valid-type]
            "lm", description="What is trained. " + "; ".join(f"{n}: {s.summary}" for n, s in tasks.items())
            + ". docs/diffusion.md and docs/preference.md describe the non-default ones.")),
        **{key: (cls, Field(default_factory=cls)) for key, cls in (
            ("model", ModelConfig), ("lora", LoraConfig), ("data", DataConfig), ("training", TrainingConfig),
            ("reliability", ReliabilityConfig), ("output", OutputConfig))}}
    found = task_registry.sections()
    for key in sorted(found, key=lambda k: _SAVED_ORDER.index(k) if k in _SAVED_ORDER else len(_SAVED_ORDER)):
        cls = task_registry.load(found[key][0])
        fields[key] = (cls, Field(default_factory=cls, json_schema_extra=only(key)))
    return create_model("RunConfig", __base__=_RunConfigBase, __module__=__name__, **fields)


if TYPE_CHECKING:
    RunConfig = _RunConfigBase
else:
    RunConfig = compose()


def inapplicable(cfg: RunConfig) -> dict[str, list[str]]:
    """``key=value`` of every field set (to neither its default nor a harmless value) that does not apply to the
    run's task, by the fields' tags (``only``), grouped by the tasks it is for."""
    out: dict[str, list[str]]
    tags, out = cfg.spec.tags, {}
    for name, section_field in RunConfig.model_fields.items():
        section = getattr(cfg, name)
        if not isinstance(section, BaseModel):
            continue
        for key, field in type(section).model_fields.items():
            tag: Any = field.json_schema_extra or section_field.json_schema_extra  # the ``only`` tag's dict
            if not tag or tags & set(tag["tasks"]):
                continue
            value, default = getattr(section, key), field.get_default(call_default_factory=True)
            if value != default and value not in tag["harmless"]:
                for_tasks = ", ".join(n for n, s in task_registry.TASKS.items() if s.tags & set(tag["tasks"]))
                out.setdefault(for_tasks, []).append(f"{name}.{key}={value}")
    return out


def refuse_inapplicable(cfg: RunConfig) -> None:
    """Asked for explicitly, a setting that does nothing for this task is refused rather than ignored."""
    found = inapplicable(cfg)
    if found:
        said = "; ".join(f"{', '.join(keys)}: only for task={tasks}" for tasks, keys in found.items())
        raise UserError(f"{said}. Not supported for task={cfg.task} ({cfg.spec.docs} "
                        "lists what is); remove it from the config.")




def load_config(path: str | None, overrides: list[str] | None = None, require_paths: bool = False,
                base: dict[str, Any] | None = None) -> RunConfig:
    """Read YAML (optional), apply ``a.b=value`` overrides, validate; errors become ``UserError``.
    ``require_paths`` (``train``): every missing model/data path is an error here, with its file:line. ``base``:
    settings to start from instead of a file (``data preview --data FILE --model M``), overrides on top."""
    raw: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in (base or {}).items()}
    lines: dict[tuple[str, ...], int] = {}
    given: dict[tuple[str, ...], str] = {}  # key path -> the override that set it: errors name the override
    if path is not None:
        raw, lines = _read_yaml(Path(path))
    for item in overrides or []:
        given[_apply_override(raw, item)] = item
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_explain(exc, path, lines, given)) from None
    if path is not None:
        _check_relative_paths(cfg, Path(path), lines, given, require_paths)
    return cfg


def looks_like_path(name_or_path: str) -> bool:
    """A model name that can only be a filesystem path (a hub id is ``name`` or ``org/name``)."""
    return name_or_path.startswith(("/", "./", "../", "~", ".\\")) or name_or_path.count("/") > 1 \
        or "\\" in name_or_path


def _check_relative_paths(cfg: RunConfig, config_file: Path, lines: dict, given: dict, require: bool) -> None:
    """Relative paths mean the working directory, as on the command line; a file that exists only beside the config
    file is the classic slip, so that path is named. With ``require``, every missing input path at once, each with
    its file:line (or override) and the working directory that a relative path is read from."""
    problems = []
    for loc in (("model", "name_or_path"), ("data", "train_file"), ("data", "eval_file")):
        value = getattr(getattr(cfg, loc[0]), loc[1])
        if not value or Path(value).expanduser().exists():
            continue
        required = require and not (loc[0] == "model" and not looks_like_path(value))  # a hub id is no path
        key = ".".join(loc)
        what = f"model path {value}" if loc[0] == "model" else f"{key}={value}"
        where = f"override {given[loc]!r}" if loc in given else f"{config_file}:{lines.get(loc, '?')}"
        beside = config_file.parent / value
        if loc not in given and not Path(value).is_absolute() and config_file.parent != Path(".") and beside.exists():
            problems.append(f"{where}: {what} does not exist relative to the working directory {Path.cwd()}, "
                            f"which is what relative paths in a config file mean; relative to the config file it is "
                            f"{beside}, which exists: use that path, or run from {config_file.parent}")
        elif required and Path(value).is_absolute():
            problems.append(f"{where}: {what} does not exist")
        elif required:
            problems.append(f"{where}: {what} does not exist in the working directory {Path.cwd()}"
                            + ("" if loc in given or config_file.parent == Path(".") else
                               f" (nor beside the config file, as {beside})"))
    if problems:
        raise UserError("; ".join(problems) + ". Fix the paths (relative ones are read from the working directory), "
                        "or run from the directory they are relative to.")


def dump_config(cfg: RunConfig, comments: bool = False) -> str:
    """The config as YAML; with ``comments`` each field's description precedes it (``train --print-config``)."""
    data = cfg.model_dump(mode="json")
    if not comments:
        return yaml.safe_dump(data, sort_keys=False)
    import textwrap

    out = []
    for name, section in type(cfg).model_fields.items():
        if not (isinstance(section.annotation, type) and issubclass(section.annotation, BaseModel)):
            out += [f"# {line}" for line in textwrap.wrap(section.description or "", 112)]
            out += yaml.safe_dump({name: data[name]}, sort_keys=False).splitlines()
            continue
        out.append(f"{name}:")
        for key, field in section.annotation.model_fields.items():
            out += [f"  # {line}" for line in textwrap.wrap(field.description or "", 110)]
            out += [f"  {line}" for line in yaml.safe_dump({key: data[name][key]}, sort_keys=False).splitlines()]
    return "\n".join(out) + "\n"


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(_explain(exc, None, {})) from None


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], int]]:
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; pass an existing YAML file with -c (see examples/).")
    data, node = read_yaml(path, "see examples/ for a config's layout.")
    data = data or {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections (model:, lora:, data:, ...).")
    return data, _line_numbers(node)


def _line_numbers(node, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """Map each key path to its 1-based line in the YAML source, so errors can point at it."""
    out: dict[tuple[str, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (str(key_node.value),)
            out[path] = key_node.start_mark.line + 1
            out.update(_line_numbers(value_node, path))
    return out


def _apply_override(raw: dict[str, Any], item: str) -> tuple[str, ...]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UserError(f"override {item!r} is not of the form section.key=value (e.g. training.lr=2e-4).")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"override {item!r}: {part} is a value, not a section.")
        node = child
    # YAML scalar rules give the natural types: 2e-4 -> float, true -> bool, [a, b] -> list, null -> None.
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError as exc:
        raise UserError(f"override {item!r}: the value is not valid YAML ({first_line(exc)}); "
                        "quote it or close its brackets, e.g. lora.target_modules=[q_proj,v_proj].") from None
    if isinstance(parsed, str) and "," in parsed and _takes_list(tuple(parts)):
        parsed = [x.strip() for x in parsed.split(",") if x.strip()]  # q_proj,v_proj: the form plan --targets takes
    node[parts[-1]] = parsed
    return tuple(parts)


def _takes_list(loc: tuple[str, ...]) -> bool:
    section = _section_for(loc[:-1])
    field = section.model_fields.get(loc[-1]) if section else None
    if field is None:
        return False
    return get_origin(field.annotation) is list or any(get_origin(a) is list for a in get_args(field.annotation))


def _explain(exc: ValidationError, path: str | None, lines: dict[tuple[str, ...], int],
             given: dict[tuple[str, ...], str] | None = None) -> str:
    problems = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"] if not isinstance(p, int))
        key = ".".join(loc) or "(top level)"
        if given and loc in given:
            where = f"override {given[loc]!r}: "
        else:
            where = f"{path}:{lines[loc]}: " if path and loc in lines else ""
        if err["type"] == "extra_forbidden":
            section = _section_for(loc[:-1])
            allowed = ", ".join(section.model_fields) if section else ""
            close = _near_miss(loc)
            guess = f"did you mean '{close}'? " if close else ""
            problems.append(f"{where}unknown key '{key}'; {guess}allowed here: {allowed}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{where}{key}: {msg} (got {err.get('input')!r})")
    return "invalid config: " + "; ".join(problems)


# The names other fine-tuning tools (transformers' TrainingArguments, PEFT, TRL, Axolotl, LLaMA-Factory) give
# rocktune's keys: a key under any section with one of these names is pointed at rocktune's, wherever it lives.
ALIASES = {
    "learning_rate": "training.lr", "batch_size": "training.micro_batch_size",
    "per_device_train_batch_size": "training.micro_batch_size", "micro_batch": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.grad_accum", "gradient_accumulation": "training.grad_accum",
    "num_train_epochs": "training.epochs", "num_epochs": "training.epochs", "epoch": "training.epochs",
    "lr_scheduler_type": "training.scheduler", "lr_scheduler": "training.scheduler",
    "max_seq_length": "data.max_length", "sequence_len": "data.max_length", "cutoff_len": "data.max_length",
    "max_seq_len": "data.max_length", "dataset": "data.train_file", "data_path": "data.train_file",
    "lora_r": "lora.r", "rank": "lora.r", "lora_rank": "lora.r", "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout", "lora_target_modules": "lora.target_modules", "lora_target": "lora.target_modules",
    "model_name": "model.name_or_path", "base_model": "model.name_or_path",
    "model_name_or_path": "model.name_or_path", "output_dir": "output.dir",
}


def _near_miss(loc: tuple[str, ...]) -> str | None:
    """The key an unknown one most likely meant: another tool's name for it (``ALIASES``), the same name in another
    section (``training.max_length`` -> ``data.max_length``), or a spelling close to one of the section's keys."""
    name = loc[-1] if loc else ""
    target = ALIASES.get(name.lower().replace("-", "_"))
    if target is not None:  # named bare when it is in the same section, as a close spelling is
        return target.split(".", 1)[1] if target.split(".")[0] == ".".join(loc[:-1]) else target
    section = _section_for(loc[:-1])
    if section is None:
        return None
    close = difflib.get_close_matches(name, list(section.model_fields), n=1)
    if close:
        return close[0]
    if len(loc) > 1:  # the right key in the wrong section
        for other in RunConfig.model_fields:
            sub = _section_for((other,))
            if sub is not None and name in sub.model_fields:
                return f"{other}.{name}"
    return None


def _section_for(loc: tuple[str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model
