"""The vision-language loss: the summed cross-entropy of the assistant's tokens, images seen by the model.

The model's own multimodal backbone (vision tower, projector, the image features scattered into the token
embeddings, Qwen's 3-D rotary positions) runs as transformers wrote it; only the head and cross-entropy are
rocktune's: at the loss-bearing positions only, in chunks (``tasks/causal/loss.LinearCrossEntropy``), so the full
logits never exist. A head that trains (LoRA on it) takes the plain logits path instead.

Packed rows on varlen attention (``varlen``: the language model was loaded with
``rocktune.kernels.attention.VARLEN``): the conversations' bounds, read from the restarting text positions, reach the
language model's attention as the ``cu_seq_lens_q``/``max_length_q`` keyword arguments transformers threads to every
layer. They are handed to the language model alone (a forward pre-hook), not to the whole model's forward, which
would pass them to the vision tower too, whose attention has bounds of its own (the patches of each image).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from rocktune.data.encode import IGNORE
from rocktune.tasks.causal.loss import LinearCrossEntropy
from rocktune.tasks.vlm.positions import document_bounds, packed_positions
from rocktune.tasks.vlm.vision.model import model_inputs


class VisionLoss(torch.nn.Module):
    def __init__(self, model, chunk_size: int, varlen: bool = False):
        super().__init__()
        self.model, self.chunk_size, self.varlen = model, chunk_size, varlen

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.sum_and_count(batch)[0]

    def sum_and_count(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        base = self.model.get_base_model()
        inputs = model_inputs(base.model, batch)
        if "text_position_ids" in batch:  # packed rows (tasks/vlm/data/vision_pack.py): no mask, positions that restart
            inputs["position_ids"] = packed_positions(base.model, batch)
        # no KV cache: training reads none, and with one transformers would not read packed positions as packed
        with self._bounds(base.model, batch):
            hidden = base.model(**inputs, use_cache=False).last_hidden_state[:, :-1]
        targets = batch["labels"][:, 1:]
        keep = targets != IGNORE
        hidden, targets = hidden[keep], targets[keep]
        head = base.get_output_embeddings()
        if type(head) is torch.nn.Linear and not head.weight.requires_grad:
            loss = LinearCrossEntropy.apply(hidden, head.weight, head.bias, targets, self.chunk_size)
        else:
            loss = F.cross_entropy(head(hidden).float(), targets, reduction="sum")
        return loss, int(targets.numel())

    @contextmanager
    def _bounds(self, backbone, batch: dict[str, torch.Tensor]):
        """While the backbone runs: its language model called with the packed rows' bounds (varlen only)."""
        if not (self.varlen and "text_position_ids" in batch):
            yield
            return
        cu, longest = document_bounds(batch["text_position_ids"])
        bounds = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

        def with_bounds(_module, args, kwargs):
            return args, {**kwargs, **bounds}

        hook = backbone.language_model.register_forward_pre_hook(with_bounds, with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()
