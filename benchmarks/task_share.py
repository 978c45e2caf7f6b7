"""How much of each task's code lives in its own folder (issue: a task owns everything that is about it); prints
one JSON object.

    python benchmarks/task_share.py            # every task with its own folder
    python benchmarks/task_share.py --list     # and the definitions outside its folder that mention it

A task's lines inside are every line of the files under ``src/rocktune/tasks/<folder>/``. Its lines outside are the
lines of the top-level functions (whole) and of the members of top-level classes (methods, fields) outside every
task's folder (the causal-LM kit, ``tasks/causal``, counts as outside) whose code, docstrings and comments left out,
names one of the task's words: a crude but strict reading, since a shared function that merely names the task
counts against it whole. The share is inside / (inside + outside).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "rocktune"
# folder -> the words that mark a definition as about that task (case-insensitive, whole words)
TASKS = {
    "vlm": r"vlm|vision|image|images|pixel|pixels|mmproj",
    "grpo": r"grpo|rollout|rollouts|eval_reward",
    "preference": r"dpo|orpo|preference|pairs",
    "wan": r"wan|diffusion|video|comfy|comfyui",
}


def _code(node: ast.AST) -> str:
    """The definition's code without its docstrings (ast.unparse drops the comments)."""
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            inner.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    return ast.unparse(node)


def _lines(node: ast.AST) -> int:
    return (getattr(node, "end_lineno", None) or node.lineno) - node.lineno + 1  # type: ignore[attr-defined]


def _defs(path: Path) -> list[tuple[str, int, str]]:
    """(name, lines, code) of each top-level function, and of each member of a top-level class (a method, a field:
    a config section's field tagged for one task counts for it, not the whole section)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.name, _lines(node), _code(node)))
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.Expr) and isinstance(member.value, ast.Constant):
                    continue  # the class's docstring
                name = getattr(member, "name", None) or ast.unparse(getattr(member, "target", member))[:40]
                out.append((f"{node.name}.{name}", _lines(member), _code(member)))
    return out


def share(folder: str, words: str) -> dict:
    own = SRC / "tasks" / folder
    inside = sum(len(f.read_text().splitlines()) for f in own.rglob("*.py"))
    marker = re.compile(rf"\b({words})\b", re.IGNORECASE)
    outside = []
    folders = [p for p in (SRC / "tasks").iterdir() if p.is_dir() and p.name not in ("causal", "__pycache__")]
    for f in sorted(SRC.rglob("*.py")):
        if any(d in f.parents for d in folders):
            continue
        for name, lines, src in _defs(f):
            if marker.search(src):
                outside.append((f"{f.relative_to(SRC)}:{name}", lines))
    out_lines = sum(n for _, n in outside)
    return {"inside": inside, "outside": out_lines, "share": round(inside / (inside + out_lines), 3),
            "outside_definitions": outside}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the definitions counted outside")
    args = parser.parse_args(argv)
    found = {name: share(name, words) for name, words in TASKS.items()}
    if not args.list:
        for row in found.values():
            row.pop("outside_definitions")
    print(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
