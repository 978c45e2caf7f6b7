import pytest
import torch

from rocktune.data.batching import collate, count_loss_tokens
from rocktune.data.encode import IGNORE
from rocktune.model import apply_lora, load_model
from rocktune.train.loss import causal_lm_loss_sum, step_normalised


@pytest.fixture
def lora_model(tiny_model_dir):
    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu"), 4, 8, 0.0, "all-linear", False)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; perturb it so gradients reach every LoRA matrix
            torch.nn.init.normal_(p, std=0.02)
    return model


def make_batch(seed: int, rows: int = 3, width: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 250, (int(torch.randint(4, width, (1,), generator=g)),), generator=g).tolist()
           for _ in range(rows)]
    labels = [[IGNORE] * (len(x) // 2) + x[len(x) // 2:] for x in ids]
    return collate(ids, labels, pad_id=256)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_fast_path_matches_full_logits_loss_and_grads(lora_model):
    batch = make_batch(0)
    fast, n_fast = causal_lm_loss_sum(lora_model, batch, chunk_size=5)
    fast.backward()
    g_fast = grads(lora_model)
    lora_model.zero_grad()
    full, n_full = causal_lm_loss_sum(lora_model, batch, fast=False)
    full.backward()
    g_full = grads(lora_model)
    assert n_fast == n_full == count_loss_tokens(batch["labels"])
    assert fast.item() == pytest.approx(full.item(), rel=1e-5)
    for name in g_full:
        torch.testing.assert_close(g_fast[name], g_full[name], rtol=1e-4, atol=1e-6)


def test_matches_hf_labels_loss(lora_model):
    batch = make_batch(1)
    loss_sum, n = causal_lm_loss_sum(lora_model, batch)
    hf = lora_model(**batch).loss  # HF's mean over loss-bearing tokens
    assert (loss_sum / n).item() == pytest.approx(hf.item(), rel=1e-5)


def test_accumulation_equals_one_big_batch(lora_model):
    a, b = make_batch(2, rows=2), make_batch(3, rows=4)
    step_tokens = count_loss_tokens(a["labels"]) + count_loss_tokens(b["labels"])
    for mb in (a, b):
        step_normalised(causal_lm_loss_sum(lora_model, mb)[0], step_tokens).backward()
    g_acc = grads(lora_model)
    lora_model.zero_grad()
    width = max(a["input_ids"].shape[1], b["input_ids"].shape[1])
    rows = [(r[:int(m.sum())].tolist(), l[:int(m.sum())].tolist()) for mb in (a, b)
            for r, l, m in zip(mb["input_ids"], mb["labels"], mb["attention_mask"])]
    big = collate([r for r, _ in rows], [l for _, l in rows], pad_id=256)
    assert big["input_ids"].shape[1] == width
    loss_sum, n = causal_lm_loss_sum(lora_model, big)
    assert n == step_tokens
    (loss_sum / n).backward()
    for name, g in grads(lora_model).items():
        torch.testing.assert_close(g_acc[name], g, rtol=1e-4, atol=1e-7)


def test_eval_mode_needs_no_grad_buffers(lora_model):
    with torch.no_grad():
        loss, n = causal_lm_loss_sum(lora_model, make_batch(4))
    assert torch.isfinite(loss) and n > 0 and not loss.requires_grad
