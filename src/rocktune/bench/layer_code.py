"""One decoder layer with LoRA adapters, as rocktune builds it, compiled by Inductor: what the compiler made of it.

The step's time on a GPU goes to the elementwise work around the matmuls (casts, adds, norms: issue 36); Inductor
can fuse that work only where it sees it whole. This compiles one real layer (a tiny Qwen2 or Llama config, PEFT's
adapters on every linear, rocktune's lean LoRA forward, varlen attention over document bounds) for a forward and
backward and reads Inductor's output code: the graphs, the graph breaks, the recompiles, and the kernels it
generated (fused kernels it wrote, calls to library kernels such as matmuls). A regression (a graph break, an
adapter path the compiler cannot fuse) shows as more kernels before it shows as time. On a CPU the kernels are C++;
on a GPU Triton, with torch's own varlen kernel.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Inductor's output code defines each kernel it generated once (C++ on a CPU, Triton on a GPU) and calls library
# kernels (matmuls, the attention op's fallbacks) through extern_kernels.
_GENERATED = re.compile(r"^(\w+) = async_compile\.(?:cpp_pybinding|cpp|triton)\(", re.M)
_EXTERN = re.compile(r"extern_kernels\.(\w+)\(")
SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}


@dataclass(frozen=True)
class LayerCase:
    family: str  # qwen2 | llama
    widths: tuple[int, ...] = (256,)  # tokens of each call, one packed row of two documents each
    device: str = "cpu"


def kernels_in(code: str) -> dict:
    """Kernels of one Inductor output module: those it generated (by name), and library calls by op."""
    extern: dict[str, int] = {}
    for op in _EXTERN.findall(code):
        extern[op] = extern.get(op, 0) + 1
    return {"generated": len(set(_GENERATED.findall(code))), "extern": sum(extern.values()), "extern_ops": extern}


def build_layer(family: str, attn: str, device: str):
    """Layer 0 of a one-layer model of ``family``, LoRA on every linear, as rocktune applies it; and its rotary."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from rocktune.lora.lean import lean_lora
    from rocktune.models.load import apply_lora

    torch.manual_seed(0)
    config, cls = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    model = apply_lora(cls(config(**SHAPE, attn_implementation=attn)), 8, 16, 0.0, "all-linear", False)
    lean_lora(model)
    base = model.get_base_model().to(device)
    return base.model.layers[0], base.model.rotary_emb


def _call(layer, rotary, width: int, device: str) -> None:
    """A forward and backward over one packed row of two documents, bounds padded to a fixed length."""
    x = torch.randn(1, width, SHAPE["hidden_size"], device=device, requires_grad=True)
    first = width // 3
    pos = torch.cat([torch.arange(first), torch.arange(width - first)])[None].to(device)
    cu = torch.tensor([0, first, width, width], dtype=torch.int32, device=device)
    out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rotary(x, pos), cu_seq_lens_q=cu,
                cu_seq_lens_k=cu, max_length_q=width, max_length_k=width)
    (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()


def compiled_layer_code(case: LayerCase, cpu_kernel: Callable | None = None) -> dict:
    """Compile the case's layer with Inductor and call it at each width; what Dynamo and Inductor did. On a CPU the
    varlen kernel is ``cpu_kernel``, the compiler-opaque stand-in the caller brings (tests/varlen_standin.py's
    ``opaque_varlen``: a test's yardstick, so it lives with the tests); on a GPU torch's own kernel."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    from rocktune.bench.compiler import CompilerRecord
    from rocktune.kernels import attention

    if case.device == "cuda":
        name = attention.register()
    elif cpu_kernel is None:
        raise ValueError("on a CPU, pass the varlen kernel's compiler-opaque stand-in (tests/varlen_standin.py)")
    else:
        name = attention.register(cpu_kernel)
    layer, rotary = build_layer(case.family, name, case.device)
    torch._dynamo.reset()
    record = CompilerRecord().start()
    compiled = torch.compile(layer)
    # The first call's code is read (forward, then backward); the later calls show what new widths recompile.
    _, codes = run_and_get_code(_call, compiled, rotary, case.widths[0], case.device)
    for width in case.widths[1:]:
        _call(compiled, rotary, width, case.device)
    kernels = [kernels_in(c) for c in codes]
    return {"family": case.family, "device": case.device, "widths": list(case.widths), **record.report(),
            "forward": kernels[0] if kernels else None, "backward": kernels[1] if len(kernels) > 1 else None}
