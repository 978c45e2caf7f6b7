"""Packed rows on models with recurrent layers (tasks/causal/recurrent.py): refused before the first step when asked
for, not chosen by batching auto; and why: a Gated DeltaNet layer carries its state from one packed example into the
next, so the second example's logits are not its own."""

from __future__ import annotations

import pytest
import torch

from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.tasks.causal.recurrent import unpacked
from tests.family_fixtures import BY_NAME, TEMPLATES, build_family, chat_records


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return build_family(BY_NAME["qwen3.5"], tmp_path_factory.mktemp("hybrid") / "qwen3.5")


def _cfg(model, tmp_path, **training):
    from tests.conftest import tiny_run_config, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", chat_records(16, TEMPLATES["qwen3.5"].system))
    cfg = tiny_run_config(model, data, None, tmp_path / "out", max_steps=2, micro_batch_size=4, grad_accum=1)
    cfg["training"].update(training)
    return cfg


def test_a_packed_example_after_the_first_sees_the_state_of_the_one_before(hybrid):
    """The reason for the refusal, measured: packed behind another example (positions restarting, as packing
    does), an example's logits differ from its own forward's by far more than rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hybrid).eval()
    first, second = torch.arange(10, 30)[None], torch.arange(40, 60)[None]
    with torch.no_grad():
        alone = model(second).logits
        packed = model(torch.cat([first, second], 1),
                       position_ids=torch.cat([torch.arange(20), torch.arange(20)])[None]).logits[:, 20:]
    assert (packed - alone).abs().max() > 1e-2


def test_packing_asked_for_is_refused_before_anything_is_written(hybrid, tmp_path):
    from rocktune.tasks import train

    for change, key in (({"data": {"packing": True}}, "data.packing=true"),
                        ({"training": {"batching": "tokens"}}, "training.batching=tokens")):
        cfg = _cfg(hybrid, tmp_path)
        for section, values in change.items():
            cfg[section].update(values)
        with pytest.raises(UserError, match=f"^{key}[: ].*linear_attention in layers 0.*Set "):
            train(config_from_dict(cfg), quiet=True)
        assert not (tmp_path / "out").exists()


def test_batching_auto_does_not_pack_a_recurrent_model_on_a_gpu(hybrid, tmp_path, tiny_model_dir):
    cfg = config_from_dict(_cfg(hybrid, tmp_path))
    fitted, notes = unpacked(cfg, "cuda")  # auto picks tokens there
    assert fitted.training.batching == "examples" and cfg.training.batching == "auto"
    from rocktune.models.recurrent import kernel_note

    reference = kernel_note({"linear_attention": [0]})  # here: "... (causal_conv1d, fla not installed) ..."
    assert notes[:-1] == ([reference] if reference else [])
    assert reference is None or reference.startswith("kernels: the linear_attention layers run transformers' torch")
    assert notes[-1:] == [f"batching: examples, not the packed rows auto picks on this device: {hybrid} has recurrent "
                     "layers (linear_attention in layers 0) whose state and short convolution would run on from one "
                     "packed example into the next (rocktune does not keep packed examples apart in them yet)"]
    plain = config_from_dict(_cfg(tiny_model_dir, tmp_path, batching="tokens"))
    assert unpacked(plain, "cuda") == (plain, [])  # attention only: packing as asked
