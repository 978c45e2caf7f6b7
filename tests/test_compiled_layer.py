"""Issue 36, item 1: the compiler sees the whole layer. A real decoder layer with rocktune's LoRA adapters and
varlen attention (its opaque CPU stand-in) compiled by Inductor on the CPU: no graph break, one graph per width
until the second width makes the length symbolic, and the kernels in Inductor's output code bounded by what was
counted (benchmarks/compiled_layer.py prints them), so a change that adds kernels or breaks the graph fails here.
Who fuses that work on a GPU (Liger or Inductor) is ``build.fusion``'s choice, logged and in the bench row."""

from __future__ import annotations

import pytest

from rocktune.tasks.causal import build

# Counted with `PYTHONPATH=src python benchmarks/compiled_layer.py` (torch 2.13 CPU, lean LoRA as of this commit):
# (generated C++ kernels, library calls: matmuls) of the first width's forward and backward.
# with the fused LoRA side path (rocktune.lora.fused), counted by benchmarks/compiled_layer.py on torch 2.13 (CPU)
COUNTED = {"qwen2": {"forward": (6, 18), "backward": (7, 29)}, "llama": {"forward": (6, 18), "backward": (7, 29)}}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_compiled_lora_layer_has_no_graph_break_two_graphs_at_most_and_bounded_kernels(family):
    from rocktune.bench.layer_code import LayerCase, compiled_layer_code
    from tests.varlen_standin import opaque_varlen

    got = compiled_layer_code(LayerCase(family, (256, 256, 384, 512)), opaque_varlen)
    assert got["graph_breaks"] == 0, got["graph_break_reasons"]
    # the same width again reuses the graph; the second width recompiles once with a symbolic length, which the
    # third reuses
    assert got["graphs"] == 2 and got["recompiles"] == 1, got
    for part in ("forward", "backward"):
        generated, extern = COUNTED[family][part]
        assert 0 < got[part]["generated"] <= generated and 0 < got[part]["extern"] <= extern, (part, got[part])


def test_under_compile_auto_leaves_the_layer_to_inductor_and_says_so(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "liger_kernel" else real(n, *a))
    use, note = build.fusion("auto", "cuda", compiled=True)
    assert not use and note.startswith("fusion: inductor (") and "opaque to Inductor" in note
    use, note = build.fusion("auto", "cuda", compiled=False)
    assert use and note.startswith("fusion: liger (")
    use, note = build.fusion("on", "cuda", compiled=True)
    assert use and "set model.liger=auto to let Inductor fuse" in note
    assert build.fusion("off", "cuda", compiled=True) == (False, "fusion: inductor (torch.compile fuses the whole "
                                                                 "layer; Liger left out)")
    assert build.fusion("off", "cuda", compiled=False) == (False, "fusion: none (eager, no Liger)")
    assert build.fusion("auto", "cpu", compiled=False) == (False, None)  # nothing to choose: no note
    assert build.fusion("auto", "cpu", compiled=True)[1].startswith("fusion: inductor (")


def test_the_bench_row_reads_the_fusion_choice(tmp_path):
    import json

    from rocktune.bench.child import ran

    (tmp_path / "run_info.json").write_text(json.dumps({"notes": [
        "attention: varlen_attn", "fusion: inductor (torch.compile fuses the whole layer; Liger left out)"]}))
    got = ran(tmp_path, [])
    assert got["fusion"] == "inductor" and got["fusion_note"].startswith("inductor (torch.compile")
