"""Files crafted to be hostile get one clear refusal from every command that opens them: exit 2, the file named, no
traceback, no hang (a subprocess timeout), bounded memory (the child's peak RSS), nothing written. One table per
class: chat templates that leave the sandbox, safetensors headers that lie, JSON nested a million levels, YAML
alias bombs; then the temporary folder an export leaves behind (nothing, also when it is killed)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.export_fixtures import build_model, make_run

TIMEOUT_S = 240  # torch imports on a loaded 2-core machine; a hang (the old alias bomb) would run far past it
MAX_RSS_BYTES = 3 * 2**30  # a refused file costs no more than loading a tiny model; the alias bomb passed 2 GB
DEEP_JSON = "[" * 1_000_000 + "]" * 1_000_000
# the classic escape: from a jinja global to Python's module globals; the sandbox refuses it mid-render
ESCAPE = "{{ cycler.__init__.__globals__.os.popen('id').read() }}"
MESSAGES = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "answer"}]}
            for i in range(8)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny base (ChatML template in chat_template.jinja) and a run trained on it, never modified: each case
    copies what it spoils."""
    root = tmp_path_factory.mktemp("hostile")
    base = build_model(root / "base", "qwen2")
    make_run(root / "run", base, ["q_proj", "v_proj"])
    return base, root / "run"


def clean_env(**extra: str) -> dict:
    """This process's environment without torch's cache settings: importing torch here (the fixtures do) pointed
    TORCHINDUCTOR_CACHE_DIR at the system temporary folder, and a child would inherit that."""
    from rocktune.tempdir import CACHE_VARS

    return {**{k: v for k, v in os.environ.items() if k not in CACHE_VARS}, **extra}


def cli(argv: list[str], env: dict | None = None, timeout: float = TIMEOUT_S) -> tuple[int, str, float, int]:
    """Run ``python -m rocktune ARGV``; returns (exit status, stdout + stderr, seconds, peak RSS in bytes: the largest
    of this test process's children so far, an upper bound for this one and the worker it may start)."""
    t0 = time.monotonic()
    with subprocess.Popen([sys.executable, "-m", "rocktune", *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=env or dict(os.environ)) as proc:
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail(f"rocktune {' '.join(argv)} ran past {timeout} s (a hang)")
    peak = _children_peak_rss()
    return proc.returncode, text.decode(errors="replace"), time.monotonic() - t0, peak


def _children_peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def assert_refused(argv: list[str], named: Path, watch: Path) -> str:
    before = tree(watch)
    code, text, _, peak = cli(argv)
    flat = " ".join(text.split())
    assert code == 2, text[-3000:]
    assert str(named) in flat, flat
    assert "Traceback" not in text and flat.count("error:") == 1, text[-3000:]
    assert peak < MAX_RSS_BYTES, f"peak RSS {peak / 2**30:.1f} GiB"
    assert tree(watch) == before, sorted(tree(watch) ^ before)  # nothing written, nothing left half-written
    return flat


def copy_case(pristine, tmp_path: Path) -> tuple[Path, Path]:
    base, run = pristine
    shutil.copytree(base, tmp_path / "base")
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "base", tmp_path / "run"


# --- 1. chat templates that reach for internals -------------------------------------------------------------------


def _hostile_template(base: Path) -> Path:
    file = base / "chat_template.jinja"
    file.write_text(ESCAPE + file.read_text(encoding="utf-8"), encoding="utf-8")
    return file


def _messages_file(tmp_path: Path) -> Path:
    file = tmp_path / "chat.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in MESSAGES), encoding="utf-8")
    return file


def _train_config(tmp_path: Path, base: Path) -> Path:
    cfg = {"model": {"name_or_path": str(base)}, "lora": {"r": 4, "alpha": 8},
           "data": {"train_file": str(_messages_file(tmp_path)), "max_length": 64, "format": "messages",
                    "cache_dir": str(tmp_path / "cache")},
           "training": {"max_steps": 2, "micro_batch_size": 2, "precision": "fp32", "device": "cpu"},
           "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return tmp_path / "c.yaml"


TEMPLATE_CASES = {
    "train": lambda t, base, run: ["train", "-c", str(_train_config(t, base))],
    "data-preview": lambda t, base, run: ["data", "preview", "--data", str(_messages_file(t)), "--model", str(base),
                                          "--html", str(t / "preview.html")],
    "generate": lambda t, base, run: ["generate", str(run), "--base", str(base), "--template", "chat",
                                      "--prompt", "hi", "--max-new-tokens", "2"],
    "export-ollama": lambda t, base, run: ["export", str(run), "--base", str(base), "--to", "ollama"],
}


@pytest.mark.parametrize("command", sorted(TEMPLATE_CASES))
def test_template_leaving_the_sandbox_is_refused(pristine, tmp_path, command):
    base, run = copy_case(pristine, tmp_path)
    template = _hostile_template(base)
    argv = TEMPLATE_CASES[command](tmp_path, base, run)
    err = assert_refused(argv, template, tmp_path)
    assert "was refused: it reaches for Python internals" in err


# --- 2. safetensors headers that lie ------------------------------------------------------------------------------


def _huge_header(file: Path) -> None:
    file.write_bytes(struct.pack("<Q", 2**62) + b"{}")


def _offsets_past_end(file: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**28], "data_offsets": [0, 2**30]}}).encode()
    file.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)


SAFETENSORS_CASES = {  # (spoil, file in base or run, command)
    "huge-header-base-export": (_huge_header, "base/model.safetensors", "export"),
    "huge-header-base-generate": (_huge_header, "base/model.safetensors", "generate"),
    "offsets-past-end-base-export": (_offsets_past_end, "base/model.safetensors", "export"),
    "huge-header-adapter-export": (_huge_header, "run/adapter/adapter_model.safetensors", "export"),
    "offsets-past-end-adapter-generate": (_offsets_past_end, "run/adapter/adapter_model.safetensors", "generate"),
}


def _command(command: str, run: Path, base: Path) -> list[str]:
    if command == "export":
        return ["export", str(run), "--base", str(base), "--to", "merged"]
    return ["generate", str(run), "--base", str(base), "--prompt", "hi", "--max-new-tokens", "2"]


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_lying_safetensors_header_is_refused(pristine, tmp_path, case):
    spoil, where, command = SAFETENSORS_CASES[case]
    base, run = copy_case(pristine, tmp_path)
    spoil(tmp_path / where)
    err = assert_refused(_command(command, run, base), tmp_path / where, tmp_path)
    assert "safetensors" in err or "truncated" in err


# --- 3. JSON nested a million levels ------------------------------------------------------------------------------


def _metrics_line(run: Path) -> Path:
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + DEEP_JSON + "\n")
    return run / "metrics.jsonl"


def _run_info(run: Path) -> Path:
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (run / "run_info.json").write_text(DEEP_JSON)
    return run / "run_info.json"


def _adapter_config(run: Path) -> Path:
    (run / "adapter" / "adapter_config.json").write_text(DEEP_JSON)
    return run / "adapter" / "adapter_config.json"


JSON_CASES = {  # (spoil the run, command)
    "adapter_config-export": (_adapter_config, lambda run, base: _command("export", run, base)),
    "adapter_config-generate": (_adapter_config, lambda run, base: _command("generate", run, base)),
    "run_info-report": (_run_info, lambda run, base: ["report", str(run)]),
    "metrics-line-report": (_metrics_line, lambda run, base: ["report", str(run)]),
}


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_deeply_nested_json_is_refused(pristine, tmp_path, case):
    spoil, argv = JSON_CASES[case]
    base, run = copy_case(pristine, tmp_path)
    named = spoil(run)
    err = assert_refused(argv(run, base), named, tmp_path)
    assert "nested too deeply" in err and "RecursionError" not in err


# --- 4. YAML alias bombs ------------------------------------------------------------------------------------------


def alias_bomb(levels: int = 9) -> str:
    """Nine levels of nine aliases: a few hundred bytes, 9**9 = 387 million values once expanded."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _bomb_config(t: Path, run: Path) -> tuple[list[str], Path]:
    (t / "c.yaml").write_text(alias_bomb() + "model:\n  name_or_path: *l8\n", encoding="utf-8")
    return ["train", "-c", str(t / "c.yaml")], t / "c.yaml"


def _bomb_run_config(t: Path, run: Path) -> tuple[list[str], Path]:
    (run / "config.yaml").write_text(alias_bomb() + "model:\n  name_or_path: *l8\n", encoding="utf-8")
    return ["export", str(run), "--to", "merged"], run / "config.yaml"


def _bomb_in_output_dir(t: Path, run: Path) -> tuple[list[str], Path]:
    """A shared run directory given as output.dir: train reads its config.yaml to tell this run from another."""
    (run / "config.yaml").write_text(alias_bomb() + "model:\n  name_or_path: *l8\n", encoding="utf-8")
    cfg_file = _train_config(t, t / "base")
    cfg = yaml.safe_load(cfg_file.read_text(encoding="utf-8"))
    cfg["output"]["dir"] = str(run)
    cfg_file.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return ["train", "-c", str(cfg_file)], run / "config.yaml"


YAML_CASES = {"train-config": _bomb_config, "run-config-export": _bomb_run_config,
              "run-config-as-output-dir": _bomb_in_output_dir}


@pytest.mark.parametrize("case", sorted(YAML_CASES))
def test_yaml_alias_bomb_is_refused_at_once(pristine, tmp_path, case):
    _, run = copy_case(pristine, tmp_path)
    argv, named = YAML_CASES[case](tmp_path, run)
    err = assert_refused(argv, named, tmp_path)
    assert "expand to more than 100,000 values" in err


@pytest.mark.parametrize("text, refused", [
    (alias_bomb(), True),
    ("a: &a [*a]\n", True),  # an anchor holding its own alias never ends
    ("lora: &l {r: 8}\nx: [*l, *l, *l]\n", False),  # reuse, as configs do: allowed
    ("model: {name_or_path: x}\n", False),
])
def test_yaml_reader_bounds_aliases_within_a_second(tmp_path, text, refused):
    from rocktune.errors import UserError
    from rocktune.readers.yaml_file import read_yaml

    (tmp_path / "c.yaml").write_text(text, encoding="utf-8")
    t0 = time.monotonic()
    try:
        read_yaml(tmp_path / "c.yaml", "fix it.")
        outcome = False
    except UserError as exc:
        outcome = str(tmp_path / "c.yaml") in str(exc)
    assert outcome is refused
    assert time.monotonic() - t0 < 1.0


# --- 5. the temporary folder: nothing left behind -----------------------------------------------------------------


def test_export_leaves_nothing_in_the_temporary_folder(pristine, tmp_path):
    _, run = copy_case(pristine, tmp_path)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    code, text, _, _ = cli(["export", str(run), "--to", "gguf"], env=clean_env(TMPDIR=str(scratch)))
    assert code == 0, text[-3000:]
    assert (run / "export" / "model-f16.gguf").is_file()
    assert sorted(os.listdir(scratch)) == []  # torch's inductor cache and the tokenizer staging went with it


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killed_export_leaves_nothing_behind(pristine, tmp_path, sig):
    """SIGTERM unwinds and removes the folder at once; after SIGKILL nothing can run, so the next command that
    starts removes it."""
    _, run = copy_case(pristine, tmp_path)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = clean_env(TMPDIR=str(scratch))
    proc = subprocess.Popen([sys.executable, "-m", "rocktune", "export", str(run), "--to", "merged"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(scratch.glob("rocktune-tmp-*/inductor")) and proc.poll() is None:
            assert time.monotonic() < deadline, "the export never created its temporary folder"
            time.sleep(0.05)
        assert proc.poll() is None, "the export ended before it could be killed"
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    if sig == signal.SIGKILL:
        assert [p.name.split("-")[2] for p in scratch.iterdir()] == [str(proc.pid)]  # left: nothing could run
        code, text, _, _ = cli(["generate", str(tmp_path / "nowhere"), "--prompt", "x"], env=env)
        assert code == 2, text
    assert sorted(os.listdir(scratch)) == []
    assert not (run / "export").exists() or not any((run / "export").iterdir())


def test_sweep_spares_live_processes(tmp_path):
    from rocktune.tempdir import PREFIX, sweep

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, live, other = (tmp_path / f"{PREFIX}{gone.pid}-a", tmp_path / f"{PREFIX}{os.getpid()}-b",
                         tmp_path / "unrelated")
    for folder in (dead, live, other):
        (folder / "inside").mkdir(parents=True)
    assert sweep(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


# --- the readers on their own (in-process, milliseconds) ----------------------------------------------------------


@pytest.mark.parametrize("spoil, message", [
    (_huge_header, "more than the 100,000,000 the format allows"),
    (_offsets_past_end, "is truncated: 150 bytes, but its header describes 1,073,741,910"),
    (lambda f: f.write_bytes(b"\x01\x00"), "too short for a safetensors file"),
    (lambda f: f.write_bytes(struct.pack("<Q", 64) + b"{}"),
     "header claims 64 bytes, but the whole file holds only 10"),
    (lambda f: None, None),  # the real file passes
], ids=["huge-header", "offsets-past-end", "two-bytes", "header-past-end", "valid"])
def test_safetensors_reader(pristine, tmp_path, spoil, message):
    from rocktune.errors import UserError
    from rocktune.readers.safetensors_file import check_safetensors

    file = tmp_path / "model.safetensors"
    shutil.copy(pristine[0] / "model.safetensors", file)
    spoil(file)
    if message is None:
        check_safetensors(file, "fix it.")
        return
    with pytest.raises(UserError) as caught:
        check_safetensors(file, "fix it.")
    assert str(file) in str(caught.value) and message in str(caught.value) and str(caught.value).endswith("fix it.")


@pytest.mark.parametrize("text, malformed, reason", [
    (DEEP_JSON, False, "nested too deeply"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, False, "nested too deeply"),
    ('{"step": 3, "loss": 1.', True, "malformed JSON"),  # a line cut short by a crash
    ("9" * 5000, False, "cannot be parsed"),  # past int's digit limit
])
def test_json_reader(text, malformed, reason):
    from rocktune.readers.json_file import JsonProblem, parse_json

    with pytest.raises(JsonProblem) as caught:
        parse_json(text)
    assert caught.value.malformed is malformed and reason in str(caught.value)
    assert parse_json('{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
