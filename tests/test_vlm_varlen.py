"""Packed vision-language rows on varlen attention (the language model only; the vision tower keeps SDPA).

torch's kernel is CUDA/ROCm-only; on the CPU ``reference_varlen`` (its signature, computed per segment with SDPA) is
registered in its place, as tests/test_varlen_attention.py does for the text tasks: what is tested is everything
around the kernel (the bounds read from the packed positions, how they reach the language model's attention and
only it). For every family the packed batch's loss and adapter gradients on varlen equal those of the same packed
batch on SDPA (transformers' block-diagonal mask) and of the conversations one per row, to the tolerances of
tests/test_vlm_packing.py; bounds of one whole row instead fail."""

from __future__ import annotations

import pytest
import torch

from rocktune.kernels import attention as A
from rocktune.tasks.vlm.launch import transformers_major
from tests import test_vlm_packing as packing
from tests.test_vlm_packing import _examples, _loss_and_grads, _model
from tests.test_vlm_train import FAMILIES

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="one attention per model part needs transformers 5")
colours = packing.colours  # a fixture: the colour task (the tiny models: conftest.vlm_dirs)
ROWS = [[0, 4, 1], [3, 2]]  # examples/vision/chat.jsonl's conversations and one without an image, in two rows


def _spy():
    """reference_varlen, recording the bounds of each call."""
    calls = []

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append((cu_q.tolist(), max_q))
        return A.reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                  enable_gqa=enable_gqa)
    return spy, calls


def _varlen_twin(sdpa_model, vlm_dir, kernel=A.reference_varlen, checkpointing: bool = False):
    """The same weights and adapter, the language model loaded with the varlen attention (``kernel`` registered)."""
    A.register(kernel)
    varlen = _model(vlm_dir, attn=A.VARLEN, checkpointing=checkpointing)
    varlen.load_state_dict(sdpa_model.state_dict())
    return varlen


def _assert_same(got, want, rel=1e-5):
    assert got[1] == want[1] and got[0] == pytest.approx(want[0], rel=rel)
    for name, g in got[2].items():  # within 1e-5 of each tensor's largest entry
        assert float((g - want[2][name]).abs().max()) <= 1e-5 * float(want[2][name].abs().max()), name


def _batches(vlm_dir):
    from rocktune.tasks.vlm.data.vision_batch import collate
    from rocktune.tasks.vlm.data.vision_pack import collate_packed

    examples, tok, vision = _examples(vlm_dir)
    packed = collate_packed([[examples[i] for i in row] for row in ROWS], tok.pad_token_id, vision)
    return examples, collate(examples, tok.pad_token_id, vision), packed


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_on_varlen_equal_sdpa_and_one_per_row(vlm_dirs, family):
    from rocktune.data.packing import cu_seq_lens

    examples, one_per_row, packed = _batches(vlm_dirs(family))
    sdpa = _model(vlm_dirs(family))
    want_rows = _loss_and_grads(sdpa, one_per_row)
    want_packed = _loss_and_grads(sdpa, packed)
    spy, calls = _spy()
    varlen = _varlen_twin(sdpa, vlm_dirs(family), spy)
    assert varlen.config.text_config._attn_implementation == A.VARLEN
    assert varlen.config.vision_config._attn_implementation == "sdpa"
    got = _loss_and_grads(varlen, packed, varlen=True)
    _assert_same(got, want_packed)
    _assert_same(got, want_rows)
    # every language-model layer, and nothing else, ran on the bounds of the conversations and each row's padding
    width = packed["input_ids"].shape[1]
    lengths = [[len(examples[i].input_ids) for i in row] for row in ROWS]
    assert len(calls) == varlen.config.text_config.num_hidden_layers
    assert all(c == (cu_seq_lens(lengths, width).tolist(), max(max(n) for n in lengths)) for c in calls)


def test_the_bounds_reach_layers_recomputed_by_gradient_checkpointing(vlm_dirs):
    """model.gradient_checkpointing: every layer runs again in backward, with the same bounds."""
    _, _, packed = _batches(vlm_dirs())
    sdpa = _model(vlm_dirs())
    want = _loss_and_grads(sdpa, packed)
    spy, calls = _spy()
    varlen = _varlen_twin(sdpa, vlm_dirs(), spy, checkpointing=True)
    _assert_same(_loss_and_grads(varlen, packed, varlen=True), want)
    assert len(calls) == 2 * varlen.config.text_config.num_hidden_layers and len({str(c) for c in calls}) == 1


def test_bounds_of_whole_rows_let_conversations_see_each_other(vlm_dirs, monkeypatch):
    """The check above can fail: one segment per row (no conversation bounds) moves the loss."""
    from rocktune.tasks.vlm import loss as vlm_loss

    _, _, packed = _batches(vlm_dirs())
    sdpa = _model(vlm_dirs())
    want = _loss_and_grads(sdpa, packed)[0]
    varlen = _varlen_twin(sdpa, vlm_dirs())
    assert _loss_and_grads(varlen, packed, varlen=True)[0] == pytest.approx(want, rel=1e-5)
    rows, width = packed["input_ids"].shape

    def whole_rows(text):
        return torch.arange(0, rows * width + 1, width, dtype=torch.int32), width
    monkeypatch.setattr(vlm_loss, "document_bounds", whole_rows)
    assert abs(_loss_and_grads(varlen, packed, varlen=True)[0] - want) > 1e-3 * abs(want)


def test_padded_rows_on_the_varlen_model_take_causal_sdpa(vlm_dirs):
    """Unpacked (evaluation, or training without data.packing): no bounds, so the glue runs transformers' causal SDPA
    without a mask, exact for right-padded rows (no padding precedes a real token); the kernel is never called."""
    _, one_per_row, _ = _batches(vlm_dirs())
    sdpa = _model(vlm_dirs())
    want = _loss_and_grads(sdpa, one_per_row)
    spy, calls = _spy()
    _assert_same(_loss_and_grads(_varlen_twin(sdpa, vlm_dirs(), spy), one_per_row, varlen=True), want)
    assert calls == []


def test_a_packed_run_picks_varlen_on_a_gpu_and_trains_as_sdpa_does(vlm_dirs, colours, tmp_path, monkeypatch):
    """The real train(): auto's choice made as on a GPU (device name fed in, the stand-in kernel for torch's, its
    self-test run on the CPU), the packed feed, the loss on varlen; evaluation and the samples on the same model
    (unpacked: causal SDPA). The same losses, eval losses and samples as a packed run on SDPA."""
    import json

    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from rocktune.tasks.vlm import task as vlm_task
    from tests.test_vlm_train import _metrics

    def as_on_a_gpu(setting, advised, device, feeding, dtype):
        monkeypatch.setattr(A, "varlen_kernel", lambda: A.reference_varlen)
        return A.choose(setting, advised, "cuda", feeding, dtype, test=lambda d, dt: A.self_test("cpu", dt))

    runs = {}
    for attn in ("sdpa", "auto"):
        if attn == "auto":
            monkeypatch.setattr(vlm_task, "choose", as_on_a_gpu)
        cfg = packing._packed_config(vlm_dirs(), colours, tmp_path / attn, max_steps=4, eval_every=2, sample_count=1)
        cfg["model"]["attn_implementation"] = attn
        train(config_from_dict(cfg), quiet=True)
        keys = ("step", "loss", "eval_loss", "images")
        runs[attn] = [{k: r[k] for k in keys if k in r} for r in _metrics(tmp_path / attn)]
    assert len([r for r in runs["auto"] if "loss" in r]) == 4 and any("eval_loss" in r for r in runs["auto"])
    for got, want in zip(runs["auto"], runs["sdpa"], strict=True):
        assert got == {k: pytest.approx(v, rel=1e-5) for k, v in want.items()}
    samples = [(tmp_path / a / "samples.jsonl").read_text() for a in ("auto", "sdpa")]
    assert samples[0] == samples[1]
    notes = json.loads((tmp_path / "auto" / "run_info.json").read_text())["notes"]
    assert any(n.startswith("attention: varlen_attn over the collate's document bounds (self-test: ") for n in notes)


def test_document_bounds_restart_at_every_zero():
    from rocktune.tasks.vlm.positions import document_bounds

    text = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    cu, longest = document_bounds(text)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 10, 12] and longest == 4


@pytest.mark.parametrize("attn", ["eager", "flash_attention_2", "flex_attention"])
def test_other_attention_settings_are_refused_for_vlm(attn, tmp_path):
    from pathlib import Path

    from rocktune.config import config_from_dict
    from rocktune.errors import UserError
    from rocktune.tasks import refuse_before_launch
    from rocktune.train.request import RunOptions
    from tests.test_vlm_packing import _packed_config

    cfg = _packed_config(Path("m"), (Path("t.jsonl"), Path("e.jsonl")), tmp_path / "run")
    cfg["model"]["attn_implementation"] = attn
    with pytest.raises(UserError, match=rf"model.attn_implementation={attn} is not supported for task=vlm: use auto"):
        refuse_before_launch(config_from_dict(cfg), RunOptions())


def test_varlen_is_refused_with_transformers_4(monkeypatch, tmp_path):
    """One attention per model part (the vision tower's SDPA kept) needs transformers 5."""
    from pathlib import Path

    from rocktune.config import config_from_dict
    from rocktune.errors import UserError
    from rocktune.tasks import refuse_before_launch
    from rocktune.tasks.vlm import launch
    from rocktune.train.request import RunOptions
    from tests.test_vlm_train import vlm_config

    monkeypatch.setattr(launch, "transformers_major", lambda: 4)
    cfg = vlm_config(Path("m"), (Path("t.jsonl"), Path("e.jsonl")), tmp_path / "run")
    cfg["model"]["attn_implementation"] = "varlen"
    with pytest.raises(UserError, match=r"model.attn_implementation=varlen with task=vlm needs transformers 5 .* "
                                        r"use auto or sdpa"):
        refuse_before_launch(config_from_dict(cfg), RunOptions())
