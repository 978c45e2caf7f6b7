"""grpo.share_prompt (tasks/grpo/prefix.py): each prompt computed once for its group of completions gives every row's
log-probabilities and the adapter's gradients of the full rows, whatever the prompts' lengths, the completions'
lengths and the cut of a group across forwards; a layout mistake (positions, the prompt's padding) fails these tests;
models it cannot serve take the plain forward."""

from __future__ import annotations

import pytest
import torch

from rocktune.lora import lean as lean_lora
from rocktune.models.load import apply_lora, load_model
from rocktune.tasks.grpo import prefix
from rocktune.tasks.grpo.feed import collate
from rocktune.tasks.grpo.loss import token_logps
from rocktune.train.step import split_by_rows

PAD = 0


def _model(model_dir, path: str = "fused", checkpointing: bool = False):
    torch.manual_seed(0)
    model = apply_lora(load_model(str(model_dir), "fp32", "sdpa", False, "cpu"), 8, 16, 0.0, "all-linear",
                       checkpointing)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    lean_lora.patch(model, path)
    return model.train()


def _batch() -> dict:
    """Three prompts of 7, 3 and 11 tokens, 4 completions each of 1 to 9 tokens, the groups interleaved with a
    fourth prompt that has one completion alone."""
    gen = torch.Generator().manual_seed(5)
    prompts = [tuple(torch.randint(5, 300, (n,), generator=gen).tolist()) for n in (7, 3, 11, 5)]
    rows, completions = [], []
    for k in range(13):
        p = prompts[3] if k == 12 else prompts[k % 3]
        rows.append(p)
        completions.append(torch.randint(5, 300, (1 + (k * 5) % 9,), generator=gen).tolist())
    return collate(rows, completions, [0.5] * len(rows), [1.0] * len(rows), PAD)


def _grads(model, batch, share: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probabilities and the adapter's gradient of a weighted sum of them (each token its own weight)."""
    logps = token_logps(model, batch, 0.7, share)
    weights = torch.linspace(-1, 1, logps.numel()).view_as(logps)
    (logps * weights).sum().backward()
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    flat = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    return logps.detach(), flat


def _agree(model, batch, share_batches=None) -> tuple[float, float]:
    """(largest log-prob difference, largest gradient difference relative to the gradient's largest entry) between
    the shared forward (over ``share_batches``, default the batch itself, summed) and the full rows."""
    want, want_grad = _grads(model, batch, False)
    pieces = share_batches or [batch]
    got = [_grads(model, b, True) for b in pieces]
    logps = torch.cat([g[0] for g in got])
    grad = sum(g[1] for g in got)
    return float((logps - want).abs().max()), float((grad - want_grad).abs().max() / want_grad.abs().max())


@pytest.mark.parametrize("path", lean_lora.SIDE_PATHS)
def test_shared_prompts_give_the_full_rows_log_probs_and_gradients(tiny_model_dir, path):
    model, batch = _model(tiny_model_dir, path), _batch()
    calls = []
    real = prefix.shared_logps
    try:
        prefix.shared_logps = lambda *a, **k: calls.append(real(*a, **k)) or calls[-1]
        logp_err, grad_err = _agree(model, batch)
    finally:
        prefix.shared_logps = real
    assert calls and all(c is not None for c in calls)  # the shared forward ran, not the plain one
    assert logp_err < 1e-5 and grad_err < 1e-5, (logp_err, grad_err)
    assert float(token_logps(model, batch, 0.7, True)[batch["completion_mask"][:, 1:] == 0].abs().max()) == 0.0


def test_a_group_cut_across_forwards_still_agrees(tiny_model_dir):
    """The OOM split and micro-batches cut by rows: a group's rows in two forwards, each sharing what it holds."""
    model, batch = _model(tiny_model_dir), _batch()
    assert _agree(model, batch, split_by_rows(batch, 3)) < (1e-5, 1e-5)


@pytest.mark.parametrize("mutant", ["positions", "prompt-padding"])
def test_a_layout_mistake_fails(tiny_model_dir, monkeypatch, mutant):
    """What these tests guard against: positions off by one, or a row seeing the padding after a shorter prompt."""
    real = prefix._completion_rows

    def wrong(ids, plen, width, n):
        tokens, cols, positions, attention = real(ids, plen, width, n)
        if mutant == "positions":
            return tokens, cols, positions + 1, attention
        return tokens, cols, positions, torch.ones_like(attention)

    monkeypatch.setattr(prefix, "_completion_rows", wrong)
    model, batch = _model(tiny_model_dir), _batch()
    logp_err, _ = _agree(model, batch)
    assert logp_err > 1e-3


def test_models_and_settings_it_cannot_serve_take_the_plain_forward(tiny_model_dir):
    model, batch = _model(tiny_model_dir, checkpointing=True), _batch()
    assert prefix.shared_logps(model, batch, 1.0) is None  # checkpointing: transformers drops the cache
    model = _model(tiny_model_dir)
    alone = collate([(5, 6, 7), (8, 9)], [[10], [11, 12]], [1.0, -1.0], [1.0, 1.0], PAD)
    assert prefix.shared_logps(model, alone, 1.0) is None  # no prompt shared: nothing to save
    ones = collate([(5,), (5,)], [[10], [11, 12]], [1.0, -1.0], [1.0, 1.0], PAD)
    assert prefix.shared_logps(model, ones, 1.0) is None  # one-token prompts: no prompt pass
    for kinds, window, ok in ((["full_attention"] * 2, None, True), (["full_attention", "sliding_attention"], 8,
                                                                       False), (None, 8, False), (None, None, True)):
        config = type("C", (), {"layer_types": kinds, "sliding_window": window})()
        if kinds is None:
            del type(config).layer_types
        assert prefix._full_attention(config) is ok, (kinds, window)


def test_a_cache_it_does_not_know_falls_back_for_the_run(tiny_model_dir, monkeypatch):
    """A cache of layers other than plain full-attention ones (a model the config check let through): the prompt
    pass is dropped and the model takes the plain forward for the rest of the run."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class OtherLayer(DynamicLayer):
        pass

    def other_cache():
        cache = DynamicCache()
        cache.layer_class_to_replicate = OtherLayer
        return cache

    import transformers

    model, batch = _model(tiny_model_dir), _batch()
    monkeypatch.setattr(transformers, "DynamicCache", other_cache)
    assert prefix.shared_logps(model, batch, 1.0) is None
    monkeypatch.undo()
    assert prefix.shared_logps(model, batch, 1.0) is None  # decided once: the plain forward for the rest of the run


def test_lora_dropout_in_training_takes_the_full_rows(tiny_model_dir):
    """Dropout draws independent masks at a prompt's G copies; one prompt pass would draw one for all: other noise,
    so a model with LoRA dropout trains over full rows (and shares again when evaluating, without masks)."""
    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu"), 8, 16, 0.1, "all-linear", False)
    lean_lora.patch(model, "fused")
    batch = _batch()
    assert prefix.shared_logps(model.train(), batch, 1.0) is None
    assert prefix.shared_logps(model.eval(), batch, 1.0) is not None


def test_the_rollouts_prefill_runs_each_prompt_once_and_samples_the_same(tiny_model_dir, monkeypatch):
    """The rollout's prefill (rollout.shared_prefill): 3 prompts x 4 completions prefill 3 rows, and every row's
    logits, cache and sampled completion are those of the full 12-row prefill."""
    from rocktune.tasks.grpo import rollout

    model = _model(tiny_model_dir).eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [tuple(torch.randint(5, 250, (n,), generator=gen).tolist()) for n in (6, 9, 3)]
    rows = [p for p in prompts for _ in range(4)]
    s = rollout.Sampling(12, 1.0, stop_ids=(256,))
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(p)) + list(p) for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits, cache = rollout.shared_prefill(model, ids, mask, positions)
        full = rollout._Eager(model, mask, positions)
        want = full._run(ids)
    assert float((logits - want).abs().max()) < 1e-5
    for got, ref in zip(cache.layers, full.cache.layers):
        assert got.keys.shape == ref.keys.shape and float((got.keys - ref.keys).abs().max()) < 1e-5
    draws = rollout.row_draws(list(range(len(rows))), 12)
    shared = rollout.sample(model, rows, s, PAD, draws)
    monkeypatch.setattr(rollout, "shared_prefill", lambda *a, **k: None)
    assert rollout.sample(model, rows, s, PAD, draws) == shared
