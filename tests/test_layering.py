"""Layers import downward only (DESIGN.md): checked on the source, so a new upward import fails here."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src" / "rocktune"
# layer -> rocktune subpackages/modules it must never import
FORBIDDEN = {
    "platform": {"train", "data", "model", "cli", "doctor", "bench", "demo", "planner"},
    "planner": {"train", "data", "model", "cli", "doctor", "bench", "demo"},
    "data": {"train", "model", "cli", "doctor", "bench", "demo", "planner"},
    "model.py": {"train", "cli", "doctor", "bench", "demo"},
    "modelcheck.py": {"train", "data", "model", "cli", "doctor", "bench", "demo", "planner"},
    "quant.py": {"train", "data", "model", "cli", "doctor", "bench", "demo"},
    "doctor": {"train", "data", "model", "cli", "bench", "demo", "planner"},
    "train": {"cli", "bench", "demo", "report"},
    # report reads run directories and data (the preview encodes with the data layer and the model's tokenizer);
    # it never drives training, so the loop, the CLI and the commands that train stay out of it.
    "report": {"train", "cli", "bench", "demo", "doctor", "export"},
    # export reads run directories (adapter, config) and never drives training or reporting.
    "export": {"train", "cli", "bench", "demo", "doctor", "report"},
    # diffusion (Wan LoRA) is data, model and numerics for train/diffusion_loop.py, which drives it: never upward.
    "diffusion": {"train", "cli", "bench", "demo", "doctor", "report", "export"},
    # the hardened readers of outside files sit under every layer that opens such files (modelcheck, data, export,
    # report, config), so they import nothing of rocktune but errors.
    "readers": {"train", "data", "model", "cli", "doctor", "bench", "demo", "planner", "platform", "config",
                "modelcheck", "quant", "report", "export", "diffusion", "hub"},
    # the CLI enters the private temporary folder before anything else is imported: standard library only.
    "tempdir.py": {"train", "data", "model", "cli", "doctor", "bench", "demo", "planner", "platform", "config",
                   "modelcheck", "quant", "report", "export", "diffusion", "hub", "readers", "errors"},
}


def rocktune_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rocktune."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("rocktune.")}
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_upward_imports(layer):
    files = [SRC / layer] if layer.endswith(".py") else sorted((SRC / layer).rglob("*.py"))
    assert files
    bad = {f"{f.relative_to(SRC)} imports rocktune.{m}" for f in files for m in rocktune_imports(f) & FORBIDDEN[layer]}
    assert not bad, sorted(bad)


def test_plan_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from rocktune.cli import main; main(['plan', 'Qwen2.5-0.5B', '--vram', '8GiB', '--json']); "
            "sys.stderr.write(str('torch' in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr.strip().endswith("False"), res.stderr
