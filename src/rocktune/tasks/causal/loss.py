"""Loss numerics, in one tested place.

``causal_lm_loss_sum`` returns the *sum* of token losses and the number of loss-bearing tokens. The training loop
divides by the loss-bearing tokens of the whole optimizer step (``step_normalised``), so gradient accumulation gives
the same update as one big batch regardless of how tokens fall into micro-batches.

The fast path never materialises the full logits: it runs the backbone, keeps only positions whose next token
carries loss, and computes the output head and cross-entropy chunk by chunk, writing the gradient of the hidden
states during the forward pass (the base model's head is frozen under LoRA). For Qwen's 151,936-entry vocabulary the
full fp32 logits are the largest tensor of a small model; here at most ``chunk_size`` rows of them exist at once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rocktune.data.batching import count_loss_tokens
from rocktune.data.encode import IGNORE

# Packed batches carry position_ids and no attention_mask; padded ones carry an attention_mask.
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
# Configs with output transforms the fast path does not reproduce; such models take the full-logits path.
HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def decoder_and_head(base):
    """``base``'s decoder and output head, where the logits are the head applied to the decoder's last hidden
    states and nothing else; None for a model without that split or with an output transform (softcapping, logit
    scales)."""
    config = getattr(base, "config", None)
    plain = not any(getattr(config, name, None) not in (None, 1, 1.0) for name in HEAD_TRANSFORMS)
    if plain and hasattr(base, "get_decoder") and base.get_output_embeddings() is not None \
            and decoder(base) is not base:
        return decoder(base), base.get_output_embeddings()
    return None


def target_logps(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The log-probability of each target under ``head(hidden) / temperature`` (rows of hidden states, one target
    each), in fp32: the full logits exist for these rows only."""
    logits = head(hidden).float() / temperature
    return torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)


def hidden_and_head(model, inputs: dict):
    """The decoder's last hidden states and the output head (the head applied to scored positions only), or, for
    a model without that split (``decoder_and_head``), the full logits and an identity head."""
    split = decoder_and_head(model.get_base_model() if hasattr(model, "get_base_model") else model)
    if split is not None:
        return split[0](**inputs).last_hidden_state, split[1]
    return model(**inputs).logits, torch.nn.Identity()


def causal_lm_loss_sum(model, batch: dict[str, torch.Tensor], chunk_size: int = 1024,
                       fast: bool = True, compiled: bool = False,
                       max_document: int | None = None) -> tuple[torch.Tensor, int]:
    """``compiled``: the chunk body runs through torch.compile (``compiled_chunk``), as it does when the run
    compiles; otherwise eagerly (``eager_chunk``). ``max_document``: the longest segment varlen attention can meet
    (a flat stream's, ``data.flat.max_segment``); None: the row width."""
    labels = batch["labels"]
    targets = labels[:, 1:]
    index = batch.get("loss_index")  # host-computed (data.batching.with_loss_index): no device sync for sizes
    n_tokens = int(index.numel()) if index is not None else count_loss_tokens(labels)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if "cu_seq_lens" in batch:
        inputs.update(varlen_inputs(batch, max_document))
    if not (fast and _fast_path_ok(base)):
        logits = model(**inputs).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                               reduction="sum")
        return loss, n_tokens
    hidden = decoder(base)(**inputs).last_hidden_state[:, :-1]
    if index is not None:
        hidden, targets = hidden.flatten(0, 1).index_select(0, index), batch["loss_targets"]
    else:
        keep = targets != IGNORE
        hidden, targets = hidden[keep], targets[keep]
    head = base.get_output_embeddings()
    body = compiled_chunk() if compiled else eager_chunk
    loss = LinearCrossEntropy.apply(hidden, head.weight, head.bias, targets, chunk_size, body)
    return loss, n_tokens


def varlen_inputs(batch: dict[str, torch.Tensor], max_document: int | None = None) -> dict:
    """The keyword arguments transformers hands every attention layer for variable-length attention
    (rocktune.kernels.attention): the host-built document bounds, and ``max_document`` as the kernel's ``max_length``: a
    run's constant, which sizes the kernel's grid (a flat forward's width of tens of thousands of tokens would launch
    that many query blocks per document, nearly all empty). Without it the glue takes the row width from the
    query's shape inside the graph; either way no Python int that changes per batch reaches a compiled decoder.
    A flat forward (one row, data/flat.py) has its length marked dynamic: a compiled decoder then makes one graph
    for every width of the run instead of a static one first (half the compile time on a GPU)."""
    if batch["input_ids"].shape[0] == 1:
        for key in ("input_ids", "position_ids"):
            if key in batch:
                torch._dynamo.maybe_mark_dynamic(batch[key], 1)
    cu = batch["cu_seq_lens"]
    bound = {"max_length_q": max_document, "max_length_k": max_document} if max_document else {}
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, **bound}


def decoder(base):
    """The causal LM's decoder. Llama 4's text model keeps it as ``model`` while its base_model_prefix names
    ``language_model``: transformers' get_decoder then answers the causal LM itself, whose output has no hidden
    states to take."""
    found = base.get_decoder()
    return getattr(base, "model", found) if found is base else found


def _fast_path_ok(base) -> bool:
    config = getattr(base, "config", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if config is None or head is None or not hasattr(base, "get_decoder") or decoder(base) is base:
        return False
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in HEAD_TRANSFORMS):
        return False
    # A trainable (or LoRA-wrapped) head needs its weight gradient: leave that to autograd.
    return type(head) is torch.nn.Linear and not head.weight.requires_grad


# |softmax - onehot| <= 1 per entry, so a d/dlogits scaled by this keeps the fp16 matmul far below fp16's max.
FP16_SCALE = 2.0**12


def _grad_scale(dtype: torch.dtype) -> float:
    """In fp16, d/dh is taken before the GradScaler's scale is applied, so the small components of well-predicted
    tokens would flush to zero: the softmax gradient is scaled before the half-precision matmul and unscaled after,
    into fp32. bf16 has fp32's exponent range and needs no scale."""
    return FP16_SCALE if dtype == torch.float16 else 1.0


def _grad_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float16 else dtype


def eager_chunk(h, w, b, t, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's (sum of CE(h @ w^T + b, t), d/dh or None), op by op: the fp32 logits buffer is reused in place
    for the gradient, so one chunk x vocab fp32 tensor exists at a time (several passes over it, though)."""
    logits = F.linear(h, w, b).float()
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
    if not need_grad:
        return loss, None
    # d(sum CE)/d(logits) = softmax - onehot, reusing the logits buffer in place.
    grad = logits.sub_(lse[:, None]).exp_()
    grad[torch.arange(t.shape[0], device=t.device), t] -= 1.0
    scale = _grad_scale(h.dtype)
    if scale != 1.0:
        grad.mul_(scale)
    return loss, (grad.to(w.dtype) @ w).to(_grad_dtype(h.dtype)) / scale


def fused_chunk(h, w, b, t, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``eager_chunk``'s values written for a compiler: no in-place updates and no scatter, the onehot a comparison
    with the column index, so that Inductor fuses the fp32 work into a reduction over the logits (logsumexp, the
    target's logit) and one pointwise pass that writes d/dlogits already in the matmul's dtype: under bf16/fp16 no
    fp32 chunk x vocab tensor need exist. The head's matmuls stay in the compute dtype."""
    logits = F.linear(h, w, b).float()
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
    if not need_grad:
        return loss, None
    p = torch.exp(logits - lse[:, None])
    onehot = torch.arange(logits.shape[1], device=t.device) == t[:, None]
    grad = torch.where(onehot, p - 1.0, p)
    scale = _grad_scale(h.dtype)
    if scale == 1.0:  # dividing by 1 is exact: not a pass over the rows
        return loss, (grad.to(w.dtype) @ w).to(_grad_dtype(h.dtype))
    return loss, ((grad * scale).to(w.dtype) @ w).to(_grad_dtype(h.dtype)) / scale


@functools.cache
def compiled_chunk():
    """``fused_chunk`` under torch.compile, one wrapper per process. Dynamic shapes are left automatic: the first
    full chunk compiles a static graph, the first ragged last chunk one with a symbolic row count that serves every
    later one, so a run compiles about two graphs per (dtype, bias, gradient or not) and never one per step. The
    compiler runs on the first call: its failures are Dynamo/Inductor errors, which the compile fallback catches."""
    return torch.compile(fused_chunk)


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(h_i @ W^T + b, y_i), chunked over rows; d/dh is computed in forward, W and b are frozen.

    ``body`` computes one chunk (``eager_chunk`` by default, ``compiled_chunk()`` when the run compiles). In fp16
    d/dh is unscaled into an fp32 buffer (``_grad_scale``); otherwise it keeps the hidden states' dtype.
    """

    FP16_SCALE = FP16_SCALE

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, body=None):
        body = body or eager_chunk
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        need_grad = ctx.needs_input_grad[0]
        grad_dtype = _grad_dtype(hidden.dtype)
        grad_hidden = torch.empty(hidden.shape, dtype=grad_dtype, device=hidden.device) if need_grad else None
        w = weight.to(hidden.dtype)  # once, not per chunk: the head is the largest matrix of a small model
        b = None if bias is None else bias.to(hidden.dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            loss, grad = body(hidden[rows], w, b, targets[rows], need_grad)
            total += loss
            if need_grad:
                grad_hidden[rows] = grad
        ctx.hidden_dtype = hidden.dtype
        ctx.save_for_backward(grad_hidden if need_grad else hidden.new_empty(0))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_out.to(grad_hidden.dtype)).to(ctx.hidden_dtype), None, None, None, None, None


class LossModule(torch.nn.Module):
    """The model and its loss as one module, so that DDP's forward (which prepares its gradient reducer) is the
    call that computes the loss: rocktune's fused head + cross-entropy reaches into the decoder directly.
    ``compiled``: the loss's chunk body runs compiled; the compile fallback (``LMTask.uncompile``) sets it False."""

    def __init__(self, model, chunk_size: int, fast: bool, compiled: bool = False, max_document: int | None = None):
        super().__init__()
        self.model, self.chunk_size, self.fast, self.compiled = model, chunk_size, fast, compiled
        self.max_document = max_document  # varlen's segment bound in a flat stream (data.flat.max_segment)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.sum_and_count(batch)[0]

    def sum_and_count(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """(summed token loss, loss-bearing tokens): the evaluation's call, outside DDP."""
        return causal_lm_loss_sum(self.model, batch, self.chunk_size, self.fast, self.compiled, self.max_document)
