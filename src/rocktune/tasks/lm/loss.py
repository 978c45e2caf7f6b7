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

import torch
import torch.nn.functional as F

from rocktune.data.batching import count_loss_tokens
from rocktune.data.encode import IGNORE

# Packed batches carry position_ids and no attention_mask; bucketed ones carry an attention_mask.
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
# Configs with output transforms the fast path does not reproduce; such models take the full-logits path.
_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def causal_lm_loss_sum(model, batch: dict[str, torch.Tensor], chunk_size: int = 1024,
                       fast: bool = True) -> tuple[torch.Tensor, int]:
    labels = batch["labels"]
    targets = labels[:, 1:]
    index = batch.get("loss_index")  # host-computed (data.batching.with_loss_index): no device sync for sizes
    n_tokens = int(index.numel()) if index is not None else count_loss_tokens(labels)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if "cu_seq_lens" in batch:
        inputs.update(varlen_inputs(batch))
    if not (fast and _fast_path_ok(base)):
        logits = model(**inputs).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                               reduction="sum")
        return loss, n_tokens
    hidden = base.get_decoder()(**inputs).last_hidden_state[:, :-1]
    if index is not None:
        hidden, targets = hidden.flatten(0, 1).index_select(0, index), batch["loss_targets"]
    else:
        keep = targets != IGNORE
        hidden, targets = hidden[keep], targets[keep]
    head = base.get_output_embeddings()
    loss = LinearCrossEntropy.apply(hidden, head.weight, head.bias, targets, chunk_size)
    return loss, n_tokens


def varlen_inputs(batch: dict[str, torch.Tensor]) -> dict:
    """The keyword arguments transformers hands every attention layer for variable-length attention
    (rocktune.attention): the host-built document bounds, and as ``max_length`` the row width: no document is longer,
    and it is a constant (``data.max_length``) whenever compile pads rows to a static width, so the compiled graph
    is not specialised per batch."""
    cu, width = batch["cu_seq_lens"], batch["input_ids"].shape[1]
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": width, "max_length_k": width}


def _fast_path_ok(base) -> bool:
    config = getattr(base, "config", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if config is None or head is None or not hasattr(base, "get_decoder"):
        return False
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _HEAD_TRANSFORMS):
        return False
    # A trainable (or LoRA-wrapped) head needs its weight gradient: leave that to autograd.
    return type(head) is torch.nn.Linear and not head.weight.requires_grad


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(h_i @ W^T + b, y_i), chunked over rows; d/dh is computed in forward, W and b are frozen.

    In fp16, d/dh is taken before the GradScaler's scale is applied, so the small components of well-predicted
    tokens would flush to zero: there the softmax gradient is scaled by FP16_SCALE before the half-precision matmul
    and unscaled into an fp32 buffer. bf16 has fp32's exponent range and keeps its own dtype.
    """

    FP16_SCALE = 2.0**12  # |softmax - onehot| <= 1 per entry, so the scaled matmul stays far below fp16's max

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        need_grad = ctx.needs_input_grad[0]
        fp16 = hidden.dtype == torch.float16
        scale = LinearCrossEntropy.FP16_SCALE if fp16 else 1.0
        grad_dtype = torch.float32 if fp16 else hidden.dtype
        grad_hidden = torch.empty(hidden.shape, dtype=grad_dtype, device=hidden.device) if need_grad else None
        w = weight.to(hidden.dtype)  # once, not per chunk: the head is the largest matrix of a small model
        b = None if bias is None else bias.to(hidden.dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start : start + chunk_size]
            logits = F.linear(h, w, b).float()
            t = targets[start : start + chunk_size]
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            if not need_grad:
                continue
            # d(sum CE)/d(logits) = softmax - onehot, reusing the logits buffer in place.
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(t.shape[0], device=t.device), t] -= 1.0
            if fp16:
                grad.mul_(scale)
            grad_hidden[start : start + chunk_size] = (grad.to(w.dtype) @ w).to(grad_dtype) / scale
        ctx.hidden_dtype = hidden.dtype
        ctx.save_for_backward(grad_hidden if need_grad else hidden.new_empty(0))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_out.to(grad_hidden.dtype)).to(ctx.hidden_dtype), None, None, None, None


class LossModule(torch.nn.Module):
    """The model and its loss as one module, so that DDP's forward (which prepares its gradient reducer) is the
    call that computes the loss: rocktune's fused head + cross-entropy reaches into the decoder directly."""

    def __init__(self, model, chunk_size: int, fast: bool):
        super().__init__()
        self.model, self.chunk_size, self.fast = model, chunk_size, fast

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return causal_lm_loss_sum(self.model, batch, self.chunk_size, fast=self.fast)[0]
