"""data.packing for task=vlm: several conversations with their images share a row and attend only to themselves.
The packed batch's loss and adapter gradients equal those of the same conversations padded one per row (so no token
sees another conversation, and each keeps its own 3-D rotary positions), for every family; a packed run trains,
counts the same loss tokens and resumes exactly after SIGKILL."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.tasks import refuse_before_launch, train
from rocktune.tasks.vlm import launch
from rocktune.tasks.vlm.launch import transformers_major
from rocktune.train.request import RunOptions
from tests.test_task_contract import run_worker
from tests.test_vlm_train import FAMILIES, _metrics, vlm_config

EXAMPLES = Path(__file__).parent.parent / "examples" / "vision" / "chat.jsonl"
# transformers 4's Qwen-VL models attend across packed conversations: packing is refused there (the last test)
pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="data.packing for task=vlm needs transformers 5")


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> tuple[Path, Path]:
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task

    return write_colour_task(tmp_path_factory.mktemp("colours"), n_train=48, n_eval=8, seed=0)


def _examples(vlm_dir: Path):
    """The four shapes of examples/vision/chat.jsonl (a system turn, two turns, LLaVA markers: four lengths) and a
    conversation without an image, encoded as training encodes them."""
    from transformers import AutoConfig

    from rocktune.data.records import read_records
    from rocktune.tasks.vlm.data.vision import encode
    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.vision.model import vision_tokens

    tok = load_tokenizer(str(vlm_dir), False)
    vision = vision_tokens(str(vlm_dir), AutoConfig.from_pretrained(vlm_dir), tok, None, None)
    rows = [r for _, r in read_records(EXAMPLES)]
    rows.append({"messages": [{"role": "user", "content": "Say blue."}, {"role": "assistant", "content": "blue"}]})
    examples = [encode(r, EXAMPLES.parent, tok, vision, 256, f"row {i}") for i, r in enumerate(rows)]
    return examples, tok, vision


def _model(vlm_dir: Path, attn: str = "sdpa", checkpointing: bool = False):
    import torch

    from rocktune.models.load import apply_lora
    from rocktune.tasks.vlm.vision.model import language_targets, load_vlm

    base = load_vlm(str(vlm_dir), "fp32", attn, "cpu")
    model = apply_lora(base, 8, 16, 0.0, language_targets(base), checkpointing)
    if checkpointing:
        model.train()  # transformers recomputes layers in training mode only
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)  # a non-zero adapter, so that it shapes the loss
    return model


def _loss_and_grads(model, batch, varlen: bool = False):
    from rocktune.tasks.vlm.loss import VisionLoss

    model.zero_grad()
    loss, count = VisionLoss(model, chunk_size=7, varlen=varlen).sum_and_count(batch)
    loss.backward()
    return loss.item(), count, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_batch_is_the_same_conversations_one_per_row(vlm_dirs, family):
    from rocktune.tasks.vlm.data.vision_batch import collate
    from rocktune.tasks.vlm.data.vision_pack import collate_packed

    examples, tok, vision = _examples(vlm_dirs(family))
    model = _model(vlm_dirs(family))
    one_per_row = collate(examples, tok.pad_token_id, vision)
    rows = [[examples[0], examples[4], examples[1]], [examples[3], examples[2]]]  # images in a new order
    packed = collate_packed(rows, tok.pad_token_id, vision)
    assert packed["input_ids"].shape[0] == 2 and "attention_mask" not in packed
    want, want_count, want_grads = _loss_and_grads(model, one_per_row)
    got, got_count, got_grads = _loss_and_grads(model, packed)
    assert got_count == want_count and got == pytest.approx(want, rel=1e-5)
    for name, g in got_grads.items():  # within 1e-5 of each tensor's largest entry
        assert float((g - want_grads[name]).abs().max()) <= 1e-5 * float(want_grads[name].abs().max()), name


def test_without_restarting_positions_the_conversations_would_see_each_other(vlm_dirs):
    """The check above can fail: the same packed row with one running position (no block-diagonal mask) lets the
    second conversation attend to the first, and its loss moves."""
    import torch

    from rocktune.tasks.vlm.data.vision_batch import collate
    from rocktune.tasks.vlm.data.vision_pack import collate_packed

    examples, tok, vision = _examples(vlm_dirs())
    model = _model(vlm_dirs())
    want = _loss_and_grads(model, collate(examples[:2], tok.pad_token_id, vision))[0]
    packed = collate_packed([examples[:2]], tok.pad_token_id, vision)
    assert _loss_and_grads(model, packed)[0] == pytest.approx(want, rel=1e-5)
    packed["text_position_ids"] = torch.arange(packed["input_ids"].shape[1])[None]
    assert abs(_loss_and_grads(model, packed)[0] - want) > 1e-3 * abs(want)


def _packed_config(vlm_dir: Path, colours, out: Path, **training) -> dict:
    cfg = vlm_config(vlm_dir, colours, out, **{"micro_batch_size": 2, "max_steps": 8, **training})
    cfg["data"].update(packing=True, max_length=240)
    return cfg


def test_a_packed_run_trains_and_says_so(vlm_dirs, colours, tmp_path):
    run = tmp_path / "run"
    train(config_from_dict(_packed_config(vlm_dirs(), colours, run, max_steps=30, eval_every=10)), quiet=True)
    rows = _metrics(run)
    steps = [r for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < 0.5 * evals[0]
    # a colour conversation is about 56 tokens here: 2 rows of 240 hold about 8 of them, 2 padded rows hold 2
    assert sum(s["images"] for s in steps) / len(steps) > 6
    assert all(s["real_tokens"] <= s["batch_tokens"] <= 2 * 240 for s in steps)
    info = json.loads((run / "run_info.json").read_text())
    assert info["data"]["packing"] is True


def test_a_packed_run_resumes_exactly_after_sigkill(vlm_dirs, colours, tmp_path):
    from safetensors.torch import load_file

    ref, run = tmp_path / "ref", tmp_path / "run"
    keys = ("step", "loss", "samples", "images")
    configs = [_packed_config(vlm_dirs(), colours, d) for d in (ref, run)]
    for c in configs:
        c["reliability"]["save_every"] = 2
    train(config_from_dict(configs[0]), quiet=True)
    cfg = configs[1]
    assert run_worker(cfg, {"kill_at_step": 5}).returncode == -signal.SIGKILL
    train(config_from_dict(cfg), RunOptions(resume=True), quiet=True)
    trim = [[{k: r[k] for k in keys if k in r} for r in _metrics(d) if "loss" in r] for d in (ref, run)]
    assert trim[0] == trim[1]
    got, want = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (run, ref))
    assert all(got[k].equal(want[k]) for k in want)


def test_packing_is_refused_with_transformers_4(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "transformers_major", lambda: 4)
    cfg = _packed_config(Path("m"), (Path("t.jsonl"), Path("e.jsonl")), tmp_path / "run")
    with pytest.raises(UserError, match=r"data.packing with task=vlm needs transformers 5 .* Drop data.packing"):
        refuse_before_launch(config_from_dict(cfg), RunOptions())


def test_auto_with_packing_is_refused(tmp_path):
    cfg = _packed_config(Path("m"), (Path("t.jsonl"), Path("e.jsonl")), tmp_path / "run")
    with pytest.raises(UserError, match=r"--auto plans task=vlm's rows one conversation each; with data.packing"):
        refuse_before_launch(config_from_dict(cfg), RunOptions(auto_fit=True))
