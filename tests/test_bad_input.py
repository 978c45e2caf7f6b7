"""The newer commands hold the same line on bad input as ``train``: one paragraph naming the thing, exit status 2,
no traceback, nothing written. One table per class of bad input (issue 27); each case asserts the exit status, a
word of the message naming the file or option, no "Traceback" and no new path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rocktune.cli import main
from tests.export_fixtures import build_model, make_run


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny base and a run trained on it, never modified: each case copies what it spoils."""
    root = tmp_path_factory.mktemp("badinput")
    base = build_model(root / "base", "qwen2")
    make_run(root / "run", base, ["q_proj", "v_proj"])
    return base, root / "run"


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def refused(capsys, argv: list[str], watch: Path) -> str:
    """Run the command in-process: exit 2, one paragraph (no traceback), nothing created under ``watch``."""
    before = tree(watch)
    assert main(argv) == 2
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text
    assert tree(watch) == before, sorted(tree(watch) - before)
    return " ".join(text.split())


# --- 1. damaged adapter files given to export or generate -------------------------------------------------------

def _empty_weights(adapter: Path) -> str:
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    return "adapter_model.safetensors"


def _truncated_weights(adapter: Path) -> str:
    f = adapter / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return "adapter_model.safetensors"


def _missing_weights(adapter: Path) -> str:
    (adapter / "adapter_model.safetensors").unlink()
    return "adapter_model.safetensors"


def _empty_config(adapter: Path) -> str:
    (adapter / "adapter_config.json").write_bytes(b"")
    return "adapter_config.json"


def _config_not_json(adapter: Path) -> str:
    (adapter / "adapter_config.json").write_text("{'r': 8,")
    return "adapter_config.json"


def _config_not_object(adapter: Path) -> str:
    (adapter / "adapter_config.json").write_text("[1, 2, 3]")
    return "adapter_config.json"


def _config_bad_fields(adapter: Path) -> str:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "r": "eight", "target_modules": 5}))
    return "adapter_config.json"


def _wrong_shape(adapter: Path) -> str:
    from safetensors.torch import load_file, save_file

    f = adapter / "adapter_model.safetensors"
    tensors = load_file(f)
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key][:, :-3].contiguous()
    save_file(tensors, f)
    return "lora_A"


ADAPTER_DAMAGE = {"empty_weights": _empty_weights, "truncated_weights": _truncated_weights,
                  "missing_weights": _missing_weights, "empty_config": _empty_config,
                  "config_not_json": _config_not_json, "config_not_an_object": _config_not_object,
                  "config_with_wrong_fields": _config_bad_fields, "wrong_shape_tensor": _wrong_shape}
COMMANDS = {"export": ["export", "{run}", "--to", "merged"], "generate": ["generate", "{run}", "--prompt", "hi"]}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("damage", list(ADAPTER_DAMAGE))
def test_damaged_adapter_is_one_paragraph_naming_the_file(pristine, tmp_path, capsys, damage, command):
    run = tmp_path / "run"
    shutil.copytree(pristine[1], run)
    named = ADAPTER_DAMAGE[damage](run / "adapter")
    err = refused(capsys, [a.format(run=run) for a in COMMANDS[command]], tmp_path)
    assert named in err


# --- 2. an export destination that cannot be created -----------------------------------------------------------

def _parent_is_a_file(tmp: Path) -> Path:
    (tmp / "blocker").write_text("x")
    return tmp / "blocker" / "merged"


def _grandparent_is_a_file(tmp: Path) -> Path:
    (tmp / "blocker").write_text("x")
    return tmp / "blocker" / "deeper" / "merged"


def _read_only_parent(tmp: Path) -> Path:
    (tmp / "ro").mkdir()
    (tmp / "ro").chmod(0o500)
    return tmp / "ro" / "merged"


DESTINATIONS = {"parent_is_a_file": _parent_is_a_file, "grandparent_is_a_file": _grandparent_is_a_file,
                "read_only_parent": _read_only_parent}


@pytest.mark.parametrize("to", ["merged", "gguf", "gguf-lora"])
@pytest.mark.parametrize("where", list(DESTINATIONS))
def test_unwritable_destination_refused_before_loading(pristine, tmp_path, capsys, monkeypatch, where, to):
    import os

    from rocktune.export import merge

    if where == "read_only_parent" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    out = DESTINATIONS[where](tmp_path)
    # nothing may be loaded before the destination is known to be writable
    monkeypatch.setattr(merge, "merged_model", lambda *a, **k: pytest.fail("merged before checking --out"))
    monkeypatch.setattr(merge, "load_base_fp32", lambda *a, **k: pytest.fail("loaded before checking --out"))
    err = refused(capsys, ["export", str(pristine[1]), "--to", to, "--out", str(out)], tmp_path)
    assert str(out.parent.name) in err and "--out" in err


# --- 3. report on damaged metrics --------------------------------------------------------------------------------

def good_run(path: Path, steps: int = 4) -> Path:
    """A run directory as training leaves it, as far as the report reads it (no training needed)."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("model: {name_or_path: tiny}\ntraining: {lr: 0.001}\n")
    lines = [{"step": s, "loss": 2.0 / s, "lr": 1e-3, "grad_norm": 1.0, "step_s": 0.1} for s in range(1, steps + 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _append(name: str, text: str):
    def spoil(run: Path) -> tuple[str, int]:
        f = run / name
        before = f.read_text().count("\n") if f.exists() else 0
        with f.open("a") as out:
            out.write(text)
        return name, before + 1
    return spoil


def _insert_garbage(run: Path) -> tuple[str, int]:
    f = run / "metrics.jsonl"
    lines = f.read_text().splitlines()
    f.write_text("\n".join([*lines[:2], "\x00\x07 garbage {{{", *lines[2:]]) + "\n")
    return "metrics.jsonl", 3


METRICS_DAMAGE = {
    "garbage_line": _insert_garbage,
    "truncated_last_line": _append("metrics.jsonl", '{"step": 5, "loss": 0.4, "l'),
    "line_without_step": _append("metrics.jsonl", '{"loss": 0.4}\n'),
    "loss_not_a_number": _append("metrics.jsonl", '{"step": 5, "loss": "low"}\n'),
    "line_not_an_object": _append("metrics.jsonl", '[5, 0.4]\n'),
    "sample_without_fields": _append("samples.jsonl", '{"step": 2}\n'),
    "incident_with_text_step": _append("incidents.jsonl", '{"cause": "x", "last_logged_step": "five"}\n'),
}


@pytest.mark.parametrize("together", [False, True], ids=["alone", "with_a_good_run"])
@pytest.mark.parametrize("damage", list(METRICS_DAMAGE))
def test_report_skips_damaged_lines_and_says_which(tmp_path, capsys, damage, together):
    pytest.importorskip("matplotlib")
    broken = good_run(tmp_path / "broken")
    name, line = METRICS_DAMAGE[damage](broken)
    runs = [str(good_run(tmp_path / "good")), str(broken)] if together else [str(broken)]
    out = tmp_path / "out" / "report.html"
    assert main(["report", *runs, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    note = f"{broken / name}: skipped line {line} ("
    assert note in " ".join(captured.err.split())
    assert note in out.read_text() and (tmp_path / "out" / "report_plots" / "loss.png").is_file()


def _config_not_a_mapping(run: Path) -> str:
    (run / "config.yaml").write_text("- a list\n- not a config\n")
    return "config.yaml"


def _run_info_not_json(run: Path) -> str:
    (run / "run_info.json").write_text('{"device": ')
    return "run_info.json"


def _no_metrics(run: Path) -> str:
    (run / "metrics.jsonl").unlink()
    return "no metrics.jsonl"


def _does_not_exist(run: Path) -> str:
    shutil.rmtree(run)
    return "does not exist"


REPORT_REFUSALS = {"config_not_a_mapping": _config_not_a_mapping, "run_info_not_json": _run_info_not_json,
                   "no_metrics": _no_metrics, "does_not_exist": _does_not_exist}


@pytest.mark.parametrize("together", [False, True], ids=["alone", "with_a_good_run"])
@pytest.mark.parametrize("damage", list(REPORT_REFUSALS))
def test_report_refuses_an_unreadable_run_before_writing(tmp_path, capsys, damage, together):
    broken = good_run(tmp_path / "broken")
    named = REPORT_REFUSALS[damage](broken)
    runs = [str(good_run(tmp_path / "good")), str(broken)] if together else [str(broken)]
    err = refused(capsys, ["report", *runs, "--out", str(tmp_path / "out" / "compare.html")], tmp_path)
    assert named in err and str(broken) in err


# --- 7. generate --max-new-tokens beyond the model's context -----------------------------------------------------

def test_max_new_tokens_is_capped_at_the_context(pristine, capsys, monkeypatch):
    from transformers import GenerationMixin

    asked = []
    original = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        asked.append((kwargs["input_ids"].shape[1], kwargs["max_new_tokens"]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    assert main(["generate", str(pristine[1]), "--prompt", "hello there", "--max-new-tokens", "1000000"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "--max-new-tokens 1000000 is more than the model's context holds (512 tokens" in err
    (prompt_tokens, max_new), = asked
    assert max_new == 512 - prompt_tokens


@pytest.mark.parametrize(("max_new", "prompt", "expect"), [(10, 3, 10), (600, 3, 509), (600, 512, 1), (5, 0, 5)],
                         ids=["within", "capped", "prompt_fills_it", "no_prompt"])
def test_reply_budget_leaves_room_for_the_prompt(max_new, prompt, expect):
    from rocktune.export.generate import Budget

    assert Budget(max_new, 512).for_prompt(prompt) == expect
    assert Budget(max_new, None).for_prompt(prompt) == max_new


# --- 9. messages that point the right way --------------------------------------------------------------------------

GENERATE_OPTIONS = {  # argv, words the message must hold, words it must not (the other option, the wrong advice)
    "file_missing": (["--file", "{tmp}/prompts.jsonl"], ["--file", "prompts.jsonl", "does not exist"],
                     ["data.train_file"]),
    "file_is_a_folder": (["--file", "{tmp}"], ["--file", "is a folder"], ["data.train_file"]),
    "max_new_tokens_0": (["--prompt", "hi", "--max-new-tokens", "0"], ["--max-new-tokens 0", "at least 1"],
                         ["--temperature"]),
    "temperature_negative": (["--prompt", "hi", "--temperature", "-1"], ["--temperature -1", "negative"],
                             ["--max-new-tokens"]),
}


@pytest.mark.parametrize("case", list(GENERATE_OPTIONS))
def test_generate_option_refusals_name_the_option_before_loading(pristine, tmp_path, capsys, monkeypatch, case):
    from rocktune.export import generate

    monkeypatch.setattr(generate, "load", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    argv, words, wrong = GENERATE_OPTIONS[case]
    err = refused(capsys, ["generate", str(pristine[1]), *(a.format(tmp=tmp_path) for a in argv)], tmp_path)
    assert all(w in err for w in words) and not any(w in err for w in wrong), err


@pytest.mark.parametrize(("frames", "suggested"), [(6, (5, 9)), (8, (5, 9)), (20, (17, 21)), (50, (49, 53)),
                                                   (0, (1,)), (-3, (1,))],
                         ids=["6", "8", "20", "50", "zero", "negative"])
def test_wan_frames_refusal_suggests_valid_counts(frames, suggested):
    from rocktune.tasks.wan.diffusion.generate_cli import Request, _shot
    from rocktune.errors import UserError

    with pytest.raises(UserError) as info:
        _shot(Request(prompt="a cat", frames=frames), {"task": "video-lora"})
    message = str(info.value)
    assert f"--frames {frames}:" in message
    for count in suggested:
        assert (count - 1) % 4 == 0
        assert f"use {count}" in message or f"or {count}" in message


# --- 5 and 8. refusals that depend on the config (and the number of processes) alone: in the launching process ---

def _lm_config(tmp: Path) -> dict:
    # the paths exist (train checks that before launching); nothing in them is read before the refusals tested here
    (tmp / "model").mkdir(exist_ok=True)
    (tmp / "train.jsonl").write_text('{"text": "hello"}\n')
    return {"model": {"name_or_path": str(tmp / "model")}, "data": {"train_file": str(tmp / "train.jsonl"),
            "cache_dir": str(tmp / "cache")}, "training": {"device": "cpu"}, "output": {"dir": str(tmp / "run")}}


def _wan_config(tmp: Path) -> dict:
    (tmp / "wan").mkdir(exist_ok=True)
    (tmp / "clips").mkdir(exist_ok=True)
    return {"task": "video-lora", "model": {"name_or_path": str(tmp / "wan")},
            "data": {"train_file": str(tmp / "clips"), "cache_dir": str(tmp / "cache")},
            "training": {"device": "cpu"}, "output": {"dir": str(tmp / "run")}}


def _with(base, **sections):
    def build(tmp: Path) -> dict:
        cfg = base(tmp)
        for section, values in sections.items():
            cfg[section] = {**cfg.get(section, {}), **values}
        return cfg
    return build


def _checkpoint_by(world: int):
    """A run directory whose newest checkpoint was written by ``world`` processes (only its meta.json matters, and
    the manifest's hash of it: the launching process believes no unverified meta.json)."""
    def make(tmp: Path) -> None:
        import hashlib

        step = tmp / "run" / "checkpoints" / "step-0000004"
        step.mkdir(parents=True)
        meta = json.dumps({"step": 4, "extra": {"world_size": world}}).encode()
        (step / "meta.json").write_bytes(meta)
        (step / "manifest.json").write_text(json.dumps({"sha256": {"meta.json": hashlib.sha256(meta).hexdigest()}}))
    return make


PRELAUNCH_REFUSALS = {  # config, extra argv, a run directory to start from, words the paragraph must hold
    "lm_fsdp_with_quantization": (_with(_lm_config, model={"quantization": "nf4"}, training={"parallel": "fsdp"}),
                                  ["--nproc", "2"], None, ["training.parallel=fsdp", "model.quantization", "ddp"]),
    "wan_several_processes": (_wan_config, ["--nproc", "2"], None, ["video-lora", "one process", "--nproc"]),
    "wan_several_nodes": (_wan_config, ["--nnodes", "2", "--master-addr", "127.0.0.1"], None, ["one process"]),
    "wan_auto": (_wan_config, ["--auto"], None, ["--auto", "rocktune plan"]),
    "wan_lm_only_setting": (_with(_wan_config, data={"packing": True}), [], None, ["data.packing", "task=lm"]),
    "resume_with_more_processes": (_lm_config, ["--resume", "--nproc", "2"], _checkpoint_by(1),
                                   ["step-0000004", "1 process", "has 2", "--nproc 1"]),
    "resume_with_fewer_processes": (_lm_config, ["--resume"], _checkpoint_by(2),
                                    ["step-0000004", "2 process", "has 1", "--nproc 2"]),
}


@pytest.mark.parametrize("case", list(PRELAUNCH_REFUSALS))
def test_config_refusals_come_before_any_worker_or_file(tmp_path, capsys, monkeypatch, case):
    import yaml

    from rocktune.process import launch, supervisor, worker

    build, argv, run_dir, words = PRELAUNCH_REFUSALS[case]
    for module, name in ((supervisor, "supervise"), (launch, "run_launcher"), (worker, "run_in_process")):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} started before the refusal"))
    if run_dir is not None:
        run_dir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(build(tmp_path)))
    err = refused(capsys, ["train", "-c", str(config), *argv], tmp_path)
    assert all(w in err for w in words), err
    assert err.count("error:") == 1  # one paragraph, said once


def test_refusals_in_the_launching_process_do_not_import_torch():
    """The supervisor decides them and lives for the whole run: it stays without torch."""
    import subprocess
    import sys

    code = ("import sys; from rocktune.config import config_from_dict; from rocktune.tasks import "
            "refuse_before_launch; from rocktune.train.request import RunOptions; "
            "refuse_before_launch(config_from_dict({'model': {'name_or_path': 'm'}, 'data': {'train_file': 't'}}), "
            "RunOptions(processes=2)); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


# --- 6. degenerate media (Wan) ------------------------------------------------------------------------------------

DEGENERATE_MEDIA = {  # file, its size, words the refusal must hold
    "one_pixel_image": ("dot.png", (1, 1), ["1x1 pixels", "far below", "64x64"]),
    "tiny_image": ("small.png", (12, 12), ["12x12 pixels", "enlarged 5x"]),
    "tiny_clip": ("small.mp4", (16, 8), ["16x8 pixels", "far below", "128x64"]),
    "thin_strip_image": ("strip.png", (640, 64), ["640x64 pixels", "aspect ratio", "keep 20%"]),
    "tall_strip_clip": ("strip.mp4", (32, 320), ["32x320 pixels", "aspect ratio"]),
}
RESOLUTIONS = [[64, 64], [128, 64], [64, 128]]


@pytest.mark.parametrize("case", list(DEGENERATE_MEDIA))
def test_degenerate_media_is_named_per_file(tmp_path, case):
    from PIL import Image

    from rocktune.tasks.wan.diffusion.media import assign_buckets, list_items
    from rocktune.tasks.wan.diffusion.tiny import write_clips
    from rocktune.errors import UserError

    name, size, words = DEGENERATE_MEDIA[case]
    media = tmp_path / "media"
    good = write_clips(media / "good", ["a fine clip"], size=(64, 64), frames=5)[0]
    if name.endswith(".png"):
        bad = media / name
        Image.new("RGB", size, (200, 30, 30)).save(bad)
        bad.with_suffix(".txt").write_text("a bad one")
    else:
        bad = write_clips(media / name.removesuffix(".mp4"), ["a bad one"], size=size, frames=5)[0]
    with pytest.raises(UserError) as info:
        assign_buckets(list_items(media), RESOLUTIONS, [1, 5], "video-lora")
    message = " ".join(str(info.value).split())
    assert str(bad) in message and str(good) not in message
    assert all(w in message for w in words), message
    assert "1 media file(s) cannot be used" in message


def test_media_near_its_bucket_is_still_taken(tmp_path):
    from PIL import Image

    from rocktune.tasks.wan.diffusion.media import assign_buckets, list_items

    for name, size in (("quarter.png", (16, 16)), ("wide.png", (200, 64)), ("big.png", (500, 480))):
        Image.new("RGB", size).save(tmp_path / name)
        (tmp_path / name).with_suffix(".txt").write_text("fine")
    buckets = {item.path.name: str(b) for item, b in assign_buckets(list_items(tmp_path), RESOLUTIONS, [1], "image")}
    assert buckets == {"big.png": "64x64x1", "quarter.png": "64x64x1", "wide.png": "128x64x1"}


# --- 4. several nodes: a preflight in the launching process, bounded, loopback only --------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_workers(monkeypatch) -> None:
    from rocktune.process import launch, supervisor, worker

    for module, name in ((supervisor, "supervise"), (launch, "run_launcher"), (worker, "run_in_process")):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} started before the preflight"))


NODE_FAILURES = {  # argv after the port (PORT is filled in), the port held by another program?, words
    "port_in_use_on_node_0": (["--nproc", "1", "--nnodes", "2", "--node-rank", "0"], True,
                              ["--master-port {port} is already in use", "--master-port"]),
    "port_in_use_on_one_node": (["--nproc", "2"], True, ["--master-port {port} is already in use"]),
    "peer_never_comes": (["--nproc", "1", "--nnodes", "2", "--node-rank", "0", "--rendezvous-timeout", "1.5"], False,
                         ["node(s) 1 of 2 did not join within 1.5 s", "127.0.0.1:{port}", "--node-rank"]),
    "two_peers_never_come": (["--nnodes", "3", "--rendezvous-timeout", "1"], False, ["node(s) 1, 2 of 3"]),
    "node_0_never_comes": (["--nproc", "1", "--nnodes", "2", "--node-rank", "1", "--rendezvous-timeout", "1.5"],
                           False, ["node 0 at 127.0.0.1:{port} did not answer within 1.5 s", "refused", "node 1 of 2"]),
    "bound_from_the_config": (["--nnodes", "2", "reliability.rendezvous_timeout_s=1"], False,
                              ["did not join within 1 s"]),
}


@pytest.mark.parametrize("case", list(NODE_FAILURES))
def test_nodes_that_cannot_meet_are_named_within_the_bound(tmp_path, capsys, monkeypatch, case):
    import socket
    import time

    import yaml

    _no_workers(monkeypatch)
    argv, held, words = NODE_FAILURES[case]
    port = free_port()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_lm_config(tmp_path)))
    holder = socket.socket()
    try:
        if held:
            holder.bind(("0.0.0.0", port))
            holder.listen()
        t0 = time.monotonic()
        err = refused(capsys, ["train", "-c", str(config), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               *argv], tmp_path)
        assert time.monotonic() - t0 < 30  # seconds, not torchrun's 900 s twice
    finally:
        holder.close()
    assert all(w.format(port=port) in err for w in words), err


@pytest.mark.parametrize("nnodes", [2, 3])
def test_nodes_meet_and_leave_the_port_free_for_torchrun(nnodes):
    import socket
    import threading

    from rocktune.process.rendezvous import preflight
    from rocktune.train.request import Launch

    port = free_port()
    said, errors = [], []

    def node(rank: int) -> None:
        try:
            preflight(Launch(1, nnodes, rank, "127.0.0.1", port), 20.0, said.append)
        except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(r,)) for r in range(nnodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert len(said) == nnodes and all("waiting up to 20 s" in line for line in said)
    with socket.socket() as s:  # what torch's TCPStore does next, at once
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))


def test_torchrun_gets_the_same_bound_and_a_given_port_on_one_node():
    from rocktune.process.launch import torchrun_args
    from rocktune.train.request import Launch

    static = torchrun_args(Launch(2, 2, 1, "10.0.0.1", 29511, rendezvous_timeout_s=42.5))
    assert static[static.index("--rdzv-conf") + 1] == "timeout=43" and "29511" in static
    c10d = torchrun_args(Launch(2, 2, 0, None, 29500, "head:29400", rendezvous_timeout_s=60))
    assert c10d[c10d.index("--rdzv-conf") + 1] == "join_timeout=60"
    assert "--standalone" in torchrun_args(Launch(2))
    one_node = torchrun_args(Launch(2, 1, 0, "127.0.0.1", 29777))
    assert "--standalone" not in one_node and one_node[one_node.index("--master-port") + 1] == "29777"


def test_master_port_for_one_process_is_said_to_be_unused(tmp_path, capsys, monkeypatch):
    import yaml

    from rocktune.process import supervisor

    monkeypatch.setattr(supervisor, "supervise", lambda *a, **k: 0)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_lm_config(tmp_path)))
    assert main(["train", "-c", str(config), "--master-port", "29555"]) == 0
    assert "--master-addr/--master-port are for several processes" in capsys.readouterr().err


def test_a_rendezvous_that_never_formed_is_not_restarted(monkeypatch, capsys):
    """torchrun's own rendezvous failing (a node went away after the preflight) is exit 2: the supervisor never
    restarts it, and it is one paragraph, not two DistStoreError tracebacks."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from rocktune.process.launch import run_launcher
    from rocktune.train.request import Launch, RunRequest

    def never(_args):
        raise RendezvousTimeoutError("rendezvous timed out")

    monkeypatch.setattr(torchrun, "run", never)
    request = RunRequest({"output": {"dir": "x"}}, launch=Launch(1, 2, 0, "127.0.0.1", 29512,
                                                                  rendezvous_timeout_s=5))
    assert run_launcher(request) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the nodes did not meet within 5 s at 127.0.0.1:29512" in err and "Traceback" not in err


# --- 1, in the checkpoint code: the same adapter reader, its refusal a damaged checkpoint (the previous one used) ---

@pytest.mark.parametrize("damage", ["empty_weights", "truncated_weights", "missing_weights", "config_not_json",
                                    "config_not_an_object", "config_with_wrong_fields"])
def test_checkpoint_adapter_read_by_the_same_reader(pristine, tmp_path, damage):
    from rocktune.train import checkpoint_state

    ckpt = tmp_path / "step-0000004"
    shutil.copytree(pristine[1] / "adapter", ckpt)
    named = ADAPTER_DAMAGE[damage](ckpt)
    with pytest.raises(checkpoint_state.Damaged) as info:
        checkpoint_state.read(ckpt, model=None, optimizer=None)  # refused before the model is looked at
    assert named in str(info.value) and "damaged after it was written" in str(info.value)
