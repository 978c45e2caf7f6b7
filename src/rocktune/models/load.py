"""Load the base model and tokenizer, choose the attention kernel, wrap with PEFT LoRA."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from rocktune.errors import UserError, first_line

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_model_source(name_or_path: str) -> None:
    """A string that looks like a filesystem path must exist; anything else is treated as a hub id."""
    from rocktune.config import looks_like_path

    looks_local = looks_like_path(name_or_path)
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise UserError(f"model path {name_or_path} does not exist; set model.name_or_path to a local model "
                        "directory or a hub id such as Qwen/Qwen2.5-0.5B-Instruct.")
    if not looks_local and not Path(name_or_path).exists():
        from rocktune.models.hub import check_hub_model

        note = check_hub_model(name_or_path)  # seconds, where a download without network retries for a minute
        if note:
            from rich.console import Console

            Console(stderr=True, highlight=False).print(f"[dim]{note}[/]")


def quiet_transformers() -> None:
    """rocktune draws its own progress; transformers' per-shard bars would interleave with it."""
    import warnings

    from transformers.utils import logging

    # PEFT still calls transformers' deprecated is_gradient_checkpointing; the warning is not the user's to fix.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    if "peft" in sys.modules:  # an adapter is about to be loaded (export, generate): PEFT must keep its names
        from rocktune.models.targets import keep_v5_names

        keep_v5_names()


def load_tokenizer(name_or_path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    quiet_transformers()
    check_model_source(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load the tokenizer of {name_or_path}: {first_line(exc)} "
                        "(offline? pass a local model directory)") from None
    if tok.pad_token_id is None:
        # Padding positions never carry loss or attention, so any id works; eos is always in the vocabulary.
        tok.pad_token = tok.eos_token
    return tok


def load_model(name_or_path: str, precision: str, attn_implementation: str, trust_remote_code: bool,
               device: str, quantization: str = "none", double_quant: bool = True):
    """``quantization`` nf4 | fp4 | int8 loads the linear weights quantised by bitsandbytes (the caller has run
    ``quant.gate``); they are quantised as they are placed on ``device``, so the full-precision base never is."""
    from transformers import AutoModelForCausalLM

    from rocktune.models import mxfp4

    check_model_source(name_or_path)
    _refuse_vision_checkpoint(name_or_path)
    if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UserError("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not "
                        "installed; use sdpa (the default) or install flash-attn for your GPU.")
    packed = mxfp4.load_kwargs(name_or_path, quantization)  # MXFP4 experts (gpt-oss): dequantised for LoRA
    extra = {}
    if quantization != "none":
        from rocktune.models import quant

        quant.check_installed(quantization)
        extra = {"quantization_config": quant.bnb_config(quantization, double_quant, DTYPES[precision]),
                 "device_map": {"": device}}  # quantised weights cannot be moved after loading
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=DTYPES[precision], attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code, **extra, **packed,
        )
    except (OSError, ValueError) as exc:
        if "attention implementation" in str(exc):  # e.g. Gemma 2 has no SDPA path: not a download problem
            raise UserError(f"model {name_or_path} cannot run with model.attn_implementation={attn_implementation}: "
                            f"{first_line(exc)} Set model.attn_implementation to auto (it picks one the model "
                            "supports) or eager.") from None
        _refuse_vision_checkpoint(name_or_path)  # a hub id's config.json is in the cache now
        raise UserError(f"could not load model {name_or_path}: {first_line(exc)} "
                        "(offline? pass a local model directory)") from None
    except RuntimeError:  # transformers: weights that do not fit the architecture config.json describes
        check_weight_shapes(name_or_path)
        raise
    model.config.use_cache = False  # the KV cache only costs memory during training
    model = model if extra else model.to(device)
    from rocktune.kernels import recurrent as recurrent_kernels

    recurrent_kernels.apply(model, device)  # Gated DeltaNet / Mamba2 layers: fast kernels that pass a self-test
    return model


def _refuse_vision_checkpoint(name_or_path: str) -> None:
    """A text task's model load of a vision-language checkpoint: the CLI refuses it first (``cli.vision_task``);
    this holds for every other way in (a hub id not yet in the cache then, the Python API)."""
    from rocktune.tasks.vlm.vision.families import text_task_refusal, vision_checkpoint

    found = vision_checkpoint(name_or_path)
    if found is not None:
        raise text_task_refusal("lm, dpo, orpo or grpo", "a text task loads its model as a causal LM",
                                f"model.name_or_path={name_or_path}", found[0])


def sdpa_supported(name_or_path: str, trust_remote_code: bool) -> bool:
    """Does transformers' class for this model have an SDPA path? Gemma 2's has none (its attention soft-capping is
    written for eager only); custom code and unreadable configs answer True and let the loader speak."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(name_or_path,
                                                                         trust_remote_code=trust_remote_code))]
    except Exception:  # noqa: BLE001 -- remote code, an unknown architecture, a missing file: load_model reports it
        return True
    return bool(getattr(cls, "_supports_sdpa", True))


def check_weight_shapes(name_or_path: str) -> None:
    """A local model whose weight files do not fit its config.json is refused with the tensors that differ
    (checked on a meta-device model: no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rocktune.models.check import shape_mismatches

    try:
        mismatched = shape_mismatches(name_or_path, AutoModelForCausalLM, AutoConfig.from_pretrained(name_or_path))
    except Exception:  # noqa: BLE001 -- custom code, an unknown architecture: the loader will say what it finds
        return
    if mismatched:
        raise UserError(f"model {name_or_path}: its weights do not fit its config.json ({'; '.join(mismatched)}): "
                        "the weight files and config.json come from different models, or a conversion went wrong. "
                        "Download the model again, or point model.name_or_path at a directory whose files belong "
                        "together.")


def apply_lora(model, r: int, alpha: float, dropout: float, target_modules, gradient_checkpointing: bool,
               experts: str = "grouped",
               train_router: bool = False):
    """``experts``: the path of the MoE expert stacks' LoRA (rocktune.lora.moe.EXPERT_PATHS): ``grouped`` computes
    it on the routed tokens only (docs/moe.md), ``peft`` leaves PEFT's parametrization (the reference)."""
    from peft import LoraConfig, get_peft_model

    from rocktune.models import routers

    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        from rocktune.models import quant

        model = quant.prepare(model, gradient_checkpointing)
    if gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs; input grads keep the graph alive through it.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    targets, expert_params = lora_targets(model, target_modules)
    if train_router:  # lora.train_router: the routers train as whole weights (PEFT's modules_to_save)
        routers.refuse_train_router(model)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        target_parameters=expert_params or None, task_type="CAUSAL_LM", bias="none",
                        modules_to_save=routers.router_names(model) if train_router else None)
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as exc:
        raise UserError(f"lora.target_modules={target_modules!r}: {first_line(exc)}") from None
    if expert_params:
        from rocktune.lora import moe

        moe.patch(peft_model, experts)
        if experts == "grouped" and getattr(model, "is_loaded_in_4bit", False):  # bitsandbytes holds no 3-D weight
            from rocktune.lora import moe_nf4

            moe_nf4.quantize_experts(peft_model, _bnb_4bit_type(model))
    # PEFT keeps adapters in fp32 by default (autocast_adapter_dtype): these are the fp32 master weights.
    return peft_model


def _bnb_4bit_type(model) -> str:
    """nf4 or fp4: the 4-bit format the dense linears were loaded in, for the expert stacks too."""
    qc = getattr(model.config, "quantization_config", None)
    found = qc.get("bnb_4bit_quant_type") if isinstance(qc, dict) else getattr(qc, "bnb_4bit_quant_type", None)
    return found or "nf4"


def lora_targets(model, target_modules) -> tuple[object, list[str]]:
    """``(target_modules, target_parameters)`` for PEFT. Anything but ``all-linear``: as configured. ``all-linear``
    (``rocktune.models.targets``): every nn.Linear but the head, the routers and the 1-wide gates, by role in the
    model; on MoE models also the experts' 3-D weights (transformers 5 stores them as parameters, not Linear layers)
    through PEFT's parameter targeting. A model with nothing to leave out keeps PEFT's own ``all-linear``."""
    from rocktune.models.targets import keep_v5_names, plan_targets

    keep_v5_names()  # a listed gate_proj/up_proj/down_proj too is the module of that name
    if target_modules != "all-linear":
        return target_modules, []
    plan = plan_targets(model, moe_expert_parameters(model))
    if not plan.experts and not plan.left_out:
        return target_modules, []
    return plan.module_targets(), plan.experts


def moe_expert_parameters(model) -> list[str]:
    """Names of the expert weight parameters of an MoE block (e.g. ``gate_up_proj``, ``down_proj``): the 3-D
    parameters, one matrix per expert, that transformers 5's fused expert modules hold."""
    stacks = [f"{owner}.{name}" if owner else name for owner, module in model.named_modules()
              for name, param in module.named_parameters(recurse=False)
              if param.dim() == 3 and type(module).__name__.endswith("Experts")]
    taken = set(stacks)
    others = [n for n, _ in model.named_parameters() if n not in taken]
    return sorted({_unique_suffix(n, others) for n in stacks})


def _unique_suffix(name: str, others: list[str]) -> str:
    """The shortest dotted tail of ``name`` that no other parameter's name ends with: PEFT matches
    ``target_parameters`` by suffix, and transformers 4's Granite MoE calls its stacks plain ``weight`` (every norm
    would match), while transformers 5's ``gate_up_proj`` / ``down_proj`` stay as they are."""
    parts = name.split(".")
    for k in range(1, len(parts) + 1):
        tail = ".".join(parts[-k:])
        if not any(o == tail or o.endswith("." + tail) for o in others):
            return tail
    return name


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]



# End-of-turn markers that end a reply even where the tokenizer's eos is another token (base models' <|endoftext|>)
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<end_of_turn>",
             "<end_of_utterance>")  # ... Gemma's, SmolVLM's


def stop_ids(tokenizer, model) -> list[int]:
    """The tokens that end a generated reply: eos, the generation config's eos, and the end-of-turn markers the
    vocabulary has (``rocktune generate`` and GRPO's rollouts stop alike)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids += [extra] if isinstance(extra, int) else list(extra or [])
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in TURN_ENDS if t in vocab]
    return list(dict.fromkeys(ids))
