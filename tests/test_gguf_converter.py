"""Our GGUF export against llama.cpp's own converter: for each family of the matrix, the tiny model is trained
(random LoRA), merged (--to merged) and exported (--to gguf, f32 and f16); llama.cpp's convert_hf_to_gguf.py converts
the same merged directory, and the two files must hold the same tensors (names, types, shapes, bytes) and the same
metadata.

What we write beyond the converter is a closed list (EXTRA_KEYS): values llama.cpp's loader would otherwise derive
the same way, and the merges key its BPE loader needs. Skipped, with the reason, when no llama.cpp source tree is
found (tests/llama_cpp_converter.py says how to unpack one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rocktune.cli import main
from rocktune.export.arch import ARCHS
from tests.family_fixtures import BY_NAME, FAMILIES, build_family
from tests.gguf_variants import build_variant, gemma_tokenizer
from tests.llama_cpp_converter import convert, converter_source

pytestmark = pytest.mark.llama_cpp
# keys of the converter's file that name the file, not the model
NAMING = {"general.name", "general.size_label", "GGUF.kv_count", "GGUF.tensor_count"}
# keys only we write: the head and rope widths and vocabulary size the loader would derive the same way, whether
# the tokenizer adds BOS/EOS (read off the tokenizer), the BPE merges the loader requires, what it was made from
EXTRA_KEYS = ("{a}.rope.dimension_count", "{a}.vocab_size", "{a}.attention.key_length", "{a}.attention.value_length",
              "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.merges",
              "rocktune.source_digest")
# what the converter cannot do on the tiny fixture (it is no statement about our export)
CONVERTER_CANNOT = {
    "phi3": "the converter reads Phi-3's vocabulary from tokenizer.model only; the fixture's is BPE",
    "gemma2": "the converter reads Gemma 2's vocabulary from tokenizer.model only; the fixture's is BPE",
}
# Gemma 3: the converter cuts the embedding to the tokenizer's tokens (rocktune keeps the config's padding rows as
# unused tokens; llama.cpp loads both) and leaves the sliding pattern to the loader's default (rocktune writes the
# config's, per layer)
TRIMMED_EMBEDDING = {"gemma3"}
# the fixture as the released checkpoints have it, where the converter reads something the fixture lacks: Granite 4's
# hybrids have no positions ("nope": the converter never writes rope for them) and a vocabulary padded to a multiple
# of 8 (the converter pads the token list to one, never the embedding); Gemma 4's tokenizer is Gemma's own kind (the
# converter reads no other), with as many tokens as embedding rows (it cuts the embedding to the tokenizer, never
# the per-layer one)
AS_RELEASED = {"granite4": ({"position_embedding_type": "nope", "vocab_size": 304}, None),
               "gemma4": ({}, gemma_tokenizer)}
# transformers 5 saves Granite 4's layer kinds under new names; the released config.json (and the converter, which
# reads only these) has the old ones
RELEASED_LAYER_TYPES = {"granite4": {"linear_attention": "mamba", "full_attention": "attention"}}
GEMMA_KEYS = ("{a}.attention.sliding_window_pattern",)


def read(path) -> tuple[dict, dict]:
    import gguf

    reader = gguf.GGUFReader(path)
    kv = {n: f.contents() for n, f in reader.fields.items() if n not in NAMING}
    return kv, {t.name: t for t in reader.tensors}


def assert_same_gguf(ours, theirs, arch: str, trimmed_embedding: bool = False) -> int:
    """Every key and tensor of the converter's file, equal in ours; ours adds only EXTRA_KEYS. Returns the number of
    tensors compared."""
    kv, tensors = read(ours)
    want_kv, want_tensors = read(theirs)
    extra = set(kv) - set(want_kv)
    allowed = EXTRA_KEYS + (GEMMA_KEYS if trimmed_embedding else ())
    assert extra <= {k.format(a=arch) for k in allowed}, sorted(extra)
    assert not set(want_kv) - set(kv), sorted(set(want_kv) - set(kv))
    for key, value in want_kv.items():
        assert kv[key] == value, key
    assert set(tensors) == set(want_tensors), sorted(set(tensors) ^ set(want_tensors))
    for name, t in want_tensors.items():
        got = tensors[name]
        if trimmed_embedding and name == "token_embd.weight":
            rows = int(t.shape[1])  # the converter's rows: the tokenizer's tokens; ours past them are unused tokens
            assert rows < int(got.shape[1]) and got.data[:rows].tobytes() == t.data.tobytes(), name
            assert set(kv["tokenizer.ggml.token_type"][rows:]) == {5}  # gguf's TokenType.UNUSED
            continue
        assert (got.tensor_type, list(got.shape)) == (t.tensor_type, list(t.shape)), name
        assert got.data.tobytes() == t.data.tobytes(), name
    return len(want_tensors)


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_gguf_equals_llama_cpp_converter(tmp_path, record_property, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rocktune.models.load import lora_targets
    from tests.export_fixtures import make_run

    src = converter_source()
    if src is None:
        pytest.skip("no llama.cpp source tree (set ROCKTUNE_LLAMA_CPP_SRC; tests/llama_cpp_converter.py says how)")
    if name in AS_RELEASED:
        changes, tokenizer = AS_RELEASED[name]
        base = build_variant(name, tmp_path / "base", changes, tokenizer and tokenizer())
    else:
        base = build_family(BY_NAME[name], tmp_path / "base")
    model_type = AutoConfig.from_pretrained(base).model_type
    if model_type not in ARCHS:
        pytest.skip(f"export --to gguf refuses {model_type} (tests/test_families.py::test_gguf)")
    if name in CONVERTER_CANNOT:
        pytest.skip(CONVERTER_CANNOT[name])
    targets, params = lora_targets(AutoModelForCausalLM.from_pretrained(base), "all-linear")
    make_run(tmp_path / "run", base, targets, data_format="messages",
             **({"target_parameters": params} if params else {}))
    assert main(["export", str(tmp_path / "run"), "--to", "merged", "--dtype", "fp32"]) == 0
    if name in RELEASED_LAYER_TYPES:
        _released_layer_types(tmp_path / "run" / "export" / "merged" / "config.json", RELEASED_LAYER_TYPES[name])
    for quant in ("f32", "f16"):  # f16: which tensors stay f32 (routers, conv kernels, biases) as well
        assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", quant]) == 0
        ours = tmp_path / "run" / "export" / f"model-{quant}.gguf"
        done = convert(src, tmp_path / "run" / "export" / "merged", tmp_path / f"converter-{quant}.gguf", quant,
                       read(ours)[0].get("tokenizer.ggml.pre", "default"), model_type)
        assert done.returncode == 0, done.stderr[-3000:]
        n = assert_same_gguf(ours, tmp_path / f"converter-{quant}.gguf", ARCHS[model_type].gguf_name,
                             name in TRIMMED_EMBEDDING)
    record_property("cell", f"equal to convert_hf_to_gguf.py in f32 and f16 ({n} tensors)")


def _released_layer_types(config: Path, names: dict) -> None:
    doc = json.loads(config.read_text())
    doc["layer_types"] = [names.get(t, t) for t in doc["layer_types"]]
    config.write_text(json.dumps(doc))
