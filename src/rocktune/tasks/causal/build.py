"""Builders of the LM task's components: the base with its adapter and kernels, the collate, the idle batch."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from rocktune.data.batching import collate, with_loss_index
from rocktune.data.dataset import Examples
from rocktune.data.flat import collate_flat
from rocktune.data.packing import collate_packed
from rocktune.lora.lean import lean_lora
from rocktune.lora.moe import expert_path_note
from rocktune.kernels.attention import choose as choose_attention
from rocktune.models import mxfp4
from rocktune.models.load import DTYPES, apply_lora, load_model, sdpa_supported
from rocktune.models.targets import targets_note
from rocktune.tasks.causal.preflight import liger_gate
from rocktune.train.heartbeat import phase


def make_collate(examples: Examples, packing: bool, pad_id: int, one_row: bool = False, pin: bool = False,
                 width: int = 0, segments: bool = False, flat: tuple[int, int] | None = None):
    """Index structure from the stream -> host tensors; ``one_row`` joins packed rows into a single row, ``pin``
    puts them in page-locked memory (faster, asynchronous copies where the platform advice allows it), ``width``
    pads packed rows to at least that many tokens (static shapes), ``segments`` adds the document bounds that
    varlen attention reads (``cu_seq_lens``). ``flat``: (T, cu_seq_lens slots): each forward is one flat row
    (``data/flat.py``), its bounds padded to a fixed length."""
    def finish(batch):
        batch = with_loss_index(batch)
        return {k: v.pin_memory() for k, v in batch.items()} if pin else batch

    if packing:
        def collate_rows(rows):
            if flat:
                (row,) = rows
                return finish(collate_flat([(examples.input_ids[i], examples.labels[i]) for i in row], pad_id,
                                           *flat))
            rows = [[i for row in rows for i in row]] if one_row else rows
            return finish(collate_packed([[(examples.input_ids[i], examples.labels[i]) for i in row] for row in rows],
                                         pad_id, 0 if one_row else width, segments))
        return collate_rows

    def collate_idx(idx):
        return finish(collate([examples.input_ids[i] for i in idx], [examples.labels[i] for i in idx], pad_id))
    return collate_idx


def idle_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """One pad token with no loss position: a rank whose share of a small step is empty still runs one forward and
    backward (zero gradient), so DDP's once-per-step all-reduce sees every rank."""
    ids = torch.tensor([[pad_id]])
    return with_loss_index({"input_ids": ids, "labels": torch.full_like(ids, -100),
                            "position_ids": torch.zeros_like(ids)})


def attention(setting: str, ctx, packed: bool, compiled: bool, model_cfg) -> tuple[str, str | None]:
    """The attention implementation to load the model with, and why (``rocktune.kernels.attention.choose``): varlen is
    self-tested on the device in the run's precision before it is trusted. ``auto`` on a model class without an SDPA
    path (Gemma 2) takes eager instead of failing to load; an explicit sdpa is left to the loader's refusal."""
    attn, note = choose_attention(setting, ctx.attn, ctx.device, (packed, compiled), DTYPES[ctx.precision])
    if setting == "auto" and attn == "sdpa" and not sdpa_supported(model_cfg.name_or_path,
                                                                   model_cfg.trust_remote_code):
        return "eager", "attention: eager (this model's transformers class has no SDPA path, e.g. Gemma 2)"
    return attn, note


def model_with_adapter(model_cfg, lora_cfg, precision: str, attn_implementation: str, device: str,
                       compile_: bool) -> tuple[Any, list[str]]:  # the PEFT model
    """Base model on the device (quantised when asked, after ``quant_gate``), kernels patched, LoRA applied;
    returns it with notes on what was done. ``model_cfg``/``lora_cfg``: the config's ``model`` and ``lora``."""
    m = model_cfg
    phase(f"loading the model {m.name_or_path}")  # minutes for a large base: the heartbeat says so (train/heartbeat)
    model = load_model(m.name_or_path, precision, attn_implementation, m.trust_remote_code, device, m.quantization,
                       m.double_quant)
    use_liger, fusion_note = fusion(m.liger, device, compile_)
    notes = [fusion_note] if fusion_note else []
    notes += [n for n in (mxfp4.load_note(m.name_or_path, model),) if n]  # MXFP4 experts: what dequantising cost
    if use_liger:
        liger(model, m.liger, device)  # patches the base, so before PEFT wraps it
    model = apply_lora(model, lora_cfg.r, lora_cfg.alpha, lora_cfg.dropout, lora_cfg.target_modules,
                       m.gradient_checkpointing, train_router=lora_cfg.train_router)
    # what LoRA adapted and left out, by kind (models/targets.py), before lean_lora patches the forwards
    notes += [n for n in (targets_note(model), lean_lora(model)) if n]  # lean: fewer passes (docs/speed.md 6)
    notes += [n for n in (expert_path_note(model),) if n]  # which path the MoE expert stacks' LoRA takes
    if compile_:
        notes.append(compile_decoder(model))
    return model, notes


FUSION_NOTE = "fusion: "  # the note's prefix: the bench reads the choice from run_info.json's notes


def fusion(mode: str, device: str, compiled: bool) -> tuple[bool, str | None]:
    """Who fuses the elementwise work around the matmuls (RMSNorm, RoPE, SwiGLU, the LoRA and residual adds, the
    casts): (apply Liger's kernels, the note that says which and why). ``model.liger=auto`` under compile leaves it
    to Inductor: Liger's Triton kernels are opaque to Inductor, which can then fuse nothing across them (and its
    mutation analysis copies their inputs conservatively); that is the reasoning behind the default, not a
    measurement: ``rocktune`` against ``rt-liger`` in the bench measures it (docs/speed.md). Without compile, Liger
    where it can run (nothing else fuses); ``on``/``off`` are taken as given. An eager CPU run gets no note: there
    is nothing to choose."""
    liger_gate(device, mode)
    available = device == "cuda" and importlib.util.find_spec("liger_kernel") is not None
    use = mode == "on" or (mode == "auto" and available and not compiled)
    if use:
        what = ("liger (Liger's RMSNorm, SwiGLU and RoPE kernels"
                + (", opaque to Inductor: set model.liger=auto to let Inductor fuse the whole layer)" if compiled
                   else ")"))
    elif compiled:
        what = ("inductor (torch.compile fuses the whole layer; Liger left out" +
                (": its kernels are opaque to Inductor, model.liger=on to use them)" if mode == "auto" and available
                 else ")"))
    elif device != "cuda":
        return False, None
    else:
        what = "none (eager, no Liger" + ("" if mode == "off" else ": liger-kernel is not installed") + ")"
    return use, FUSION_NOTE + what


def liger(model, mode: str, device: str) -> str | None:
    """Patch Liger's fused RMSNorm/SwiGLU/RoPE into the model; returns a message, None when not applied."""
    liger_gate(device, mode)
    if mode == "off" or (mode == "auto" and (device != "cuda" or importlib.util.find_spec("liger_kernel") is None)):
        return None
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    # rocktune's own chunked loss already avoids full logits, so Liger's fused cross-entropy is not needed.
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True,
                                    fused_linear_cross_entropy=False, cross_entropy=False)
    return "liger kernels applied (RMSNorm, SwiGLU, RoPE)"


def want_compile(setting, platform_sound: bool, device: str, batching: str, world: int = 1) -> bool:
    """``training.compile: auto`` compiles only where the platform knowledge calls it sound, on a GPU fed fixed-width
    token rows (few distinct shapes, so few recompilations), in one process: a rank of several cannot fall back to
    eager alone when compilation fails. true/false are taken as given."""
    if setting != "auto":
        return bool(setting)
    return platform_sound and device == "cuda" and batching in ("auto", "tokens") and world == 1


def compile_refusal() -> str | None:
    """Why this torch's stack cannot compile the decoder (knowledge.yaml `stacks`), or None."""
    import torch

    from rocktune.platform.stack import compile_refusal as refusal

    return refusal(torch.__version__)


def uncompile_decoder(model) -> None:
    """Undo ``nn.Module.compile``: the module's plain forward is called again."""
    model.get_base_model().get_decoder()._compiled_call_impl = None


class _QuietMutationAnalysis(logging.Filter):
    """Compiling a decoder with Liger's Triton kernels, torch 2.11 logs a traceback per kernel per graph on
    ``torch._dynamo`` ("Encountered an exception in identify_mutated_tensors, assuming every input is mutated"): a
    conservative fallback whose results are correct, but it filled 8,659 lines of an 8-step run's log on an H200
    (docs/benchmarks.md). Only that message is dropped; graph breaks and recompiles still reach the log."""

    PREFIX = "Encountered an exception in identify_mutated_tensors"

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIX)


def quiet_compile_logs() -> None:
    dynamo = logging.getLogger("torch._dynamo")
    if not any(isinstance(f, _QuietMutationAnalysis) for f in dynamo.filters):
        dynamo.addFilter(_QuietMutationAnalysis())


def compile_decoder(model) -> str:
    base = model.get_base_model()
    quiet_compile_logs()
    base.get_decoder().compile()
    return "torch.compile applied to the decoder (the first steps include compilation)"
