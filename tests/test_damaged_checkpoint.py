"""A checkpoint that cannot be loaded safely is damaged, like one whose hashes do not match (issue 16).

Every damaged checkpoint here has its manifest re-hashed, so the sha256 check passes and the refusal must come from
loading: a tampered pickle (its payload must never run), a wrongly shaped adapter tensor, a missing or unreadable
state file, a broken meta.json. The previous good checkpoint is used; with none usable, exit 2 and nothing touched.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rocktune.config import config_from_dict
from rocktune.train import checkpoint
from rocktune.train.checkpoint_state import REFUSED
from rocktune.tasks import train
from rocktune.train.request import RunOptions
from tests.lm_runs import adapter_bytes, config, logged, run_worker

STEP6 = "step-0000006"


@pytest.fixture(scope="module")
def killed_run(tiny_model_dir, data, tmp_path_factory):
    """A run SIGKILLed after step 7: checkpoints at steps 4 and 6, no adapter."""
    out = tmp_path_factory.mktemp("killed") / "run"
    assert run_worker(config(tiny_model_dir, data, out), {"kill_at_step": 7}) < 0
    return out


@pytest.fixture
def run(killed_run, tiny_model_dir, data, tmp_path):
    """A private copy of the killed run and its config (written to c.yaml for the CLI)."""
    out = tmp_path / "run"
    shutil.copytree(killed_run, out)
    cfg = config(tiny_model_dir, data, out)
    cfg["data"]["cache_dir"] = str(killed_run.parent / "cache")  # part of the config a resume compares
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return out, cfg


class Payload:
    """Unpickling this would create ``path``: the file existing afterwards means code ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def tamper(ckpt: Path, marker: Path) -> None:
    state = {"optimizer": Payload(marker), "scheduler": {}, "scaler": {}, "rng": {}}
    (ckpt / "trainer_state.pt").write_bytes(pickle.dumps(state, protocol=4))
    rehash(ckpt)


def rehash(ckpt: Path) -> None:
    """Make the manifest match the files again, as an attacker (or a careless copy) would."""
    files = sorted(p.name for p in ckpt.iterdir() if p.name != "manifest.json")
    sums = {f: hashlib.sha256((ckpt / f).read_bytes()).hexdigest() for f in files}
    (ckpt / "manifest.json").write_text(json.dumps({"step": 6, "sha256": sums}))
    assert checkpoint.verify(ckpt) is None


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rocktune", "train", "-c", str(tmp_path / "c.yaml"), *args],
                          capture_output=True, text=True)


def test_tampered_pickle_is_refused_and_previous_checkpoint_used(run, reference, tmp_path):
    out, _ = run
    marker = tmp_path / "payload-ran"
    tamper(out / "checkpoints" / STEP6, marker)
    proc = cli(tmp_path, "--resume")
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()  # the payload never ran
    assert proc.stderr.count(REFUSED) == 1 and "Traceback" not in proc.stderr and "restart" not in proc.stderr
    assert "resumed from step-0000004" in proc.stderr
    assert (out / "checkpoints" / f"damaged-{STEP6}").is_dir()
    assert not (out / "incidents.jsonl").exists()
    assert logged(out) == logged(reference)
    assert adapter_bytes(out) == adapter_bytes(reference)


def test_no_usable_checkpoint_exits_2_and_touches_nothing(run, tmp_path):
    out, _ = run
    marker = tmp_path / "payload-ran"
    for ckpt in (out / "checkpoints").glob("step-*"):
        tamper(ckpt, marker)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    proc = cli(tmp_path, "--resume")
    assert proc.returncode == 2, proc.stderr
    assert not marker.exists()
    assert "Traceback" not in proc.stderr and "restart" not in proc.stderr
    err = " ".join(proc.stderr.split())  # one paragraph, soft-wrapped by the terminal width
    assert err.count("error:") == 1 and "no checkpoint" in err and REFUSED in err and "--overwrite" in err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing renamed, written or removed


def _wrong_shape(ckpt: Path) -> str:
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "adapter_model.safetensors")
    name = sorted(k for k in tensors if "lora_A" in k)[0]
    tensors[name] = tensors[name][:4].contiguous()  # r=8 -> 4 rows
    save_file(tensors, ckpt / "adapter_model.safetensors")
    return f"{name} is torch.float32 {list(tensors[name].shape)}"


def _missing_state(ckpt: Path) -> str:
    (ckpt / "trainer_state.pt").unlink()
    return "trainer_state.pt cannot be read"


def _torn_state(ckpt: Path) -> str:
    path = ckpt / "trainer_state.pt"
    path.write_bytes(path.read_bytes()[:200])
    return "trainer_state.pt cannot be read"


def _bad_meta(ckpt: Path) -> str:
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["py_random"] = [3, [1, 2], None]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return "random-number state"


@pytest.mark.parametrize("damage", [_wrong_shape, _missing_state, _torn_state, _bad_meta])
def test_unloadable_checkpoint_falls_back_to_previous(run, reference, damage, capsys):
    out, cfg = run
    ckpt = out / "checkpoints" / STEP6
    why = damage(ckpt)
    rehash(ckpt)
    result = train(config_from_dict(cfg), RunOptions(resume=True))
    assert not result.interrupted
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("skipped damaged checkpoint") == 1 and why in err
    assert (out / "checkpoints" / f"damaged-{STEP6}").is_dir()
    assert logged(out) == logged(reference)
    assert adapter_bytes(out) == adapter_bytes(reference)
