"""The vision-language loss: the summed cross-entropy of the assistant's tokens, images seen by the model.

The model's own multimodal backbone (vision tower, projector, the image features scattered into the token
embeddings, Qwen's 3-D rotary positions) runs as transformers wrote it; only the head and cross-entropy are
rocktune's: at the loss-bearing positions only, in chunks (``tasks/lm/loss.LinearCrossEntropy``), so the full
logits never exist. A head that trains (LoRA on it) takes the plain logits path instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rocktune.data.encode import IGNORE
from rocktune.tasks.lm.loss import LinearCrossEntropy
from rocktune.tasks.vlm.positions import packed_positions
from rocktune.vision_model import model_inputs


class VisionLoss(torch.nn.Module):
    def __init__(self, model, chunk_size: int):
        super().__init__()
        self.model, self.chunk_size = model, chunk_size

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.sum_and_count(batch)[0]

    def sum_and_count(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        base = self.model.get_base_model()
        inputs = model_inputs(base.model, batch)
        if "text_position_ids" in batch:  # packed rows (data/vision_pack.py): no mask, positions that restart
            inputs["position_ids"] = packed_positions(base.model, batch)
        # no KV cache: training reads none, and with one transformers would not read packed positions as packed
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
