"""Validate the planner against real training steps; prints one JSON object.

    python benchmarks/planner_validation.py            # CPU grid (tiny and small models), ~1 minute
    python benchmarks/planner_validation.py --gpu      # + predicted peak vs torch.cuda.max_memory_allocated
    python benchmarks/planner_validation.py --families # the 2025-26 families (OLMo 3, Qwen3.5, Gemma 4, Granite 4...)
    python benchmarks/planner_validation.py --widths   # released widths, few layers: Qwen3.5-2B, Granite-4.0-H-Tiny

CPU: one real training step (rocktune's LoRA wrapping, loss and AdamW) per grid point. Bytes saved for backward
are counted with ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage, parameters excluded; with
gradient checkpointing the tensors each checkpoint keeps for recomputation are counted too. Parameters, gradients
and optimizer states are counted from the tensors after the step. ``--widths`` also runs a second step under torch's
profiler (``profile_memory``: the CPU allocator's own events) and compares its highest point, plus the tensors alive
before it (weights, adapters, their gradients and AdamW states, the batch), with the plan's ``peak_allocated``.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager, nullcontext

import torch

from rocktune.planner.estimate import RunSpec, estimate
from rocktune.planner.shapes import shape_from_config
from rocktune.tasks.causal.moe_metrics import RouterWatch

TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True}
SMALL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 2048, "tie_word_embeddings": False}
QWEN3 = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024}
PHI3 = {"model_type": "phi3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024, "pad_token_id": 0}
# mixture-of-experts shapes (rocktune's grouped expert LoRA, lora/moe.py): routed experts, a shared expert and a
# dense first layer (GLM-4.5), expert and router biases (gpt-oss)
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
             "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "num_local_experts": 4,
           "num_experts_per_tok": 2}
GLM4_MOE = {"model_type": "glm4_moe", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
            "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "partial_rotary_factor": 0.5}
GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
           "num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"]}
LLAMA4 = {"model_type": "llama4_text", "hidden_size": 128, "intermediate_size": 64, "intermediate_size_mlp": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "vocab_size": 1024, "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
          "moe_layers": None}
# OLMo 3: sliding-window layers (a window shorter than the grid's sequences, so their mask is built) beside full ones
OLMO3 = {"model_type": "olmo3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "sliding_window": 32,
         "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}
# Qwen3.5: Gated DeltaNet (linear attention: a causal conv1d, the chunked delta rule, a gated RMSNorm) in three
# layers of four, gated full attention (q_proj twice as wide: the output gate) in the fourth; partial interleaved rope
QWEN35 = {"model_type": "qwen3_5_text", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
          "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                              "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
# Qwen3.5-MoE: Qwen3.5's layers with routed experts, a shared expert and its 1-wide gate in every MLP
QWEN35_MOE = {**QWEN35, "model_type": "qwen3_5_moe_text", "num_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96}
# Qwen3-Next: Qwen3.5-MoE's layout with the linear layers' projections fused (in_proj_qkvz, in_proj_ba)
QWEN3_NEXT = {**{k: v for k, v in QWEN35_MOE.items() if k != "rope_parameters"}, "model_type": "qwen3_next",
              "partial_rotary_factor": 0.25}
# Gemma 4: sliding layers of head_dim 32 (a window of 32), a full layer of global_head_dim 64, per-layer inputs of 16
GEMMA4 = {"model_type": "gemma4_text", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "global_head_dim": 64,
          "vocab_size": 1024, "vocab_size_per_layer_input": 1024, "hidden_size_per_layer_input": 16,
          "sliding_window": 32, "final_logit_softcapping": 30.0, "rope_parameters": None,
          "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}
# Granite 4: Mamba2 layers (4 heads of 32, state 16, chunks of 16) and an attention layer, 4 experts top-2 with a
# shared MLP in each
GRANITE4 = {"model_type": "granitemoehybrid", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "num_local_experts": 4,
            "num_experts_per_tok": 2, "shared_intermediate_size": 64, "position_embedding_type": "rope",
            "layer_types": ["mamba", "mamba", "mamba", "attention"], "mamba_n_heads": 4, "mamba_d_state": 16,
            "mamba_d_head": 32, "mamba_chunk_size": 16, "embedding_multiplier": 12.0, "logits_scaling": 8.0,
            "residual_multiplier": 0.22, "attention_multiplier": 0.0625}


def _preset(name: str, **changes) -> dict:
    from rocktune.planner.shapes import presets

    return {**{k: v for k, v in presets()[name].items() if k != "source"}, **changes}


# Released widths, fewer layers (`--widths`): Qwen3.5-2B's language model (hidden 2048, 8 query / 2 key-value heads of
# 256, Gated DeltaNet of 16 + 16 heads of 128, MLP 6144, vocabulary 248,320) in 8 of its 24 layers (two of its groups
# of three linear-attention layers and a full one); Granite-4.0-H-Tiny (hidden 1536, Mamba2 of 48 heads of 64 with a
# state of 128 in chunks of 256, 64 experts of 512 top-6 and a shared MLP of 1024, vocabulary 100,352, logits scaled)
# in 4 of its 40 layers, its first three Mamba2 layers and an attention layer
QWEN35_2B_8L = _preset("Qwen3.5-2B", num_hidden_layers=8)
GRANITE4_TINY_4L = _preset("granite-4.0-h-tiny", num_hidden_layers=4, layer_types=["mamba", "mamba", "mamba",
                                                                                     "attention"])
MODELS = {"tiny-qwen2": TINY, "small-llama": SMALL, "tiny-qwen3": QWEN3, "tiny-phi3": PHI3,
          "tiny-qwen3-moe": QWEN3_MOE, "tiny-mixtral": MIXTRAL, "tiny-glm4-moe": GLM4_MOE, "tiny-gpt-oss": GPT_OSS,
          "tiny-llama4": LLAMA4, "tiny-olmo3": OLMO3, "tiny-qwen3.5": QWEN35,
          "tiny-qwen3.5-moe": QWEN35_MOE, "tiny-qwen3-next": QWEN3_NEXT,
          "tiny-gemma4": GEMMA4, "tiny-granite4": GRANITE4,
          "qwen3.5-2b-8l": QWEN35_2B_8L, "granite4-h-tiny-4l": GRANITE4_TINY_4L}


def build(config: dict, precision: str, attn: str, r: int, dropout: float, ckpt: bool, device: str = "cpu"):
    """``attn`` "varlen" / "varlen-kv-copies": rocktune's GPU path (torch's varlen op, on a CPU through
    ``cpu_varlen``, with or without grouped-query K/V; the lean LoRA forward); a "-compiled" suffix compiles the
    decoder as a GPU run does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rocktune.lora.lean import lean_lora
    from rocktune.models.load import DTYPES, apply_lora

    varlen, compiled = attn.startswith("varlen"), attn.endswith("-compiled")
    if varlen:
        attn = cpu_varlen(kv_copies="-kv-copies" in attn)
    cfg = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=DTYPES[precision]).to(device)
    model.config.use_cache = False
    model = apply_lora(model, r=r, alpha=2 * r, dropout=dropout, target_modules="all-linear",
                       gradient_checkpointing=ckpt)
    if varlen:
        lean_lora(model)
    if compiled:
        model.get_base_model().get_decoder().compile()
    model.train()
    return model


@contextmanager
def grouped_experts(on: bool):
    """lora/moe.py's grouped expert path (torch's grouped_mm, a GPU's in bf16) on the CPU, whose bf16 kernel is a
    slow reference: what it saves is what the GPU's saves."""
    from rocktune.lora import moe

    own = moe._grouped_kernel
    if on:
        moe._grouped_kernel = lambda x, widths=(): x.dtype is torch.bfloat16
    try:
        yield
    finally:
        moe._grouped_kernel = own


def cpu_varlen(kv_copies: bool) -> str:
    """torch's own varlen op (``torch_attn::_varlen_attn``, its autograd and so what it saves) with a CPU kernel: the
    op has only CUDA kernels. ``kv_copies``: the glue sees a kernel without ``enable_gqa`` (torch 2.11) and repeats
    K/V. Returns the attention name to load a model with."""
    from torch.nn.attention import varlen as torch_varlen

    from rocktune.kernels.attention import register

    if not getattr(cpu_varlen, "registered", False):
        torch_varlen._varlen_attn.register_kernel("cpu")(_cpu_varlen_forward)
        torch_varlen._varlen_attn_backward.register_kernel("cpu")(_cpu_varlen_backward)
        cpu_varlen.registered = True
    kernel = torch_varlen.varlen_attn
    if kv_copies:
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            return torch_varlen.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                            window_size=window_size)
    return register(kernel)


def _segments(q, k, v, cu, scale):
    """Causal attention per document in fp32, K/V heads shared by their query group: (probabilities, values)."""
    for a, e in zip(cu.tolist(), cu.tolist()[1:]):
        qq, kk, vv = (t[a:e].transpose(0, 1).float() for t in (q, k, v))
        kk, vv = (t.repeat_interleave(qq.shape[0] // t.shape[0], 0) for t in (kk, vv))
        mask = torch.ones(e - a, e - a, dtype=torch.bool).tril()
        yield a, e, qq, kk, vv, torch.softmax((qq @ kk.transpose(-1, -2) * scale).masked_fill(~mask, -torch.inf), -1)


def _cpu_varlen_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                        window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    scale = scale or query.shape[-1] ** -0.5
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[1], query.shape[0], dtype=torch.float32)  # (heads, tokens), as CUDA's
    for a, e, qq, kk, _, p in _segments(query, key, value, cu_seq_q, scale):
        out[a:e] = (p @ value[a:e].transpose(0, 1).float().repeat_interleave(qq.shape[0] // value.shape[1], 0)
                    ).transpose(0, 1).to(query.dtype)
        lse[:, a:e] = torch.logsumexp((qq @ kk.transpose(-1, -2) * scale).masked_fill(
            ~torch.ones(e - a, e - a, dtype=torch.bool).tril(), -torch.inf), -1)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _cpu_varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                         rng_state, scale=None, window_size=None):
    scale = scale or query.shape[-1] ** -0.5
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32) for t in (query, key, value))
    groups = query.shape[1] // key.shape[1]
    for a, e, qq, kk, vv, p in _segments(query, key, value, cu_seq_q, scale):
        do = grad_out[a:e].transpose(0, 1).float()
        ds = p * (do @ vv.transpose(-1, -2) - (do * (p @ vv)).sum(-1, keepdim=True))
        dq[a:e] = (ds @ kk * scale).transpose(0, 1)
        n = e - a
        dk[a:e] = (ds.transpose(-1, -2) @ qq * scale).view(key.shape[1], groups, n, -1).sum(1).transpose(0, 1)
        dv[a:e] = (p.transpose(-1, -2) @ do).view(key.shape[1], groups, n, -1).sum(1).transpose(0, 1)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def make_batch(vocab: int, b: int, s: int, device: str = "cpu", seed: int = 0, packed: bool = False) -> dict:
    """``packed``: rows of documents with their bounds, as the token feed collates them for varlen attention."""
    g = torch.Generator().manual_seed(seed)
    if packed:
        return _packed_batch(vocab, b, s, g, device)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    labels = ids.clone()
    labels[:, : s // 4] = -100  # a prompt carries no loss
    if b > 1:  # dynamic padding: the first example is shorter
        mask[0, s - s // 3 :] = 0
        labels[0, s - s // 3 :] = -100
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


def _packed_batch(vocab: int, b: int, s: int, g: torch.Generator, device: str) -> dict:
    """b rows of s tokens: three documents in each (a quarter of each is prompt), the last row a third short."""
    from rocktune.data.batching import with_loss_index
    from rocktune.data.packing import collate_packed

    rows = []
    for r in range(b):
        fill = s - s // 3 if r == b - 1 and b > 1 else s
        docs = []
        for n in (fill // 2, fill // 3, fill - fill // 2 - fill // 3):
            ids = torch.randint(1, vocab, (n,), generator=g).tolist()
            docs.append((ids, [-100] * (n // 4) + ids[n // 4:]))
        rows.append(docs)
    return {k: v.to(device) for k, v in with_loss_index(collate_packed(rows, 0, s, segments=True)).items()}


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def measure_step(model, batch: dict, precision: str, device: str = "cpu", peak: bool = False) -> dict:
    """Run one training step; count saved-for-backward bytes and the training state. ``peak``: then a second step
    under the profiler, its CPU peak plus the tensors alive before it (``peak_bytes``)."""
    from rocktune.tasks.causal.loss import causal_lm_loss_sum

    params = {_storage_key(p)[0] for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr, n = _storage_key(t)
            if ptr not in params and n:
                saved[ptr] = n

    def pack(t):
        keep(t)
        return t

    for layer in model.base_model.model.model.layers:  # checkpoint inputs are kept alive outside the hooks
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if fn is not None and layer.gradient_checkpointing:
            layer._gradient_checkpointing_func = _counting(fn, keep)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, foreach=True)
    routers = RouterWatch.attach(model)  # MoE: the routing decides the padded expert path's size
    amp = precision != "fp32"

    def step(hooks=None) -> int:
        ctx = torch.autocast(device, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[precision]) if amp \
            else nullcontext()
        with hooks or nullcontext(), ctx:
            loss_sum, n = causal_lm_loss_sum(model, batch, chunk_size=1024)
        (loss_sum / n).backward()
        opt.step()
        return n

    n_tokens = step(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    state = [t for st in opt.state.values() for t in st.values() if t.dim() > 0]
    got = {"saved_bytes": sum(saved.values()), "expert_imbalance": _imbalance(routers),
           "lora_params_bytes": sum(p.numel() * p.element_size() for p in trainable),
           "lora_grads_bytes": sum(p.grad.numel() * p.grad.element_size() for p in trainable),
           "adamw_states_bytes": sum(t.numel() * t.element_size() for t in state),
           "base_weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad),
           "loss_tokens": n_tokens}
    if peak:  # the gradients are kept (the step accumulates into them), as the AdamW states are
        alive = sum(v for k, v in got.items() if k.endswith("_bytes") and k != "saved_bytes")
        alive += sum(t.numel() * t.element_size() for t in batch.values())
        got["peak_bytes"] = alive + _profiled_peak(step)
    return got


def _profiled_peak(step) -> int:
    """planner_validation_vlm.py's: the highest count of bytes allocated and not yet freed during ``step`` on the
    CPU, from the allocator's own events."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("planner_validation_vlm",
                                                  Path(__file__).with_name("planner_validation_vlm.py"))
    vlm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vlm)
    return vlm._profiled_peak(step)


def _imbalance(routers) -> float | None:
    """The busiest expert's routed rows over the mean, averaged over the MoE layers (None: a dense model)."""
    if routers is None:
        return None
    sums = list(routers.sums.values())
    routers.close()
    return sum(float(s.picks.max()) / (float(s.picks.sum()) / routers.experts) for s in sums) / len(sums)


def _counting(fn, keep):
    def wrapped(func, *args, **kwargs):
        for a in [*args, *getattr(func, "keywords", {}).values()]:
            for t in (a if isinstance(a, tuple) else (a,)):
                keep(t)
        return fn(func, *args, **kwargs)

    return wrapped


def predict(config: dict, b: int, s: int, r: int, precision: str, attn: str, ckpt: bool, dropout: float,
            loss_fraction: float, device: str, imbalance: float | None = None):
    spec = RunSpec(micro_batch=b, seq_len=s, lora_r=r, precision=precision, attn=attn.split("-")[0],
                   checkpointing=ckpt, lora_dropout=dropout, loss_fraction=loss_fraction,
                   device="cpu" if device == "cpu" else "gpu", kv_copies="-kv-copies" in attn,
                   compiled=attn.endswith("-compiled"), expert_imbalance=imbalance or 1.0)
    return estimate(shape_from_config(config), spec)


def run_point(name: str, b: int, s: int, r: int, precision: str, attn: str, ckpt: bool, dropout: float,
              peak: bool = False) -> dict:
    """``attn`` "...-grouped" (MoE, bf16): the GPU's grouped expert path, through torch's CPU grouped_mm kernel.
    ``peak``: a second step's CPU peak against the plan's allocated peak too."""
    torch.manual_seed(0)
    config = MODELS[name]
    grouped = attn.endswith("-grouped")
    attn = attn.removesuffix("-grouped")
    with grouped_experts(grouped):
        model = build(config, precision, attn, r, dropout, ckpt)
        batch = make_batch(config["vocab_size"], b, s, packed=attn.startswith("varlen"))
        if attn.endswith("-compiled"):
            measure_step(model, batch, precision)  # compiles; the second step is the one counted
        got = measure_step(model, batch, precision, peak=peak)
    # the planner takes the grouped path for a GPU in bf16 (saved bytes do not depend on the device otherwise)
    est = predict(config, b, s, r, precision, attn, ckpt, dropout, got["loss_tokens"] / (b * (s - 1)),
                  "cuda" if grouped else "cpu", got["expert_imbalance"])
    attn += "-grouped" if grouped else ""
    terms = est.by_name()
    row = {"model": name, "batch": b, "seq": s, "rank": r, "precision": precision, "attn": attn,
           "checkpointing": ckpt, "dropout": dropout, "saved_measured": got["saved_bytes"],
           "saved_predicted": est.saved_bytes}
    row["saved_error"] = (est.saved_bytes - got["saved_bytes"]) / got["saved_bytes"]
    row["state_exact"] = (terms["lora_params"], terms["lora_grads"], terms["adamw_states"],
                          terms["base_weights"]) == (got["lora_params_bytes"], got["lora_grads_bytes"],
                                                     got["adamw_states_bytes"], got["base_weights_bytes"])
    if peak:
        row.update(peak_measured=got["peak_bytes"], peak_predicted=est.peak_allocated,
                   peak_error=(est.peak_allocated - got["peak_bytes"]) / got["peak_bytes"],
                   terms={k: v for k, v in terms.items() if v})
    return row


# rocktune's GPU path, eager: torch's varlen op (its CPU kernel here) with and without grouped-query K/V, the lean
# LoRA forward; packed rows of three documents each
VARLEN_POINTS = [(m, b, s, r, p, a, c, 0.0) for m in ("tiny-qwen2", "small-llama") for b, s in ((1, 128), (4, 64))
                 for p in ("fp32", "bf16") for a, r, c in (("varlen", 16, False), ("varlen-kv-copies", 4, True))]
VARLEN_POINTS += [("tiny-qwen3", 2, 64, 8, "bf16", "varlen", False, 0.0),
                  ("tiny-phi3", 2, 64, 8, "bf16", "varlen", False, 0.0),
                  ("tiny-qwen2", 4, 64, 4, "bf16", "varlen", False, 0.1)]
# mixture-of-experts (lora/moe.py's expert LoRA): the padded path (fp32, the CPU) sized by the measured routing,
# the GPU's grouped path (bf16) through torch's CPU grouped_mm kernel; GLM-4.5's shared expert and dense first layer;
# Llama 4's dense routing on PEFT's own expert path (lora/moe.py leaves it; "-grouped" changes nothing there)
MOE_POINTS = [(m, b, s, r, p, a, c, 0.0) for m in ("tiny-qwen3-moe", "tiny-mixtral", "tiny-glm4-moe", "tiny-llama4")
              for b, s in ((1, 128), (4, 64)) for p, a in (("fp32", "sdpa"), ("bf16", "sdpa"), ("bf16", "sdpa-grouped"))
              for r, c in ((8, False), (4, True))]
# gpt-oss runs eager attention only (its sinks): its MoE block is counted, its eager attention is not modelled yet
GPT_OSS_POINTS = [("tiny-gpt-oss", 1, 128, 8, p, "eager", False, 0.0) for p in ("fp32", "bf16")]
# the 2025-26 families (issue 53): OLMo 3's sliding-window layers (a window of 32 under sequences of 64 and 128),
# Qwen3.5's Gated DeltaNet on transformers' torch reference path (and a length that is no multiple of its chunk),
# Gemma 4's two head widths and per-layer inputs; `--families`
FAMILY_POINTS = [(m, b, s, r, p, a, c, 0.0) for m in ("tiny-olmo3", "tiny-qwen3.5", "tiny-gemma4")
                 for b, s in ((1, 128), (4, 64)) for p, a in (("fp32", "sdpa"), ("bf16", "sdpa"), ("fp32", "eager"))
                 for r, c in ((8, False), (4, True))]
FAMILY_POINTS += [("tiny-qwen3.5", 2, 96, 8, p, "sdpa", False, 0.0) for p in ("fp32", "bf16")]
# Qwen3.5-MoE, Qwen3-Next and Granite 4 (Mamba2 on the torch reference scan): the padded expert path (fp32, bf16)
# and the GPU's grouped one (bf16, through torch's CPU grouped_mm); Granite 4 in eager attention too
FAMILY_POINTS += [(m, b, s, r, p, a, c, 0.0) for m in ("tiny-qwen3.5-moe", "tiny-qwen3-next", "tiny-granite4")
                  for b, s in ((1, 128), (4, 64))
                  for p, a in (("fp32", "sdpa"), ("bf16", "sdpa"), ("bf16", "sdpa-grouped"))
                  for r, c in ((8, False), (4, True))]
FAMILY_POINTS += [("tiny-granite4", b, s, r, "fp32", "eager", c, 0.0) for b, s in ((1, 128), (4, 64))
                  for r, c in ((8, False), (4, True))]
# released widths (`--widths`), batch 1, 256 tokens, with the step's CPU peak: fp32 and bf16, checkpointing off and on
WIDTH_POINTS = [(m, 1, 256, 8, p, "sdpa", c, 0.0) for m in ("qwen3.5-2b-8l", "granite4-h-tiny-4l")
                for p in ("fp32", "bf16") for c in (False, True)]
# compiled (about 2.5 minutes each on 2 cores): `--compiled`
COMPILED_POINTS = [("tiny-qwen2", 3, 64, 8, "bf16", "varlen-compiled", False, 0.0),
                   ("tiny-qwen2", 3, 64, 8, "bf16", "varlen-kv-copies-compiled", False, 0.0),
                   ("small-llama", 2, 64, 8, "bf16", "varlen-compiled", False, 0.0)]


def cpu_grid(quick: bool = False):
    if quick:
        points = [("tiny-qwen2", 1, 64, 8, "fp32", "sdpa", False, 0.0),
                  ("tiny-qwen2", 3, 48, 4, "bf16", "eager", False, 0.0),
                  ("tiny-qwen2", 2, 64, 16, "fp32", "eager", True, 0.1),
                  ("small-llama", 2, 96, 8, "bf16", "sdpa", False, 0.1),
                  ("small-llama", 1, 128, 8, "fp32", "sdpa", True, 0.0),
                  ("tiny-qwen3", 2, 64, 8, "fp32", "sdpa", False, 0.0),
                  ("tiny-phi3", 2, 64, 8, "bf16", "eager", False, 0.0)]
    else:
        # rank and dropout change only small terms: they alternate instead of multiplying the grid
        points = [(m, b, s, 16 if c else 4, p, a, c, 0.1 if (b == 4) == (p == "fp32") else 0.0)
                  for m in ("tiny-qwen2", "small-llama") for b, s in ((1, 128), (4, 64)) for p in ("fp32", "bf16")
                  for a in ("eager", "sdpa") for c in (False, True)]
        points += [(m, 2, 64, 8, p, a, c, 0.0) for m in ("tiny-qwen3", "tiny-phi3") for p in ("fp32", "bf16")
                   for a in ("eager", "sdpa") for c in (False, True)]
        points += VARLEN_POINTS + MOE_POINTS + GPT_OSS_POINTS
    return [run_point(*pt) for pt in points]


def run_nf4_point(name: str, b: int, s: int, r: int, ckpt: bool, tmp: str) -> dict:
    """An MoE model loaded as a run loads it with model.quantization nf4 (bitsandbytes' linear layers, lora/moe_nf4.py's
    expert stacks), bf16 autocast: saved bytes against the planner's (``tmp``: where the random model is saved)."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from rocktune.models.load import apply_lora, load_model

    config = MODELS[name]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32).save_pretrained(tmp)
    model = apply_lora(load_model(str(Path(tmp)), "bf16", "sdpa", False, "cpu", "nf4"), r, 2 * r, 0.0, "all-linear",
                       ckpt)
    model.train()
    got = measure_step(model, make_batch(config["vocab_size"], b, s), "bf16")
    spec = RunSpec(micro_batch=b, seq_len=s, lora_r=r, precision="bf16", quant="nf4", checkpointing=ckpt,
                   device="cpu", loss_fraction=got["loss_tokens"] / (b * (s - 1)),
                   expert_imbalance=got["expert_imbalance"] or 1.0)
    est = estimate(shape_from_config(config), spec)
    return {"model": name, "batch": b, "seq": s, "rank": r, "precision": "bf16", "attn": "sdpa-nf4",
            "checkpointing": ckpt, "dropout": 0.0, "saved_measured": got["saved_bytes"],
            "saved_predicted": est.saved_bytes,
            "saved_error": (est.saved_bytes - got["saved_bytes"]) / got["saved_bytes"], "state_exact": None}


# nf4 (a QLoRA base: the linear layers and, on the grouped path, the expert stacks in 4 bit; bf16 autocast)
NF4_POINTS = [(m, b, s, 8, c) for m in ("tiny-qwen3-moe", "tiny-glm4-moe") for b, s in ((1, 128), (4, 64))
              for c in (False, True)]


def gpu_check(preset: str, b: int, s: int, precision: str = "bf16", ckpt: bool = False) -> dict:
    """Random-init model of a preset's shape on the GPU: predicted allocated peak vs max_memory_allocated."""
    from rocktune.planner.shapes import presets

    config = {k: v for k, v in presets()[preset].items() if k != "source"}
    torch.manual_seed(0)
    model = build(config, precision, "sdpa", 8, 0.0, ckpt, device="cuda")
    batch = make_batch(config["vocab_size"], b, s, device="cuda")
    for _ in range(2):  # the second step has the optimizer states, as every later one does
        torch.cuda.reset_peak_memory_stats()
        got = measure_step(model, batch, precision, device="cuda")
    peak = torch.cuda.max_memory_allocated()
    est = predict(config, b, s, 8, precision, "sdpa", ckpt, 0.0, got["loss_tokens"] / (b * (s - 1)), "cuda")
    return {"model": preset, "batch": b, "seq": s, "precision": precision, "checkpointing": ckpt,
            "peak_measured": peak, "peak_predicted": est.peak_allocated,
            "peak_error": (est.peak_allocated - peak) / peak}


def markdown(rows: list[dict]) -> str:
    peak = all("peak_measured" in r for r in rows)
    lines = ["| model | b | s | r | precision | attn | ckpt | dropout | saved measured | predicted | error |"
             + (" peak measured | predicted | error |" if peak else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if peak else "")]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['seq']} | {r['rank']} | {r['precision']} | {r['attn']} "
                     f"| {'on' if r['checkpointing'] else 'off'} | {r['dropout']} | {r['saved_measured']:,} "
                     f"| {r['saved_predicted']:,} | {r['saved_error']:+.1%} |"
                     + (f" {r['peak_measured']:,} | {r['peak_predicted']:,} | {r['peak_error']:+.1%} |" if peak
                        else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 7-point subset")
    ap.add_argument("--gpu", action="store_true", help="also compare peaks on the GPU (needs one)")
    ap.add_argument("--markdown", action="store_true", help="print the CPU table as markdown instead of JSON")
    ap.add_argument("--compiled", action="store_true", help="only the compiled varlen points (slow: compilation)")
    ap.add_argument("--moe", action="store_true", help="only the mixture-of-experts points (~1 minute)")
    ap.add_argument("--families", action="store_true", help="only the 2025-26 families' points (issue 53)")
    ap.add_argument("--widths", action="store_true", help="only the released-width points, with the step's peak "
                    "(several minutes, about 6 GB)")
    args = ap.parse_args(argv)
    points = COMPILED_POINTS if args.compiled else MOE_POINTS + GPT_OSS_POINTS if args.moe else \
        FAMILY_POINTS if args.families else None
    rows = [run_point(*p, peak=True) for p in WIDTH_POINTS] if args.widths else \
        [run_point(*p) for p in points] if points else cpu_grid(args.quick)
    if args.moe:
        import tempfile

        rows += [run_nf4_point(*p, tempfile.mkdtemp()) for p in NF4_POINTS]
    out = {"cpu": rows, "max_abs_saved_error": max(abs(r["saved_error"]) for r in rows),
           "max_abs_peak_error": max((abs(r["peak_error"]) for r in rows if "peak_error" in r), default=None),
           "state_exact": all(r["state_exact"] for r in rows if r["state_exact"] is not None)}
    if args.gpu and torch.cuda.is_available():
        out["gpu"] = [gpu_check(p, b, s, prec, c) for p in ("Qwen2.5-0.5B", "Qwen2.5-1.5B")
                      for b, s, prec, c in ((1, 1024, "bf16", False), (4, 512, "bf16", True), (2, 512, "fp32", False))]
    print(markdown(rows) if args.markdown else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
