"""Layers import downward only (docs/architecture.md, "The layers"): checked on the source, so a new upward import
fails here; and no two modules import each other, directly or round a circle, even inside functions."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src" / "rocktune"
# The processes and the tasks sit above the engine; nothing below them drives training.
ABOVE_ENGINE = {"cli", "bench", "demo", "process", "tasks"}
# layer (a package, a package's file, or a module) -> what under rocktune it must never import: a package
# ("models") or a module in one ("models.load"), by its dotted path under rocktune
FORBIDDEN = {
    "errors.py": {"*"},
    "exits.py": {"*"},
    "atomic.py": {"*"},
    # the table of tasks: read by the config and the launching process, so standard library only
    "task_registry.py": {"*"},
    "dtypes.py": {"*"},  # dtype spellings: read by config, cli and the planner alike, so it imports nothing
    "builtin_templates.py": {"*"},  # rocktune's own chat template text: read by readers/template.py and export
    "config_base.py": {"*"},  # the section base and field tag: below config.py and every task's own section
    "platform": {"train", "data", "models", "doctor", "planner", *ABOVE_ENGINE},
    "planner": {"train", "data", "models", "doctor", *ABOVE_ENGINE},
    # data reads hub ids through the hub probe (models/hub.py, data/sources.py), never model loading
    "data": {"train", "models.load", "doctor", "planner", *ABOVE_ENGINE},
    # models/: loading, the model-directory check, quantisation, the hub probe; below the engine
    "models": {"train", "doctor", *ABOVE_ENGINE},
    "models/check.py": {"train", "data", "models.load", "doctor", "planner", *ABOVE_ENGINE},
    "models/quant.py": {"train", "data", "models.load", "doctor", *ABOVE_ENGINE},
    "models/hub.py": {"train", "data", "models.load", "doctor", "planner", *ABOVE_ENGINE},  # below data (sources.py)
    "vision": {"train", "doctor", *ABOVE_ENGINE},  # vision-language models: task=vlm, generate --image
    "vision/families.py": {"train", "models", "vision.model", "doctor", *ABOVE_ENGINE},  # their runtime: below models
    # the one table of vision-language families: standard library only, read by the planner, data, export and demo
    "vision/table.py": {"*"},
    # varlen attention glue: used by the doctor's self-test and by the LM tasks' model building; below models
    "kernels": {"train", "models", "doctor", "planner", *ABOVE_ENGINE},
    # the LoRA side paths and their check
    "lora": {"train", "data", "models", "doctor", "planner", *ABOVE_ENGINE},
    "lora/fused.py": {"*"},  # the fused LoRA node: torch only, below lora/lean.py
    # the reference and its judge (lora/check.py: the matrix, doctor --model, the run's tripwire) sit above lora/lean.py
    "lora/lean.py": {"lora.check"},
    "doctor": {"train", "data", "models.load", "planner", *ABOVE_ENGINE},
    # the engine: the one loop and its reliability parts know no task (no LM data code, no diffusers)
    "train": {"report", "export", "data", *ABOVE_ENGINE},
    # a task is set up from the engine's parts; it never starts processes or reads back reports
    "tasks": {"cli", "bench", "demo", "process", "report", "export"},
    # the causal-LM kit: inside the tasks layer, below every task that imports it
    "tasks/causal": {"tasks.lm", "tasks.preference", "tasks.grpo", "tasks.vlm", "tasks.wan"},
    # supervisor, worker, torchrun launcher: above the tasks, below the CLI
    "process": {"cli", "bench", "demo", "report", "export", "doctor"},
    # report reads run directories and data (the preview encodes with the data layer and the model's tokenizer);
    # it never drives training, so the loop, the CLI and the commands that train stay out of it.
    "report": {"train", "doctor", "export", *ABOVE_ENGINE},
    # export reads run directories (adapter, config) and never drives training or reporting.
    "export": {"train", "doctor", "report", *ABOVE_ENGINE},
    # Wan's media, latents, flow matching and ComfyUI file: data, model and numerics for tasks/wan/task.py, which
    # drives them; they never reach the engine or another task.
    "tasks/wan/diffusion": {"train", "doctor", "report", "export", "tasks.lm", "tasks.causal", "tasks.preference",
                            "tasks.grpo", "tasks.vlm", *ABOVE_ENGINE - {"tasks"}},
    # the hardened readers of outside files sit under every layer that opens such files (models/check.py, data,
    # export, report, config), so they import nothing of rocktune but errors.
    "readers": {"train", "data", "models", "lora", "kernels", "vision", "doctor", "planner", "platform", "config",
                "report", "export", "exits", "atomic", "tempdir", *ABOVE_ENGINE},
    # the CLI enters the private temporary folder before anything else is imported: standard library only.
    "tempdir.py": {"*"},
}


# A task's folder holds its part of the layers below and above it, each in a sub-folder named after the layer
# (tasks/vlm/data/, tasks/vlm/vision/, tasks/vlm/planner/, tasks/vlm/export/, tasks/grpo/report/, tasks/vlm/demo/):
# such a file is at that layer, obeys its rules, and is named by its role path ("data/vision.py") in them.
ROLE_LAYERS = ("data", "vision", "planner", "export", "report", "bench", "demo")


def role(dotted: str) -> str:
    """``tasks.vlm.data.vision`` -> ``data.vision``: the layer a task's sub-folder module is at; others unchanged."""
    parts = dotted.split(".")
    if len(parts) >= 3 and parts[0] == "tasks" and parts[2] in ROLE_LAYERS:
        return ".".join(parts[2:])
    return dotted


def role_path(f: Path) -> str:
    return role(".".join(f.relative_to(SRC).with_suffix("").parts)).replace(".", "/") + ".py"


def rocktune_imports(path: Path) -> set[str]:
    """What a file imports of rocktune, by dotted path under rocktune: ``from rocktune.models.load import x`` gives
    "models.load" (and "models.load.x"), ``from rocktune.models import quant`` "models" and "models.quant"."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rocktune."):
            base = node.module.removeprefix("rocktune.")
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "rocktune":  # from rocktune import exits
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("rocktune.") for a in node.names if a.name.startswith("rocktune.")}
    return out


def breaks(imported: str, forbidden: set[str]) -> bool:
    """A rule names a package or a module: "models" forbids every module under it, "models.load" that one."""
    if "*" in forbidden:
        return imported != "__init__"
    return any(imported == rule or imported.startswith(rule + ".") for rule in forbidden)


# A task's data preview (its registry ``preview`` hook, and the page it draws) sits at the report layer inside the
# task's folder: it may draw with report's primitives, and nothing of the task imports it (the registry loads it).
PREVIEW_FILES = ("preview.py", "page.py")
DRAWING = {"report.page", "report.preview_view"}


def _preview_exception(f: Path, imported: str) -> bool:
    rel = f.relative_to(SRC).parts
    return len(rel) == 3 and rel[0] == "tasks" and rel[2] in PREVIEW_FILES and breaks(imported, DRAWING)


def layer_files(layer: str) -> list[Path]:
    """The files a FORBIDDEN key governs, by role path: a task's ``data/`` sub-folder is governed by "data"."""
    key = layer if layer.endswith(".py") else layer + "/"
    return [f for f in sorted(SRC.rglob("*.py")) if role_path(f) == key or role_path(f).startswith(key)]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_upward_imports(layer):
    files = layer_files(layer)
    assert files
    forbidden = FORBIDDEN[layer]
    bad = {f"{f.relative_to(SRC)} imports rocktune.{m}" for f in files for m in rocktune_imports(f)
           if breaks(role(m), forbidden) and not _preview_exception(f, m)}
    assert not bad, sorted(bad)


def test_a_task_layer_part_stays_in_its_layer():
    """A task's sub-folder below the tasks layer (its data, vision, planner, export, report parts) never imports the
    task itself or another task's code; only its bench and demo parts, which sit above the tasks, may."""
    bad = set()
    for f in sorted((SRC / "tasks").rglob("*.py")):
        parts = f.relative_to(SRC).parts
        if len(parts) < 4 or parts[2] not in ROLE_LAYERS or parts[2] in ("bench", "demo"):
            continue
        for m in rocktune_imports(f):
            if m.startswith("tasks.") and role(m) == m and m not in ("tasks", "tasks.__init__"):
                bad.add(f"{f.relative_to(SRC)} imports rocktune.{m}")
    assert not bad, sorted(bad)


def test_role_paths():
    assert role("tasks.vlm.data.vision") == "data.vision" and role("tasks.vlm.task") == "tasks.vlm.task"
    assert role_path(SRC / "tasks" / "vlm" / "vision" / "table.py") == "vision/table.py"
    assert SRC / "tasks" / "vlm" / "vision" / "table.py" in layer_files("vision/table.py")
    assert SRC / "tasks" / "vlm" / "task.py" in layer_files("tasks")
    assert SRC / "tasks" / "vlm" / "data" / "vision.py" not in layer_files("tasks")


def test_no_task_code_imports_a_preview():
    """The preview files are above their task: only another preview file of the same task may import them."""
    bad = set()
    for f in sorted((SRC / "tasks").rglob("*.py")):
        rel = f.relative_to(SRC).parts
        for m in rocktune_imports(f):
            parts = m.split(".")
            if len(parts) >= 3 and parts[0] == "tasks" and f"{parts[2]}.py" in PREVIEW_FILES and \
                    not (rel[-1] in PREVIEW_FILES and rel[1] == parts[1]):
                bad.add(f"{f.relative_to(SRC)} imports rocktune.{m}")
    assert not bad, sorted(bad)


def test_every_package_has_a_layer():
    """A new package must be placed in FORBIDDEN, or it would escape this test."""
    placed = {k.removesuffix(".py") for k in FORBIDDEN} | {"cli", "bench", "demo", "config", "__main__", "__init__"}
    present = {p.stem if p.is_file() else p.name for p in SRC.iterdir() if p.suffix == ".py" or
               (p.is_dir() and (p / "__init__.py").exists())}
    assert present <= placed, sorted(present - placed)


def module_graph() -> dict[str, set[str]]:
    """rocktune module -> the rocktune modules it imports anywhere in its file (functions included)."""
    names = {}
    for f in SRC.rglob("*.py"):
        parts = f.relative_to(SRC.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in names.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_between_files():
    assert not circles(module_graph())


def test_the_circle_check_can_fail():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_plan_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from rocktune.cli import main; main(['plan', 'Qwen2.5-0.5B', '--vram', '8GiB', '--json']); "
            "sys.stderr.write(str('torch' in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr.strip().endswith("False"), res.stderr


# What still takes more than 9 parameters, each with the reason it has not been grouped yet; a new entry needs one.
WIDE_ALLOWED = {
    "kernels/attention.py:reference_varlen": "a stand-in for torch's varlen_attn: it must take the kernel's own "
                                             "signature",
}


def test_no_function_takes_more_than_nine_parameters():
    """What travels together is one typed object (docs/architecture.md, Conventions): a request, a spec, a config
    section, a context."""
    wide = set()
    for f in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if len(names) > 9:
                    wide.add(f"{f.relative_to(SRC)}:{node.name}")
    assert wide <= set(WIDE_ALLOWED), sorted(wide - set(WIDE_ALLOWED))
