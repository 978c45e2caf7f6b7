"""Qwen3.5 and Llama 4 are released as multimodal checkpoints (``Qwen3_5ForConditionalGeneration``,
``Llama4ForConditionalGeneration``, a vision tower beside the language model). A text task loads them as causal
LMs (rocktune's ``load_model``): the text model must come with its trained weights, not a fresh init, so the logits
equal the multimodal model's own language model's. Tiny random checkpoints of that layout, saved here offline."""

from __future__ import annotations

import pytest
import torch
import transformers

from rocktune.models.load import load_model
from tests.family_fixtures import BY_NAME, TEMPLATES, build_tokenizer, family_config

VISION = {
    "qwen3.5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}),
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration",
               {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                "projector_input_dim": 32, "projector_output_dim": 64, "vision_output_dim": 32}),
}


@pytest.mark.parametrize("name", sorted(VISION))
def test_a_multimodal_release_loads_its_text_model_exactly(tmp_path, name):
    config_class, model_class, vision = VISION[name]
    fam = BY_NAME[name]
    text = family_config(fam, build_tokenizer(TEMPLATES[fam.template])).to_dict()
    torch.manual_seed(0)
    full = getattr(transformers, model_class)(getattr(transformers, config_class)(text_config=text,
                                                                                  vision_config=vision)).eval()
    full.save_pretrained(tmp_path / name)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        # Llama 4's multimodal forward fails without images in transformers 5.24: its own language model is the
        # reference (the same module the multimodal forward runs text through)
        want = (full.language_model if name == "llama4" else full)(input_ids=ids).logits
        model = load_model(str(tmp_path / name), "fp32", "sdpa", False, "cpu").eval()
        got = model(input_ids=ids).logits
    assert type(model).__name__ == model_class.replace("ConditionalGeneration", "CausalLM")
    torch.testing.assert_close(got, want, atol=0, rtol=0)
