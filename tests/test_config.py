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


@pytest.mark.parametrize(("given", "short"), [("float32", "fp32"), ("torch.float32", "fp32"), ("FP32", "fp32"),
                                              ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"),
                                              ("float16", "fp16"), ("half", "fp16"), ("fp16", "fp16")])
def test_torch_dtype_names_are_accepted_wherever_a_dtype_is_asked(given, short):
    """Issue 35: torch's spellings work beside rocktune's short names: the config, plan --precision, export --dtype
    and a float GGUF --quant all read them through rocktune.dtypes."""
    from rocktune.cli import build_parser
    from rocktune.dtypes import GGUF_FLOAT

    assert load_config(None, ["data.train_file=a", f"training.precision={given}"]).training.precision == short
    parser = build_parser()
    assert parser.parse_args(["plan", "Qwen2.5-0.5B", "--precision", given]).precision == short
    args = parser.parse_args(["export", "run", "--to", "gguf", "--dtype", given, "--quant", given])
    assert (args.dtype, args.quant) == (short, GGUF_FLOAT[short])
    assert parser.parse_args(["export", "run", "--to", "gguf", "--quant", "q4_k_m"]).quant == "q4_k_m"


def test_an_unknown_dtype_is_refused_with_the_accepted_names(capsys):
    from rocktune.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "run", "--to", "merged", "--dtype", "float8"])
    assert "invalid choice: 'float8'" in capsys.readouterr().err


def test_a_home_relative_path_is_expanded_not_taken_for_a_hub_id(monkeypatch, tmp_path):
    """`model.name_or_path=~/...` never passes through a shell: expanded here, so a missing one is named as a path."""
    from rocktune.models.load import check_model_source

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["model.name_or_path=~/models/m", "data.train_file=~/d.jsonl", "output.dir=~/runs/x",
                             "data.chat_template=~/t.jinja"])
    assert cfg.model.name_or_path == str(tmp_path / "models" / "m") and cfg.data.train_file == str(tmp_path / "d.jsonl")
    assert cfg.output.dir == str(tmp_path / "runs" / "x") and cfg.data.chat_template == str(tmp_path / "t.jinja")
    with pytest.raises(UserError, match=f"model path {tmp_path / 'models' / 'm'} does not exist"):
        check_model_source(cfg.model.name_or_path)
