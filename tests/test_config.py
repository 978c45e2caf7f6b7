from pathlib import Path

import pytest

from rocktune.config import RunConfig, dump_config, load_config
from rocktune.errors import UserError

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_come_from_one_place():
    cfg = load_config(None, ["data.train_file=x.jsonl"])
    assert cfg.lora.r == RunConfig.model_fields["lora"].default_factory().r == 16
    assert cfg.lora.target_modules == "all-linear"
    assert cfg.model.attn_implementation == "auto"
    assert cfg.training.precision == "auto"


def test_yaml_then_overrides_typed(tmp_path):
    p = write(tmp_path, "data:\n  train_file: a.jsonl\ntraining:\n  lr: 1.0e-3\n")
    cfg = load_config(str(p), ["training.lr=2e-4", "lora.r=8", "lora.target_modules=[q_proj, v_proj]",
                               "training.max_grad_norm=null"])
    assert cfg.training.lr == pytest.approx(2e-4)
    assert cfg.lora.r == 8
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.training.max_grad_norm is None
    assert cfg.data.train_file == "a.jsonl"


def test_unknown_key_names_path_line_and_allowed(tmp_path):
    p = write(tmp_path, "data:\n  train_file: a.jsonl\nlora:\n  r: 8\n  rnak: 4\n")
    with pytest.raises(UserError) as e:
        load_config(str(p))
    msg = str(e.value)
    assert "lora.rnak" in msg and f"{p}:5" in msg and "alpha" in msg


def test_wrong_type_and_impossible_values(tmp_path):
    with pytest.raises(UserError, match=r"training\.lr"):
        load_config(None, ["data.train_file=a", "training.lr=fast"])
    with pytest.raises(UserError, match=r"lora\.r"):
        load_config(None, ["data.train_file=a", "lora.r=0"])
    with pytest.raises(UserError, match=r"training\.precision"):
        load_config(None, ["data.train_file=a", "training.precision=fp8"])
    with pytest.raises(UserError, match="train_file is required"):
        load_config(None, [])
    with pytest.raises(UserError, match="form section.key=value"):
        load_config(None, ["training.lr"])


def test_missing_or_broken_yaml(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(str(write(tmp_path, "a: [1, 2\n")))


def test_dump_roundtrip(tmp_path):
    cfg = load_config(None, ["data.train_file=a.jsonl", "lora.r=4"])
    p = write(tmp_path, dump_config(cfg))
    assert load_config(str(p)) == cfg


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_shipped_example_loads_and_starts_with_its_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# rocktune ") and str(path.name) in first
    cfg = load_config(str(path))
    assert cfg.data.train_file


def test_examples_exist():
    assert len(EXAMPLES) >= 3


def test_override_with_broken_yaml_value_is_explained():
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(None, ["data.train_file=a", "lora.target_modules=[q_proj, k_proj"])


def test_error_text_with_brackets_survives_printing(capsys):
    from rocktune.errors import print_error

    print_error("values [type=literal_error, input_value=gpu] in /tmp/[/x]")
    assert "[type=literal_error, input_value=gpu]" in capsys.readouterr().err
