"""The family matrix: every popular fine-tuning family, end to end on a tiny random model of its real architecture.

One test function per matrix column, parametrised over tests/family_fixtures.py's FAMILIES; the test ids
(``test_<column>[<family>]``) are what ``benchmarks/family_matrix.py`` turns into the README table. A column that
rocktune cannot do for a family is a test that the command refuses with a UserError naming the family's
architecture, so a refusal is a passing (and documented) cell, never a broken file.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

from rocktune.cli import main
from rocktune.errors import UserError
from rocktune.export.arch import ARCHS
from tests.family_fixtures import BY_NAME, FAMILIES, TEMPLATES, build_family, chat_records

NAMES = [f.name for f in FAMILIES]
# MoE families whose tiny fixture has experts in both layers (GLM-4.5's and Llama 4's first layer is dense)
MOE_EVERY_LAYER = {"qwen3-moe", "mixtral", "qwen3.5-moe", "qwen3-next", "gpt-oss", "granite4"}
IDS = torch.arange(3, 40).reshape(1, -1)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """Family name -> its model directory, built on first use (each test builds only the families it runs)."""
    root = tmp_path_factory.mktemp("families")
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_family(BY_NAME[name], root / name)
        return built[name]

    return get


@pytest.fixture(scope="module")
def family_run(family_dir, tmp_path_factory):
    """Family name -> (run directory with a random non-zero LoRA on all-linear, the PeftModel's logits on IDS)."""
    from tests.export_fixtures import make_run

    root = tmp_path_factory.mktemp("family-runs")
    made = {}

    def get(name: str):
        if name not in made:
            from transformers import AutoModelForCausalLM

            from rocktune.models.load import lora_targets

            # the targets training resolves (on MoE: attention and experts, not the router), as PEFT lists them
            targets, params = lora_targets(AutoModelForCausalLM.from_pretrained(family_dir(name)), "all-linear")
            extra = {"target_parameters": params} if params else {}
            peft_model = make_run(root / name, family_dir(name), targets, data_format="messages", **extra)
            with torch.no_grad():
                made[name] = (root / name, peft_model(IDS).logits)
        return made[name]

    return get


@pytest.fixture(scope="module")
def lora_run(family_run, family_dir, tmp_path_factory):
    """Family name -> a run directory whose adapter llama.cpp applies as a GGUF LoRA: the family's run, or, where
    all-linear adapts a module llama.cpp's graph multiplies without a LoRA (Gemma 4's per_layer_model_projection,
    which --to gguf-lora refuses), a run on the same targets but that one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rocktune.models.load import lora_targets
    from tests.export_fixtures import make_run

    root = tmp_path_factory.mktemp("lora-runs")
    made = {}

    def get(name: str):
        skip = ARCHS[AutoConfig.from_pretrained(family_dir(name)).model_type].no_lora
        if not skip:
            return family_run(name)[0]
        if name not in made:
            _, params = lora_targets(AutoModelForCausalLM.from_pretrained(family_dir(name)), "all-linear")
            extra = {"target_parameters": params} if params else {}
            make_run(root / name, family_dir(name), [t for t in BY_NAME[name].trained if t not in skip],
                     data_format="messages", **extra)
            made[name] = root / name
        return made[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_lora_targets(family_dir, record_property, name):
    """all-linear adapts exactly the family's linear projections in every layer kind (attention, Gated DeltaNet's and
    Mamba2's projections, dense MLPs, shared experts; Phi-3's fused ones as they are); on MoE families also every
    expert stack (3-D parameters in transformers 5, through PEFT's parameter targeting); never a router or a 1-wide
    gate, whatever its class. The saved adapter_config.json names the same set, and PEFT reloads it unchanged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rocktune.models.load import apply_lora
    from rocktune.models.targets import router_modules

    fam = BY_NAME[name]
    model = apply_lora(AutoModelForCausalLM.from_pretrained(family_dir(name)), 4, 8.0, 0.0, "all-linear", False)
    assert _adapted(model) == set(fam.trained)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not [n for n in trainable if "lm_head" in n or "embed" in n]
    base = model.get_base_model()
    gates = [m for m in base.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 1]
    frozen = router_modules(base) + gates
    layers = base.config.num_hidden_layers  # one router per MoE layer: every layer, or every other one
    assert len(router_modules(base)) == (layers if name in MOE_EVERY_LAYER else layers // 2 if fam.moe else 0)
    assert not [p for m in frozen for p in m.parameters() if p.requires_grad]
    assert not [m for m in frozen if hasattr(m, "lora_A")]
    stacks = {m.parameter_name for m in model.modules() if hasattr(m, "parameter_name") and hasattr(m, "lora_A")}
    assert sorted(stacks) == (["down_proj", "gate_up_proj"] if fam.moe else [])
    model.save_pretrained(family_dir(name).parent / f"{name}-adapter")
    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(family_dir(name)),
                                      family_dir(name).parent / f"{name}-adapter")
    assert _adapted(again) == set(fam.trained)  # PEFT's own reload renames nothing (models.targets.keep_v5_names)
    short = ", ".join(m.removesuffix("_proj") for m in fam.trained)
    frozen_kinds = ", ".join(k for k, found in (("router", fam.moe), ("1-wide gate", gates)) if found)
    record_property("cell", short + (" + experts" if fam.moe else "") + (f" ({frozen_kinds} frozen)" if frozen_kinds
                                                                        else ""))


def _adapted(model) -> set[str]:
    """The adapted Linear modules' names (the expert stacks apart)."""
    return {n.split(".")[-4] for n, _ in model.named_parameters() if "lora_A" in n and ".experts." not in n}


def test_every_family_states_its_targets():
    """A family joins the matrix with the target set its test_lora_targets cell asserts."""
    assert [f.name for f in FAMILIES if not f.trained] == []


@pytest.mark.parametrize("name", NAMES)
def test_chat_masking(family_dir, record_property, name):
    """Only the assistant reply (with what the template writes ahead of its text inside the reply: the end of the
    think block Qwen3.5's generation prompt opens, Harmony's final-channel header), the family's end-of-turn token and
    the template's whitespace after it bear loss; the system/user turns and the reply's header do not; the tokens are
    the template's own rendering. GLM-4.5's template writes no end of turn: the model ends a reply with the next
    turn's role token, which its generation config stops on, so <|user|> is the trained end, appended after the last
    reply."""
    from transformers import AutoTokenizer

    from rocktune.data.checks import check_training_data, end_of_turn_id
    from rocktune.data.dataset import Examples
    from rocktune.data.encode import IGNORE, encode

    t = TEMPLATES[BY_NAME[name].template]
    tok = AutoTokenizer.from_pretrained(family_dir(name))
    record = chat_records(1, t.system)[0]
    enc = encode(record, "messages", tok, 512, False, "probe")
    rendered = tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask="{% generation %}" in t.text)
    eot = tok.convert_tokens_to_ids(t.end_of_turn)
    appended = [eot] if t.end_of_turn in t.stops else []  # the stop the template writes only when a turn follows
    assert enc.input_ids == list(rendered["input_ids"]) + appended
    assert end_of_turn_id(tok) == eot
    assert check_training_data(Examples([enc.input_ids], [enc.labels]), tok, "messages", False,
                               [("probe", record)]) == []
    trained = [i for i, label in zip(enc.input_ids, enc.labels, strict=True) if label != IGNORE]
    reply = record["messages"][-1]["content"]
    end = trained.index(eot)
    assert tok.decode(trained[:end]) == t.reply_head + (reply.strip() if t.trims else reply)
    assert not tok.decode(trained[end + 1:]).strip()
    if "{% generation %}" in t.text:  # the template marks the reply itself: rocktune trains exactly those tokens
        assert [label != IGNORE for label in enc.labels] == [bool(m) for m in rendered["assistant_masks"]]


@pytest.mark.parametrize("name", NAMES)
def test_train(family_dir, tmp_path, name):
    """A few steps of the real `rocktune train` (data checks included) on chat data: finite loss that falls."""
    result = _train(family_dir, tmp_path, name, steps=4)
    assert len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0]
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
    import json

    notes = json.loads((tmp_path / "out" / "run_info.json").read_text())["notes"]
    said = [n for n in notes if n.startswith("lora targets: ")]  # the run log says what was adapted, by kind
    assert len(said) == 1 and all(t in said[0] for t in BY_NAME[name].trained)
    assert ("left out: router" in said[0]) == BY_NAME[name].moe


def _train(family_dir, tmp_path, name: str, steps: int, quantization: str = "none"):
    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from tests.conftest import tiny_run_config, write_jsonl

    t = TEMPLATES[BY_NAME[name].template]
    data = write_jsonl(tmp_path / "train.jsonl", chat_records(64, t.system))
    cfg = tiny_run_config(family_dir(name), data, None, tmp_path / "out", max_steps=steps, micro_batch_size=8,
                          grad_accum=1, lr=1e-2, warmup_steps=0)
    # Harmony's system header alone is 236 byte-level tokens; its conversations here are up to 312
    cfg["data"].update(max_length=320 if name == "gpt-oss" else 96, eval_fraction=0.0)
    cfg["lora"]["r"] = 4
    cfg["model"]["quantization"] = quantization
    return train(config_from_dict(cfg), quiet=True)


@pytest.mark.parametrize("name", NAMES)
def test_merged(family_run, name):
    """--to merged reloads in transformers and computes the PeftModel's logits (Gemma's scaled embedding and
    (1 + w) norms, Granite's multipliers and Phi-3's fused projections included)."""
    from transformers import AutoModelForCausalLM

    run, want = family_run(name)
    assert main(["export", str(run), "--to", "merged", "--dtype", "fp32", "--overwrite"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(run / "export" / "merged", dtype=torch.float32)
    with torch.no_grad():
        got = merged(IDS).logits
    # Gated DeltaNet's chunked recurrence sums over the sequence: the merge's fp32 rounding grows a little more there
    recurrent = "linear_attention" in (getattr(merged.config, "layer_types", None) or ())
    torch.testing.assert_close(got, want, atol=3e-5 if recurrent else 1e-5, rtol=0)
    assert not [k for k in merged.state_dict() if "lora_" in k]


def _refused(capsys, record_property, argv: list[str], model_type: str) -> None:
    """The refusal is the cell's result: the matrix shows it as refused, with this reason (record_property)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"does not support the {model_type} architecture" in " ".join(err.split())
    record_property("cell", f"refused: GGUF export does not know the {model_type} architecture")


# What llama.cpp's loader reads for each family beyond the common keys (GGUF key -> value from the fixture's config)
FAMILY_KEYS = {
    "phi3": {"phi3.rope.scaling.original_context_length": 4096, "phi3.attention.sliding_window": 0,
             "phi3.rope.dimension_count": 16},
    "granite3": {"granite.attention.scale": 0.0625, "granite.embedding_scale": 12.0, "granite.residual_scale": 0.22,
                 "granite.logit_scale": 8.0},
    "gemma2": {"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0,
               "gemma2.attention.sliding_window": 16, "gemma2.attention.sliding_window_pattern": [True, False],
               "gemma2.attention.key_length": 16},
    "gemma3": {"gemma3.final_logit_softcapping": 30.0, "gemma3.attention.sliding_window": 16,
               "gemma3.attention.sliding_window_pattern": [True, True], "gemma3.rope.freq_base": 1000000.0,
               "gemma3.rope.freq_base_swa": 10000.0},
    "qwen3-moe": {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
                  "qwen3moe.expert_feed_forward_length": 32},
    "mixtral": {"llama.expert_count": 4, "llama.expert_used_count": 2},
    "olmo3": {"olmo2.attention.sliding_window": 16, "olmo2.attention.sliding_window_pattern": [True, False]},
    "glm4.5": {"glm4moe.expert_count": 4, "glm4moe.expert_shared_count": 1, "glm4moe.leading_dense_block_count": 1,
               "glm4moe.expert_gating_func": 2, "glm4moe.rope.dimension_count": 8},
    "qwen3.5": {"qwen35.ssm.group_count": 2, "qwen35.ssm.time_step_rank": 4, "qwen35.ssm.inner_size": 64,
                "qwen35.attention.recurrent_layers": [True, False], "qwen35.rope.dimension_sections": [1, 1, 0, 0]},
    "qwen3.5-moe": {"qwen35moe.expert_count": 4, "qwen35moe.expert_shared_feed_forward_length": 64,
                    "qwen35moe.attention.recurrent_layers": [True, False]},
    "qwen3-next": {"qwen3next.ssm.inner_size": 64, "qwen3next.expert_shared_feed_forward_length": 64,
                   "qwen3next.attention.recurrent_layers": [True, False], "qwen3next.rope.dimension_count": 4},
    "gpt-oss": {"gpt-oss.expert_count": 4, "gpt-oss.attention.sliding_window": 16,
                "gpt-oss.expert_feed_forward_length": 128},
    "llama4": {"llama4.interleave_moe_layer_step": 2, "llama4.feed_forward_length": 128,
               "llama4.expert_feed_forward_length": 64},
    "granite4": {"granitehybrid.attention.head_count_kv": [0, 2], "granitehybrid.ssm.inner_size": 128,
                 "granitehybrid.ssm.time_step_rank": 4, "granitehybrid.ssm.state_size": 16,
                 "granitehybrid.rope.scaling.finetuned": True, "granitehybrid.expert_shared_feed_forward_length": 64,
                 "granitehybrid.logit_scale": 8.0, "granitehybrid.context_length": 512},
    "gemma4": {"gemma4.attention.key_length": 32, "gemma4.attention.key_length_swa": 16,
               "gemma4.rope.dimension_count": 32, "gemma4.rope.dimension_count_swa": 16,
               "gemma4.rope.freq_base": 1000000.0, "gemma4.rope.freq_base_swa": 10000.0,
               "gemma4.embedding_length_per_layer_input": 8, "gemma4.attention.shared_kv_layers": 0,
               "gemma4.attention.sliding_window_pattern": [True, False], "gemma4.final_logit_softcapping": 30.0},
}
# families whose layout test_gguf takes from the exporter (see expected_gguf)
EXPORTER_LAYOUT = ("gpt_oss", "llama4_text", "granitemoehybrid", "gemma4_text")
# llama.cpp rotates adjacent pairs in these graphs (HF: halves), so their q/k rows are stored interleaved
PAIRWISE_ROPE = {"llama", "granite", "smollm3"}


def expected_gguf(state: dict, cfg, arch: str) -> dict:
    """The merged HF weights as llama.cpp's loader wants them, derived here independently of the exporter: names from
    gguf-py's table, q/k rows interleaved for pairwise-rope graphs, Gemma's norms as 1 + w, OLMo 2's head untied."""
    import gguf

    # Gated DeltaNet's reorders, gpt-oss's and Llama 4's transposed experts, Granite 4's Mamba2 tensors and Gemma 4's
    # per-layer embeddings: the exporter's layout, which test_gguf_converter.py proves equal to llama.cpp's own
    # converter
    if getattr(cfg, "linear_num_key_heads", None) or cfg.model_type in EXPORTER_LAYOUT:
        from rocktune.export.gguf_model import gguf_tensors

        return gguf_tensors(state, cfg, ARCHS[cfg.model_type])
    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(enum, cfg.num_hidden_layers)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    out = {}
    for key, value in _experts_apart(state).items():
        if cfg.tie_word_embeddings and key == "lm_head.weight":
            continue
        data = value.float().numpy()
        module = key.split(".")[-2]
        if arch in PAIRWISE_ROPE and module in heads:
            n, d = heads[module], data.shape[0] // heads[module]
            data = data.reshape(n, 2, d // 2, -1).transpose(0, 2, 1, 3).reshape(data.shape)
        if arch.startswith("gemma") and key.endswith("norm.weight"):
            data = data + 1
        key = key.replace("e_score_correction_bias", "e_score_correction.bias")  # GLM-4.5's router bias
        out[table.get_name(key, try_suffixes=(".weight", ".bias"))] = data
    if arch == "olmo2" and cfg.tie_word_embeddings:
        out["output.weight"] = out["token_embd.weight"]
    return out


def _experts_apart(state: dict) -> dict:
    """transformers 5's stacked experts (gate and up fused on dim 1) as the separate gate/up/down stacks GGUF keeps."""
    out = {}
    for key, value in state.items():
        if key.endswith("experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            out[key.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[key.replace("gate_up_proj", "up_proj.weight")] = up
        else:
            out[key + (".weight" if key.endswith("experts.down_proj") else "")] = value
    return out


@pytest.mark.parametrize("name", NAMES)
def test_gguf(family_run, family_dir, capsys, record_property, name):
    """Known architectures: the GGUF is written and read back (architecture, blocks, the family's own metadata, every
    merged tensor under llama.cpp's layout, in f32 exactly and in f16 to its rounding); the others: refused before
    any weight is loaded, naming the architecture, and no file is left."""
    gguf = pytest.importorskip("gguf", reason="the gguf package writes GGUF files")
    from transformers import AutoConfig

    run, _ = family_run(name)
    cfg = AutoConfig.from_pretrained(family_dir(name))
    out = run / "export" / "model-f32.gguf"
    argv = ["export", str(run), "--to", "gguf", "--quant", "f32", "--overwrite"]
    if cfg.model_type not in ARCHS:
        _refused(capsys, record_property, argv, cfg.model_type)
        assert not out.exists()
        return
    assert main(argv) == 0
    reader = gguf.GGUFReader(out)
    kv = {n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.")}
    arch = ARCHS[cfg.model_type].gguf_name
    assert kv["general.architecture"] == arch and kv[f"{arch}.block_count"] == cfg.num_hidden_layers
    assert kv["tokenizer.chat_template"] == TEMPLATES[BY_NAME[name].template].text
    for key, value in FAMILY_KEYS.get(name, {}).items():
        assert kv[key] == pytest.approx(value), key
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert shapes["token_embd.weight"] == (64, cfg.vocab_size)
    assert ("output.weight" in shapes) == (not cfg.tie_word_embeddings or arch == "olmo2")
    want = expected_gguf(_merged_state(run), cfg, arch)
    assert set(shapes) - {"rope_freqs.weight"} == set(want) - {"rope_freqs.weight"}
    got = {t.name: t.data for t in reader.tensors}
    for tname, data in want.items():
        np.testing.assert_array_equal(got[tname], data, err_msg=tname)
    assert main(["export", str(run), "--to", "gguf", "--quant", "f16", "--overwrite"]) == 0
    half = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(run / "export" / "model-f16.gguf")
            .tensors}
    for tname, data in want.items():
        np.testing.assert_allclose(half[tname], data, rtol=1e-3, atol=1e-4, err_msg=tname)


def _merged_model(run):
    from rocktune.export.merge import merged_model
    from rocktune.export.source import resolve

    return merged_model(resolve(str(run)), "fp32")[0]


def _merged_state(run) -> dict:
    return _merged_model(run).state_dict()


@pytest.mark.parametrize("name", NAMES)
def test_gguf_lora(family_run, family_dir, lora_run, capsys, record_property, name):
    """--to gguf-lora: an A/B pair per adapted projection (per expert stack on MoE, gate and up apart), each pair
    computing what llama.cpp adds to its base tensor: alpha / r * B·A equals the merged GGUF tensor minus the
    base's (both in llama.cpp's layout), expert by expert; or the same refusal as --to gguf. An all-linear adapter
    on a module llama.cpp's graph multiplies without a LoRA is refused naming it (nothing written), and an adapter
    without it is checked as above."""
    gguf = pytest.importorskip("gguf", reason="the gguf package writes GGUF files")
    from transformers import AutoConfig, AutoModelForCausalLM

    run, _ = family_run(name)
    cfg = AutoConfig.from_pretrained(family_dir(name))
    argv = ["export", str(run), "--to", "gguf-lora", "--overwrite"]
    if cfg.model_type not in ARCHS:
        _refused(capsys, record_property, argv, cfg.model_type)
        assert not (run / "export" / "adapter-f32.gguf").exists()
        return
    skip = ARCHS[cfg.model_type].no_lora
    if skip:
        assert main(argv) == 2
        said = " ".join(capsys.readouterr().err.split())
        assert f"adapts model.{skip[0]} (llama.cpp's {ARCHS[cfg.model_type].gguf_name} graph multiplies it" in said
        assert not (run / "export" / "adapter-f32.gguf").exists()
        record_property("cell", f"refused: llama.cpp's {ARCHS[cfg.model_type].gguf_name} graph applies no LoRA to "
                                f"{', '.join(skip)}, which all-linear adapts (an adapter without it: yes)")
        run = lora_run(name)
        argv = ["export", str(run), "--to", "gguf-lora", "--overwrite"]
    assert main(argv) == 0
    names = [t.name for t in gguf.GGUFReader(run / "export" / "adapter-f32.gguf").tensors]
    assert all(n.endswith((".lora_a", ".lora_b")) for n in names)
    if name == "phi3":  # one LoRA per fused projection, on llama.cpp's fused tensors (its graph applies it there)
        assert {f"blk.0.{t}.weight.lora_{ab}" for t in ("attn_qkv", "ffn_up") for ab in "ab"} <= set(names)
    reader = gguf.GGUFReader(run / "export" / "adapter-f32.gguf")
    alpha = float(reader.fields["adapter.lora.alpha"].contents())
    pairs = {t.name: np.asarray(t.data) for t in reader.tensors}
    arch = ARCHS[cfg.model_type].gguf_name
    merged = expected_gguf(_merged_state(run), cfg, arch)
    base = expected_gguf(AutoModelForCausalLM.from_pretrained(family_dir(name)).state_dict(), cfg, arch)
    # a pair on exactly the tensors the merge changed (dense-layer MLPs, shared experts and stacks included)
    changed = {t for t in merged if not np.array_equal(merged[t], base[t])}
    assert {n.removesuffix(".lora_a") for n in names if n.endswith(".lora_a")} == changed
    assert len(names) == 2 * len(changed)
    for tname in changed:
        a, b = pairs[tname + ".lora_a"], pairs[tname + ".lora_b"]
        delta = alpha / b.shape[-1] * (b @ a)  # batched over experts for 3-D stacks
        np.testing.assert_allclose(delta, merged[tname] - base[tname], atol=2e-5, err_msg=tname)


@pytest.mark.parametrize("name", NAMES)
def test_ollama(family_run, family_dir, capsys, record_property, name):
    """--to ollama: model.gguf and a Modelfile with the family's stop token, or the same refusal as --to gguf."""
    pytest.importorskip("gguf", reason="the gguf package writes GGUF files")
    from transformers import AutoConfig

    run, _ = family_run(name)
    cfg = AutoConfig.from_pretrained(family_dir(name))
    argv = ["export", str(run), "--to", "ollama", "--overwrite"]
    if cfg.model_type not in ARCHS:
        _refused(capsys, record_property, argv, cfg.model_type)
        return
    assert main(argv) == 0
    bundle = run / "export" / "ollama"
    text = (bundle / "Modelfile").read_text(encoding="utf-8")
    assert (bundle / "model.gguf").is_file() and text.startswith("FROM ./model.gguf")
    # the stop: the end-of-turn token, or where GLM-4.5's next user turn begins (its replies have no end token)
    assert f'PARAMETER stop "{TEMPLATES[BY_NAME[name].template].end_of_turn or "<|user|>"}"' in text
    assert 'TEMPLATE """' in text  # every family's chat template is translated (export/ollama_templates.py)


@pytest.mark.parametrize("name", NAMES)
def test_plan(family_dir, capsys, record_property, name):
    """`rocktune plan` reads the family's config.json: total parameters equal the real model's; for MoE the
    active count is attention + the routed share of the experts; the LoRA it sizes is the LoRA training builds
    (all-linear, experts included). An architecture the planner does not know yet is refused naming it (exit 2)."""
    import json

    from transformers import AutoModelForCausalLM

    from rocktune.models.load import apply_lora
    from rocktune.planner.estimate import RunSpec, lora_param_count
    from rocktune.planner.shapes import load_shape

    try:
        shape = load_shape(str(family_dir(name)))
    except UserError as exc:
        kind = json.loads((family_dir(name) / "config.json").read_text())["model_type"]
        assert f"model_type '{kind}' is not supported by the planner" in str(exc)
        assert main(["plan", str(family_dir(name)), "--json"]) == 2
        record_property("cell", f"refused: the planner does not know {kind} yet")
        return
    model = AutoModelForCausalLM.from_pretrained(family_dir(name))
    total = sum(p.numel() for p in model.parameters())
    assert shape.n_params == total
    if BY_NAME[name].moe:
        expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        k, n = shape.experts_per_token, shape.experts
        assert shape.active_params == total - expert + expert * k // n < total
    else:
        assert shape.active_params == total
    peft = apply_lora(model, 4, 8.0, 0.0, "all-linear", False)
    lora = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert lora_param_count(shape, RunSpec(lora_r=4, targets="all-linear")) == lora
    capsys.readouterr()
    assert main(["plan", str(family_dir(name)), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["n_params"] == total and doc["active_params"] == shape.active_params


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp(family_run, family_dir, lora_run, capsys, record_property, monkeypatch, name):
    """llama.cpp itself (llama-cpp-python) loads the family's f32 GGUF, tokenises like transformers and continues a
    prompt greedily with the merged transformers model's tokens; the base's GGUF with the GGUF LoRA (experts'
    LoRA included) gives the same tokens as its merged model (the family's run, or where --to gguf-lora refuses
    one of its modules, the run without it), and without it the base's. Architectures the export does not know are
    the same refusal as --to gguf."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    run, _ = family_run(name)
    cfg = AutoConfig.from_pretrained(family_dir(name))
    if cfg.model_type not in ARCHS:
        _refused(capsys, record_property, ["export", str(run), "--to", "gguf", "--overwrite"], cfg.model_type)
        return
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("not run here (llama-cpp-python not installed)")
    from tests.test_export_llama_cpp import (TEXTS, check_tokenizer, hf_greedy, llama, llama_greedy,
                                             use_plain_cpu_buffers)

    use_plain_cpu_buffers(monkeypatch)
    tok = AutoTokenizer.from_pretrained(family_dir(name))
    ids = tok(TEXTS[0])["input_ids"]
    merged = _merged_model(run)
    tuned = hf_greedy(merged, ids, 16)
    plain = hf_greedy(AutoModelForCausalLM.from_pretrained(family_dir(name), dtype=torch.float32), ids, 16)
    out = run / "export"
    assert main(["export", str(run), "--to", "gguf", "--quant", "f32", "--overwrite"]) == 0
    llm = llama(out / "model-f32.gguf")
    check_tokenizer(llm, tok)
    assert llama_greedy(llm, ids, 16) == tuned
    # the base in f32: an f16 base moves tiny random routers' logits enough to flip near-tied expert choices
    base = out / "base-f32.gguf"
    assert main(["export", str(family_dir(name)), "--to", "gguf", "--quant", "f32", "--out", str(base),
                 "--overwrite"]) == 0
    if lora_run(name) != run:  # the adapter llama.cpp can apply, and its own merged model's tokens
        run, out = lora_run(name), lora_run(name) / "export"
        tuned = hf_greedy(_merged_model(run), ids, 16)
    assert main(["export", str(run), "--to", "gguf-lora", "--overwrite"]) == 0
    assert llama_greedy(llama(base, lora=out / "adapter-f32.gguf"), ids, 16) == tuned
    assert llama_greedy(llama(base), ids, 16) == plain


@pytest.mark.parametrize("name", NAMES)
def test_qlora(family_dir, tmp_path, name):
    """Two steps of `rocktune train` on an nf4 base (bitsandbytes' CPU kernel): finite loss, only LoRA trains."""
    from tests.test_qlora import cpu_kernel_or_skip

    cpu_kernel_or_skip("nf4")
    result = _train(family_dir, tmp_path, name, steps=2, quantization="nf4")
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
    trainable = [n for n, p in result.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_refusal_is_a_user_error_for_every_unknown_architecture():
    """What `export --to gguf` refuses, it refuses with a UserError naming the architecture and the way out
    (checked on architectures outside the matrix; OLMo 3 was one until it joined it)."""
    from transformers import BloomConfig, GPT2Config

    from rocktune.export.arch import arch_for

    for cfg in (GPT2Config(), BloomConfig()):
        assert cfg.model_type not in ARCHS
        with pytest.raises(UserError, match=f"does not support the {cfg.model_type} architecture.*--to merged"):
            arch_for(cfg)


# (family, config change, what the refusal names): settings llama.cpp's graph for a known architecture hard-codes
LLAMA_CPP_FIXED = [
    ("gemma2", {"query_pre_attn_scalar": 32}, "query_pre_attn_scalar is 32, not 16"),
    ("gemma2", {"attn_logit_softcapping": None}, "no attention soft-capping"),
    ("gemma2", {"final_logit_softcapping": None}, "no final soft-capping"),
    ("gemma3", {"sliding_window": None}, "sliding layers but no window size"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "soft-caps attention logits"),
    ("smollm3", {"no_rope_layers": [0, 1]}, r"rope is skipped in layers \[0\]"),
    ("qwen3-moe", {"norm_topk_prob": False}, "norm_topk_prob is off"),
    ("qwen3-moe", {"mlp_only_layers": [1]}, "dense MLP instead of experts"),
]


def test_gguf_refuses_what_llama_cpp_would_compute_otherwise(family_dir):
    """A known architecture whose config asks for something llama.cpp's graph for it hard-codes differently (Gemma's
    query scale, soft-capping and window, SmolLM3's fixed every-4th no-rope layer, Qwen3-MoE's renormalised top-k
    and experts in every layer) is refused, naming the setting. (One test, not parametrised: the matrix reads
    parametrised ids of this file as families.)"""
    from transformers import AutoConfig

    from rocktune.export.arch import arch_for

    for name, change, why in LLAMA_CPP_FIXED:
        cfg = AutoConfig.from_pretrained(family_dir(name))
        for key, value in change.items():
            setattr(cfg, key, value)
        with pytest.raises(UserError, match=f"{cfg.model_type} model: .*{why}.*--to merged"):
            arch_for(cfg)


def test_phi3_in_the_name_does_not_break_llama_cpps_vocabulary(family_dir):
    """llama.cpp gives a model whose general.name contains "phi3" Phi-3's token attributes, looking up tokens a
    byte-level vocabulary lacks (the load aborts): such a name is written as "phi 3"; SentencePiece-era
    vocabularies that have those tokens keep the name."""
    from rocktune.export.vocab import loader_safe_name

    assert loader_safe_name("my-Phi-3-run", family_dir("phi3")) == "my-Phi 3-run"
    assert loader_safe_name("phi3", family_dir("phi3")) == "phi 3"
    assert loader_safe_name("qwen-run", family_dir("phi3")) == "qwen-run"


def test_smollm2_pre_tokenizer_is_the_shipped_one(family_dir, tmp_path):
    """SmolLM2 ships Digits + ByteLevel splitting under GPT2Tokenizer; transformers 5 rebuilds that class without the
    Digits step, but the GGUF names the splitting the model was trained with (llama.cpp's `smollm`), read from the
    tokenizer.json the base ships."""
    import json
    import shutil

    gguf = pytest.importorskip("gguf", reason="the gguf package writes GGUF files")
    from tests.export_fixtures import make_run

    base = tmp_path / "smollm2"
    shutil.copytree(family_dir("smollm2"), base)
    tj = json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    (base / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    tc = json.loads((base / "tokenizer_config.json").read_text(encoding="utf-8"))
    (base / "tokenizer_config.json").write_text(json.dumps({**tc, "tokenizer_class": "GPT2Tokenizer"}))
    make_run(tmp_path / "run", base, ["q_proj"])
    assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", "f32"]) == 0
    reader = gguf.GGUFReader(tmp_path / "run" / "export" / "model-f32.gguf")
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"


def test_gemma2_attention(family_dir):
    """Gemma 2's transformers class has no SDPA path: auto picks eager (test_train[gemma2] trains with it), and an
    explicit sdpa is refused naming the setting, not blamed on a download."""
    from types import SimpleNamespace

    from rocktune.models.load import load_model, sdpa_supported
    from rocktune.tasks.causal.build import attention

    path = str(family_dir("gemma2"))
    assert not sdpa_supported(path, False) and sdpa_supported(str(family_dir("gemma3")), False)
    ctx = SimpleNamespace(attn="sdpa", device="cpu", precision="fp32")
    attn, note = attention("auto", ctx, False, False, SimpleNamespace(name_or_path=path, trust_remote_code=False))
    assert attn == "eager" and "no SDPA path" in note
    with pytest.raises(UserError, match="model.attn_implementation=sdpa.*auto.*eager") as err:
        load_model(path, "fp32", "sdpa", False, "cpu")
    assert "offline" not in str(err.value)


def test_olmo2_tied_head_is_written_as_output(tmp_path, monkeypatch):
    """OLMo 2's llama.cpp loader requires output.weight (it has no tied head): a tied OLMo 2 gets the embedding as
    output.weight too, and llama.cpp, where installed, continues a prompt with transformers' greedy tokens."""
    import dataclasses

    gguf = pytest.importorskip("gguf", reason="the gguf package writes GGUF files")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fam = BY_NAME["olmo2"]
    base = build_family(dataclasses.replace(fam, extra={**fam.extra, "tie_word_embeddings": True}), tmp_path / "b")
    out = tmp_path / "olmo2.gguf"
    assert main(["export", str(base), "--to", "gguf", "--quant", "f32", "--out", str(out)]) == 0
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(out).tensors}
    np.testing.assert_array_equal(tensors["output.weight"], tensors["token_embd.weight"])
    if importlib.util.find_spec("llama_cpp") is None:
        return
    from tests.test_export_llama_cpp import TEXTS, hf_greedy, llama, llama_greedy, use_plain_cpu_buffers

    use_plain_cpu_buffers(monkeypatch)
    ids = AutoTokenizer.from_pretrained(base)(TEXTS[0])["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert model.config.tie_word_embeddings
    assert llama_greedy(llama(out), ids, 16) == hf_greedy(model, ids, 16)
