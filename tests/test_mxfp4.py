"""gpt-oss with MXFP4 experts, as openai/gpt-oss-20b/120b ship: loaded dequantised to the checkpoint's exact values,
trained, planned and exported as llama.cpp's converter writes it (tests/mxfp4_fixtures.py builds the checkpoint)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from rocktune.cli import main
from tests.mxfp4_fixtures import build_mxfp4_gpt_oss, encode

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
STACK_VALUES = 2 * 4 * 3 * 64 * 128  # layers x experts x (gate, up, down) x hidden x expert width


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the MXFP4 checkpoint, its stacks' decoded values in transformers' layout)."""
    return build_mxfp4_gpt_oss(tmp_path_factory.mktemp("mxfp4") / "base")


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    """4 steps of `rocktune train` on the MXFP4 checkpoint and on a plain fp32 copy holding its decoded values:
    {"mxfp4" | "plain": (run directory, result)}."""
    from transformers import AutoModelForCausalLM

    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from tests.conftest import tiny_run_config, write_jsonl
    from tests.family_fixtures import TEMPLATES, chat_records

    root = tmp_path_factory.mktemp("mxfp4-runs")
    plain = root / "plain-base"
    AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32).save_pretrained(plain)
    for file in checkpoint[0].iterdir():  # the tokenizer's files
        if not (plain / file.name).exists():
            (plain / file.name).write_bytes(file.read_bytes())
    data = write_jsonl(root / "train.jsonl", chat_records(64, TEMPLATES["harmony"].system))
    out = {}
    for kind, base in (("mxfp4", checkpoint[0]), ("plain", plain)):
        cfg = tiny_run_config(base, data, None, root / kind, max_steps=4, micro_batch_size=8, grad_accum=1, lr=1e-2,
                              warmup_steps=0)
        cfg["data"].update(max_length=320, eval_fraction=0.0)  # Harmony's fixed system header is ~150 tokens
        cfg["lora"]["r"] = 4
        out[kind] = (root / kind, train(config_from_dict(cfg), quiet=True))
    return out


def test_the_fixture_writes_e2m1_codes_and_e8m0_exponents():
    """A block worked by hand: max |v| 0.75 -> exponent floor(log2 0.75) - 2 = -3, byte 124; v / 2^-3 = 6, -0.5, 1.5,
    0, 3, -4, 1, 2 -> codes 7, 9, 3, 0, 5, 14, 2, 4, two a byte, the even one low. The fixture's first block takes
    one more exponent (125): the values halve, 0.25 and 0.75 tie and round down."""
    head = np.array([6, -0.5, 1.5, 0, 3, -4, 1, 2]) * 0.125
    row = np.concatenate([head, np.zeros(24)])
    blocks, scales = encode(np.stack([row, row]).reshape(1, 64))
    assert scales.tolist() == [[125, 124]]
    assert blocks[0, 1, :4].tolist() == [0x97, 0x03, 0xE5, 0x42] and not blocks[0, 1, 4:].any()
    assert blocks[0, 0, :4].tolist() == [0x05, 0x01, 0xC3, 0x21]  # 3, -0.25->0, 0.75->0.5, 0, 1.5, -2, 0.5, 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loading_dequantises_the_experts_to_their_exact_values(checkpoint, precision):
    """rocktune's loader gives plain transformers experts holding exactly the decoded MXFP4 values (an e2m1 value
    times a power of two is exact in bf16 too); the rest of the model is the checkpoint's."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from rocktune.models.load import DTYPES, load_model

    base, decoded = checkpoint
    model = load_model(str(base), precision, "eager", False, "cpu")
    assert getattr(model.config, "quantization_config", None) is None
    assert all(isinstance(layer.mlp.experts, GptOssExperts) for layer in model.model.layers)
    for key, values in decoded.items():
        p = model.get_parameter(key)
        assert p.dtype == DTYPES[precision]
        assert torch.equal(p.float(), torch.from_numpy(values).float()), key
    bias = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj_bias")
    assert bias.abs().sum() == 0  # the family fixture's zero-initialised biases, loaded as they are


def test_rocktune_asks_for_dequantised_experts_where_transformers_would_keep_mxfp4(checkpoint, monkeypatch):
    """On a GPU with transformers' MXFP4 kernels (faked: a CUDA device of compute capability 9.0, triton and the
    kernels package present) transformers keeps the experts packed for its forward-only kernels; rocktune's config
    dequantises them there too. A bitsandbytes quantisation on top is refused, naming the way out."""
    from transformers import Mxfp4Config
    from transformers.quantizers import quantizer_mxfp4 as q

    from rocktune.errors import UserError
    from rocktune.models.mxfp4 import load_kwargs

    for name in ("is_triton_available", "is_kernels_available", "is_accelerate_available"):
        monkeypatch.setattr(q, name, lambda *a, **k: True)
    monkeypatch.setattr(q, "get_current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    plain = q.Mxfp4HfQuantizer(Mxfp4Config(), pre_quantized=True)
    plain.validate_environment()
    assert plain.quantization_config.dequantize is False  # transformers alone: MXFP4 kernels, no training
    ours = q.Mxfp4HfQuantizer(load_kwargs(str(checkpoint[0]), "none")["quantization_config"], pre_quantized=True)
    ours.validate_environment()
    assert ours.quantization_config.dequantize is True
    assert load_kwargs(str(checkpoint[0].parent), "none") == {}  # no config.json there: nothing asked
    with pytest.raises(UserError, match="model.quantization=nf4 .* MXFP4 .* model.quantization: none"):
        load_kwargs(str(checkpoint[0]), "nf4")


def test_the_merge_loads_the_base_with_the_dequantising_config(checkpoint, monkeypatch):
    """export's merge loads the MXFP4 base as training did (dequantised), so on a GPU where transformers would keep
    the experts packed for its forward-only kernels the LoRA delta still lands on plain stacks: its exact values."""
    from transformers import AutoModelForCausalLM

    from rocktune.export.merge import load_base_fp32

    asked = {}
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        asked.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    model = load_base_fp32(str(checkpoint[0]), False)
    assert asked["quantization_config"].dequantize is True
    stack = model.get_parameter("model.layers.0.mlp.experts.down_proj")
    assert stack.dtype == torch.float32 and stack.dim() == 3


def test_training_on_mxfp4_experts_is_training_on_their_decoded_values(runs):
    """The MXFP4 run's losses fall and equal, step for step, those of the same run on a plain fp32 checkpoint of the
    decoded values, with the same adapter; its run log states what dequantising cost (the plain one's does not)."""
    from safetensors.torch import load_file

    (run, result), (plain_run, plain) = runs["mxfp4"], runs["plain"]
    assert len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0] - 1.0  # measured 6.04 -> 3.69
    np.testing.assert_allclose(result.losses, plain.losses, rtol=1e-6)
    ours, theirs = (load_file(r / "adapter" / "adapter_model.safetensors") for r in (run, plain_run))
    assert set(ours) == set(theirs) and any("experts" in k for k in ours)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6)
    notes = json.loads((run / "run_info.json").read_text())["notes"]
    said = [n for n in notes if n.startswith("MXFP4 experts dequantised for LoRA: ")]
    packed, full = STACK_VALUES * 17 // 32, STACK_VALUES * 4  # 16 bytes of codes + 1 exponent per 32; fp32
    assert packed == 104_448 and full == 786_432
    assert len(said) == 1 and (f"4 expert stacks, {STACK_VALUES:,} values, 768.0 KiB as fp32 in memory against "
                               "102.0 KiB as MXFP4 in the checkpoint (7.53x, +666.0 KiB)") in said[0], said
    assert not [n for n in json.loads((plain_run / "run_info.json").read_text())["notes"] if "MXFP4" in n]


def test_the_run_logs_the_bytes_the_checkpoint_and_the_model_hold(checkpoint):
    """The note's figures are measured, not derived: the packed bytes from the checkpoint's safetensors headers, the
    dequantised ones from the loaded parameters (bf16 here: 2 bytes a value)."""
    from rocktune.models.load import load_model
    from rocktune.models.mxfp4 import expert_bytes, packed_stacks

    packed = packed_stacks(str(checkpoint[0]))
    assert sorted(packed) == sorted(checkpoint[1]) and sum(packed.values()) == STACK_VALUES * 17 // 32
    found = expert_bytes(str(checkpoint[0]), load_model(str(checkpoint[0]), "bf16", "eager", False, "cpu"))
    assert (found.stacks, found.values, found.packed, found.dequantised, found.dtype) == \
        (4, STACK_VALUES, 104_448, STACK_VALUES * 2, "bf16")


def test_plan_counts_the_dequantised_experts(checkpoint, capsys):
    """`rocktune plan` on the checkpoint: base_weights holds every expert value at the run's dtype (what loading
    holds), and says what they are packed; gpt-oss-20b's preset (the released config) shows the real figures; a
    bitsandbytes base on top is refused as training refuses it."""
    from rocktune.planner.shapes import load_shape

    shape = load_shape(str(checkpoint[0]))
    assert shape.mxfp4_experts and shape.moe_layers * 4 * 3 * 64 * 128 == STACK_VALUES
    capsys.readouterr()
    assert main(["plan", str(checkpoint[0]), "--json", "--precision", "bf16", "--vram", "8GiB"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["terms"]["base_weights"] == shape.n_params * 2
    detail = next(t["inputs"] for t in doc["terms_detail"] if t["name"] == "base_weights")
    assert f"the expert stacks among them ({STACK_VALUES:,} values) dequantised from MXFP4: 0.38 MiB against " \
           "0.10 MiB packed in the checkpoint" in detail
    assert main(["plan", "gpt-oss-20b", "--json", "--vram", "80GiB"]) == 0
    doc = json.loads(capsys.readouterr().out)
    values = 24 * 32 * 3 * 2880 * 2880
    assert values == 19_110_297_600 and doc["terms"]["base_weights"] == 20_914_757_184 * 2
    assert "(19,110,297,600 values) dequantised from MXFP4: 35.60 GiB against 9.46 GiB packed" in \
        next(t["inputs"] for t in doc["terms_detail"] if t["name"] == "base_weights")
    assert main(["plan", str(checkpoint[0]), "--quant", "nf4"]) == 2
    assert "MXFP4" in capsys.readouterr().err
    # fits nowhere: no nf4 base proposed, the way out said
    assert main(["plan", "gpt-oss-20b", "--json", "--vram", "24GiB"]) == 0
    fit = json.loads(capsys.readouterr().out)["fit"]
    assert "Its experts ship as MXFP4 and train dequantised (35.60 GiB in bf16 against 9.46 GiB packed); QLoRA " \
           "(model.quantization: nf4) needs a bf16 copy" in fit["error"], fit


def _experts(path) -> dict:
    """GGUF expert weight tensors: name -> (type name, values as llama.cpp reads them, raw bytes)."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if "_exps.weight" in t.name:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            out[t.name] = (t.tensor_type.name, values.reshape([int(d) for d in reversed(t.shape)]), t.data.tobytes())
    return out


def _llama_layout(key: str, stack: np.ndarray) -> dict:
    """One transformers stack ([experts, in, out], gate and up interleaved column by column) as llama.cpp's
    tensors ([experts, out, in], gate and up apart), derived here."""
    layer = key.split(".")[2]
    rows = np.swapaxes(stack, -1, -2)
    if key.endswith("down_proj"):
        return {f"blk.{layer}.ffn_down_exps.weight": rows}
    return {f"blk.{layer}.ffn_gate_exps.weight": rows[:, ::2], f"blk.{layer}.ffn_up_exps.weight": rows[:, 1::2]}


@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_the_base_exports_its_mxfp4_experts_as_they_are(checkpoint, tmp_path, quant):
    """The checkpoint's experts go into the GGUF as MXFP4 (gguf-py, llama.cpp's own reader, decodes them to exactly
    the checkpoint's values), the rest in ``--quant``; a float file is labelled MXFP4-MoE as the converter does."""
    import gguf

    base, decoded = checkpoint
    out = tmp_path / f"base-{quant}.gguf"
    assert main(["export", str(base), "--to", "gguf", "--quant", quant, "--out", str(out)]) == 0
    got = _experts(out)
    want = {k: v for key, stack in decoded.items() for k, v in _llama_layout(key, stack).items()}
    assert set(got) == set(want)
    for name, values in want.items():
        assert got[name][0] == "MXFP4", name
        np.testing.assert_array_equal(got[name][1], values, err_msg=name)
    reader = gguf.GGUFReader(out)
    assert {t.tensor_type.name for t in reader.tensors if t.name == "blk.0.attn_q.weight"} == {quant.upper()}
    file_type = reader.fields["general.file_type"].contents()
    assert file_type == (gguf.LlamaFileType.MOSTLY_MXFP4_MOE if quant == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)


def test_experts_the_adapter_changed_are_written_unquantised(runs, tmp_path):
    """The trained run merged its expert LoRA: those stacks are written in the file's type, each value the merged
    model's (the converter's treatment of unquantised experts)."""
    from rocktune.export.merge import merged_model
    from rocktune.export.source import resolve

    run = runs["mxfp4"][0]
    assert main(["export", str(run), "--to", "gguf", "--quant", "f32"]) == 0
    got = _experts(run / "export" / "model-f32.gguf")
    state = merged_model(resolve(str(run)), "fp32")[0].state_dict()
    want = {k: v for key in state if key.endswith(("experts.gate_up_proj", "experts.down_proj"))
            for k, v in _llama_layout(key, state[key].numpy()).items()}
    assert set(got) == set(want)
    for name, values in want.items():
        assert got[name][0] == "F32", name
        np.testing.assert_array_equal(got[name][1], values, err_msg=name)


def test_experts_the_adapter_left_alone_keep_their_mxfp4_bytes(checkpoint, tmp_path):
    """An adapter on attention only: the experts' GGUF tensors are the base export's bytes (the checkpoint's blocks),
    the attention the merged one's."""
    import gguf

    from tests.export_fixtures import make_run

    make_run(tmp_path / "run", checkpoint[0], ATTENTION, data_format="messages")
    base = tmp_path / "base.gguf"
    assert main(["export", str(checkpoint[0]), "--to", "gguf", "--quant", "f16", "--out", str(base)]) == 0
    assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", "f16"]) == 0
    ours, theirs = _experts(tmp_path / "run" / "export" / "model-f16.gguf"), _experts(base)
    assert {n: (t, raw) for n, (t, _, raw) in ours.items()} == {n: (t, raw) for n, (t, _, raw) in theirs.items()}
    q = {path: next(t.data.tobytes() for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
         for path in (base, tmp_path / "run" / "export" / "model-f16.gguf")}
    assert len(set(q.values())) == 2  # the adapter's change is there


def test_requantising_merged_experts_would_round_most_of_the_change_away(runs, checkpoint):
    """Why changed experts are not requantised to MXFP4 (docs/moe.md): the base's values lie on the MXFP4 grid, so
    a change smaller than half a step rounds back to them. Even on this run's changes (a median 8-11% of each
    weight, more than a real fine-tune makes) gguf-py's MXFP4 quantiser returns most values to the base's."""
    import gguf

    from rocktune.export.merge import merged_model
    from rocktune.export.source import resolve

    state = merged_model(resolve(str(runs["mxfp4"][0])), "fp32")[0].state_dict()
    mx = gguf.GGMLQuantizationType.MXFP4
    for key, base in checkpoint[1].items():
        merged = np.swapaxes(state[key].numpy(), -1, -2)
        base = np.swapaxes(base, -1, -2).astype(np.float32)
        back = gguf.quants.dequantize(gguf.quants.quantize(merged, mx), mx)
        changed = merged != base
        assert changed.mean() > 0.99, key
        assert (back == base)[changed].mean() > 0.7, key  # measured 0.75 (gate_up) and 0.85 (down)


def test_a_k_quant_file_is_made_from_the_packed_experts_values(checkpoint, tmp_path, monkeypatch):
    """llama.cpp's quantiser requantises no block type, so a k-quant's f32 file carries the experts' values (what
    llama-quantize --allow-requantize makes of the converter's file). The tiny rows are no multiple of 256 and the
    quantiser is not needed to see that: it is replaced by a copy of its input."""
    import shutil

    from rocktune.export import quant

    monkeypatch.setattr(quant, "check_quant", lambda *a: None)
    monkeypatch.setattr(quant, "llama_cpp_quantize", lambda src, dst, q: shutil.copyfile(src, dst))
    out = tmp_path / "k.gguf"
    assert main(["export", str(checkpoint[0]), "--to", "gguf", "--quant", "q4_k_m", "--out", str(out)]) == 0
    got = _experts(out)
    for key, stack in checkpoint[1].items():
        for name, values in _llama_layout(key, stack).items():
            assert got[name][0] == "F32"
            np.testing.assert_array_equal(got[name][1], values, err_msg=name)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("quant", ["f32", "f16"])
def test_the_base_gguf_equals_llama_cpps_converter_on_the_checkpoint(checkpoint, tmp_path, quant):
    """llama.cpp's convert_hf_to_gguf.py on the MXFP4 checkpoint itself and rocktune's export of it: every tensor
    (the MXFP4 experts' bytes included) and every metadata key equal (tests/test_gguf_converter.py's comparison)."""
    from tests.llama_cpp_converter import convert, converter_source
    from tests.test_gguf_converter import assert_same_gguf, read

    src = converter_source()
    if src is None:
        pytest.skip("no llama.cpp source tree (set ROCKTUNE_LLAMA_CPP_SRC; tests/llama_cpp_converter.py says how)")
    ours = tmp_path / "ours.gguf"
    assert main(["export", str(checkpoint[0]), "--to", "gguf", "--quant", quant, "--out", str(ours)]) == 0
    done = convert(src, checkpoint[0], tmp_path / "theirs.gguf", quant, read(ours)[0]["tokenizer.ggml.pre"],
                   "gpt_oss")
    assert done.returncode == 0, done.stderr[-3000:]
    assert assert_same_gguf(ours, tmp_path / "theirs.gguf", "gpt-oss") == 41


@pytest.mark.llama_cpp
def test_the_run_gguf_equals_llama_cpps_converter_on_the_merged_run(runs, tmp_path):
    """After the merged expert LoRA: rocktune's GGUF equals the converter's on the run's `--to merged --dtype fp32`
    directory, whose experts are unquantised."""
    from tests.llama_cpp_converter import convert, converter_source
    from tests.test_gguf_converter import assert_same_gguf, read

    src = converter_source()
    if src is None:
        pytest.skip("no llama.cpp source tree (set ROCKTUNE_LLAMA_CPP_SRC; tests/llama_cpp_converter.py says how)")
    run = runs["mxfp4"][0]
    ours = tmp_path / "ours.gguf"
    assert main(["export", str(run), "--to", "gguf", "--quant", "f32", "--out", str(ours)]) == 0
    assert main(["export", str(run), "--to", "merged", "--dtype", "fp32", "--out", str(tmp_path / "merged")]) == 0
    done = convert(src, tmp_path / "merged", tmp_path / "theirs.gguf", "f32", read(ours)[0]["tokenizer.ggml.pre"],
                   "gpt_oss")
    assert done.returncode == 0, done.stderr[-3000:]
    assert assert_same_gguf(ours, tmp_path / "theirs.gguf", "gpt-oss") == 41


@pytest.mark.llama_cpp
def test_llama_cpp_runs_the_mxfp4_base_and_its_lora_as_transformers_does(checkpoint, runs, monkeypatch):
    """llama.cpp (llama-cpp-python) loads the base GGUF with its MXFP4 experts and continues a prompt with
    transformers' 16 greedy tokens (its logits within 5% of theirs: llama.cpp's MXFP4 matmul rounds the activations
    to 8 bits); with the run's GGUF LoRA on it, with the trained model's tokens."""
    pytest.importorskip("llama_cpp", reason="not run here (llama-cpp-python not installed)")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_export_llama_cpp import TEXTS, hf_greedy, llama, llama_greedy, use_plain_cpu_buffers

    use_plain_cpu_buffers(monkeypatch)
    run = runs["mxfp4"][0]
    ids = AutoTokenizer.from_pretrained(checkpoint[0])(TEXTS[0])["input_ids"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32),
                                      str(run / "adapter"))
    tuned = hf_greedy(model, ids, 16)
    with model.disable_adapter():
        plain = hf_greedy(model, ids, 16)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy()
    assert tuned != plain
    assert main(["export", str(run), "--to", "gguf-lora", "--with-base"]) == 0
    out = run / "export"
    assert {t for t, _, _ in _experts(out / "base-f16.gguf").values()} == {"MXFP4"}
    base = llama(out / "base-f16.gguf")
    assert llama_greedy(base, ids, 16) == plain
    base.reset()
    base.eval(ids)
    err = np.sqrt(((np.array(base.scores[:len(ids)]) - logits) ** 2).mean()) / logits.std()
    assert err < 0.05, err  # measured 1.3%
    assert llama_greedy(llama(out / "base-f16.gguf", lora=out / "adapter-f32.gguf"), ids, 16) == tuned
