"""A run directory never turns remote code on by itself (issue 31).

The base model here ships its own Python (config.json's ``auto_map``) that leaves a marker file when it is imported,
and the run's ``adapter/rocktune_config.yaml`` asks for ``model.trust_remote_code: true``. Without
``--trust-remote-code`` on the command line every command that reloads the base refuses, naming that file, and the
marker never appears; with it, the code runs and generation works.
"""

from __future__ import annotations

import json

import pytest
import yaml

from rocktune.cli import main
from tests.export_fixtures import build_model, make_run

MODULE = '''
from pathlib import Path

from transformers import Qwen2Config, Qwen2ForCausalLM

Path({marker!r}).touch()  # what remote code could do: anything, on import


class MarkedConfig(Qwen2Config):
    pass


class MarkedForCausalLM(Qwen2ForCausalLM):
    config_class = MarkedConfig
'''


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """(run directory, marker path): a run as someone else would hand it over, asking for remote code."""
    tmp = tmp_path_factory.mktemp("remote")
    base = build_model(tmp / "base", "qwen2")
    run = tmp / "run"
    make_run(run, base, ["q_proj", "v_proj"])
    marker = tmp / "remote-code-ran"
    module = "marked_" + tmp.name.replace("-", "_")  # a name no other test's dynamic module cache holds
    (base / f"{module}.py").write_text(MODULE.format(marker=str(marker)))
    cfg = json.loads((base / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": f"{module}.MarkedConfig", "AutoModelForCausalLM": f"{module}.MarkedForCausalLM"}
    (base / "config.json").write_text(json.dumps(cfg))
    for name in ("adapter/rocktune_config.yaml", "config.yaml"):
        run_cfg = yaml.safe_load((run / name).read_text())
        run_cfg["model"]["trust_remote_code"] = True
        (run / name).write_text(yaml.safe_dump(run_cfg))
    return run, marker


@pytest.mark.parametrize("argv", [
    ["generate", "{run}", "--prompt", "hi", "--device", "cpu"],
    ["export", "{run}", "--to", "merged"],
    ["export", "{run}", "--to", "gguf"],
    ["export", "{run}", "--to", "gguf-lora"],
    ["export", "{run}/adapter", "--to", "ollama"],
])
def test_run_directory_asking_for_remote_code_is_refused(shared_run, capsys, argv):
    run, marker = shared_run
    assert main([a.format(run=run) for a in argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{run / 'adapter' / 'rocktune_config.yaml'} sets model.trust_remote_code: true" in err
    assert "was not honoured" in err and "pass --trust-remote-code" in err
    assert not marker.exists() and not (run / "export").exists()


def test_remote_code_runs_when_the_command_line_asks(shared_run, capsys):
    run, marker = shared_run
    assert main(["generate", str(run), "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu",
                 "--trust-remote-code"]) == 0
    assert marker.exists()  # the model's own code was imported: the flag is what allowed it
    assert capsys.readouterr().out.endswith("\n")
