import pytest
import torch

from rocktune.data.batching import collate, count_loss_tokens
from rocktune.data.encode import IGNORE
from rocktune.models.load import apply_lora, load_model
from rocktune.tasks.causal.loss import causal_lm_loss_sum
from rocktune.train.step import step_normalised


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
    rows = [(r[:int(m.sum())].tolist(), lab[:int(m.sum())].tolist()) for mb in (a, b)
            for r, lab, m in zip(mb["input_ids"], mb["labels"], mb["attention_mask"])]
    big = collate([r for r, _ in rows], [lab for _, lab in rows], pad_id=256)
    assert big["input_ids"].shape[1] == width
    loss_sum, n = causal_lm_loss_sum(lora_model, big)
    assert n == step_tokens
    (loss_sum / n).backward()
    for name, g in grads(lora_model).items():
        torch.testing.assert_close(g_acc[name], g, rtol=1e-4, atol=1e-7)


def test_no_grad_eval_gives_the_same_loss(lora_model):
    batch = make_batch(4)
    with torch.no_grad():
        fast, n = causal_lm_loss_sum(lora_model, batch)
        full, _ = causal_lm_loss_sum(lora_model, batch, fast=False)
    assert n > 0 and fast.item() == pytest.approx(full.item(), rel=1e-5)


def test_packed_rows_equal_separate_examples(lora_model):
    """Packing must not let an example attend to, or be predicted from, its neighbours in the row."""
    from rocktune.data.packing import collate_packed

    g = torch.Generator().manual_seed(5)
    examples = []
    for n in (5, 9, 4, 7):
        ids = torch.randint(3, 250, (n,), generator=g).tolist()
        examples.append((ids, [IGNORE] * 2 + ids[2:]))
    packed = collate_packed([examples[:2], examples[2:]], pad_id=256)
    starts = [0, 5, 0, 4]
    rows = [0, 0, 1, 1]
    assert all(packed["labels"][r, s] == IGNORE for r, s in zip(rows, starts))
    assert packed["position_ids"][0, :14].tolist() == list(range(5)) + list(range(9))
    lora_model.eval()
    with torch.no_grad():
        packed_sum, packed_n = causal_lm_loss_sum(lora_model, packed)
        separate = [causal_lm_loss_sum(lora_model, collate([x], [y], pad_id=256)) for x, y in examples]
    assert packed_n == sum(n for _, n in separate)
    assert packed_sum.item() == pytest.approx(sum(v.item() for v, _ in separate), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_loss_in_low_precision_matches_full_path(tiny_model_dir, dtype):
    """bf16/fp16 base weights under autocast: the fused path agrees with HF's full-logits path, grads finite."""
    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_model_dir), "bf16" if dtype == torch.bfloat16 else "fp16", "sdpa",
                                  False, "cpu"), 4, 8, 0.0, "all-linear", False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    batch = make_batch(6)
    results = []
    for fast in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss, _ = causal_lm_loss_sum(model, batch, chunk_size=4, fast=fast)
        (loss * 1024.0).backward()  # a loss scale, as the GradScaler applies
        results.append((loss.item(), grads(model)))
    (fast_loss, g_fast), (full_loss, g_full) = results
    assert fast_loss == pytest.approx(full_loss, rel=2e-2)
    for name in g_full:
        assert torch.isfinite(g_fast[name]).all() and g_fast[name].dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(g_fast[name].flatten(), g_full[name].flatten(), dim=0)
        assert cos > 0.98, name


def test_one_packed_row_splits_at_example_starts():
    """flash-attention packing joins a micro-batch into one row; OOM recovery must still cut it, between examples."""
    from rocktune.data.packing import collate_packed
    from rocktune.tasks.causal.split import max_pieces, split_rows

    examples = [([5] * n, [5] * n) for n in (3, 4, 2, 5)]
    row = collate_packed([examples], pad_id=0)
    assert max_pieces(row) == 4
    parts = split_rows(row, 2)
    assert [p["input_ids"].shape[1] for p in parts] == [7, 7]
    assert all(int(p["position_ids"][0, 0]) == 0 for p in parts)
    assert sum(int((p["labels"] != IGNORE).sum()) for p in parts) == int((row["labels"] != IGNORE).sum())
    assert len(split_rows(row, 8)) == 4
