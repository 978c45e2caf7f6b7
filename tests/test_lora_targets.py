"""all-linear's targets by role (rocktune.models.targets), on a made-up MoE block whose names and classes are no
family's: the router is found as the module producing one logit per expert, whatever it is called or returns."""

from __future__ import annotations

import torch
from torch import nn

from rocktune.models.load import apply_lora, lora_targets
from rocktune.models.targets import plan_targets, router_modules, targets_note


class TupleRouter(nn.Linear):
    """Like Llama 4's: an nn.Linear whose forward returns (scores, logits)."""

    def forward(self, x):
        logits = super().forward(x)
        return torch.sigmoid(logits), logits


class Stacks(nn.Module):
    def __init__(self, n: int, d: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(n, d, 2 * d) * 0.1)
        self.w_out = nn.Parameter(torch.randn(n, 2 * d, d) * 0.1)

    def forward(self, x, weights):
        h = torch.einsum("td,edf->etf", x, self.w_in).relu()
        return torch.einsum("etf,efd,te->td", h, self.w_out, weights)


class Block(nn.Module):
    def __init__(self, n: int = 3, d: int = 8):
        super().__init__()
        self.chooser = TupleRouter(d, n, bias=False)  # neither "router" nor "gate" by name
        self.pool = Stacks(n, d)
        self.common = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.mix = nn.Linear(d, 1)  # a 1-wide gate
        self.conv = nn.Conv1d(d, d, 3, padding=1, groups=d)  # a 3-D kernel that is not an expert stack
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        x = self.conv(x.T[None])[0].T + self.proj(x)
        weights = self.chooser(x)[0].softmax(-1)
        return self.pool(x, weights) + torch.sigmoid(self.mix(x)) * self.common(x)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 11)

    def get_output_embeddings(self):
        return self.head

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_routers_and_one_wide_gates_are_found_by_role():
    model = Toy()
    plan = plan_targets(model, ["w_in", "w_out"])
    assert [id(m) for m in router_modules(model)] == [id(b.chooser) for b in model.layers]
    assert plan.left_out == {"router": ["layers.0.chooser", "layers.1.chooser"],
                             "1-wide gate": ["layers.0.mix", "layers.1.mix"]}
    assert sorted(plan.adapted) == sorted(f"layers.{i}.{n}" for i in (0, 1) for n in ("common.0", "common.2", "proj"))
    # "0" also names the first layer (layers.0): short names would catch it, so the targets are qualified
    assert plan.module_targets() == sorted(plan.adapted)
    assert plan_targets(Toy().layers[0], []).module_targets() == ["0", "2", "proj"]  # one block: no clash


def test_a_left_out_name_that_an_adapted_module_shares_is_targeted_by_qualified_names():
    model = Toy()
    model.layers[0].common[0] = model.layers[0].mix  # "mix" and "common.0" now name a 1-wide gate
    model.layers[1].mix = nn.Linear(8, 1)
    plan = plan_targets(model, [])
    assert "0" in {n.rsplit(".", 1)[-1] for names in plan.left_out.values() for n in names}
    assert all("." in t for t in plan.module_targets())  # qualified, so the gate's short name catches nothing


def test_dense_model_keeps_pefts_all_linear_and_others_are_as_configured():
    dense = nn.Sequential(nn.Linear(4, 4))
    dense.get_output_embeddings = lambda: None
    assert lora_targets(dense, "all-linear") == ("all-linear", [])
    assert lora_targets(Toy(), ["proj"]) == (["proj"], [])


def test_the_run_log_says_what_was_adapted_and_left_out_by_kind(tmp_path):
    """On a real family layout (Qwen3.5-MoE: Gated DeltaNet, shared expert, a 1-wide gate, a router)."""
    from transformers import AutoModelForCausalLM

    from tests.family_fixtures import BY_NAME, build_family

    path = build_family(BY_NAME["qwen3.5-moe"], tmp_path / "m")
    note = targets_note(apply_lora(AutoModelForCausalLM.from_pretrained(path), 4, 8.0, 0.0, "all-linear", False))
    assert note == ("lora targets: linear_attn: in_proj_a, in_proj_b, in_proj_qkv, in_proj_z, out_proj; "
                    "mlp.experts: down_proj, gate_up_proj; mlp.shared_expert: down_proj, gate_proj, up_proj; "
                    "self_attn: k_proj, o_proj, q_proj, v_proj (left out: router mlp.gate; 1-wide gate "
                    "mlp.shared_expert_gate)")


def test_lean_forward_leaves_a_base_that_returns_a_tuple_to_peft():
    """A LoRA on a Linear subclass whose forward returns a tuple (Llama 4's router, were it ever targeted) keeps
    PEFT's forward; the plain Linear beside it gets the lean one."""
    from peft import LoraConfig, get_peft_model

    from rocktune.lora.lean import lean_lora

    model = get_peft_model(Toy(), LoraConfig(r=2, target_modules=["chooser", "proj"]))
    note = lean_lora(model)
    assert note is not None and "of 2 adapted" in note
    patched = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if "forward" in vars(m)}
    assert patched == {"proj"}


def test_a_multimodal_checkpoint_for_a_text_task_adapts_the_text_decoder_only(tmp_path):
    """Gemma 4 ships as Gemma4ForConditionalGeneration (vision tower, projector): all-linear on a text task adapts
    the language model's linears (the text-only family's set) and nothing text never runs through."""
    import transformers

    from tests.family_fixtures import BY_NAME, TEMPLATES, build_tokenizer, family_config

    fam = BY_NAME["gemma4"]
    text = family_config(fam, build_tokenizer(TEMPLATES[fam.template])).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16}
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    model = transformers.AutoModelForCausalLM.from_config(config)
    plan_left = plan_targets(model, []).left_out["outside the text decoder"]
    assert plan_left and all(n.startswith(("model.vision_tower.", "model.embed_vision.")) for n in plan_left)
    peft_model = apply_lora(model, 4, 8.0, 0.0, "all-linear", False)
    adapted = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and ".lora_" not in n}
    assert adapted and all(".language_model." in n for n in adapted)
    assert {n.rsplit(".", 1)[-1] for n in adapted} == set(fam.trained)
    assert "left out: outside the text decoder model.embed_vision" in targets_note(peft_model)
