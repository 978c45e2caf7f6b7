"""A vision-language checkpoint is recognised from its config.json by train, data preview and generate alike (issue
56): ``task`` left unset means task=vlm, said in one line; a text task given explicitly is refused naming task: vlm
(never transformers' "Unrecognized configuration class"); and the smaller points: generate without --image says so,
a missing --image names the working directory, plan prints a tiny model's parameters in a readable unit, cut
conversations are said in the run log, and the adapter card names every family and what AutoProcessor needs. Qwen3.5,
which the text tasks train too, stays a text model unless task=vlm is asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rocktune.cli import main
from rocktune.errors import UserError

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> tuple[Path, Path]:
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task

    return write_colour_task(tmp_path_factory.mktemp("colours"), n_train=16, n_eval=4, seed=0)


def _config(tmp_path: Path, model: Path, data: tuple[Path, Path], task: str | None = None, name: str = "run.yaml",
            **data_keys) -> Path:
    cfg = {"model": {"name_or_path": str(model)},
           "data": {"train_file": str(data[0]), "eval_file": str(data[1]), "max_length": 128, **data_keys},
           "training": {"max_steps": 1, "micro_batch_size": 2, "device": "cpu", "precision": "fp32"},
           "reliability": {"save_every": 0, "min_free_disk_mb": 0}, "output": {"dir": str(tmp_path / "run")}}
    if task is not None:
        cfg["task"] = task
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_planner_and_the_family_table_know_the_same_families():
    """tasks/vlm/planner/vlm.py sits below the table (it imports no data code), so it keeps its own list: the two must
    agree."""
    from rocktune.tasks.vlm.planner.vlm import FAMILIES as PLANNED
    from rocktune.tasks.vlm.vision.families import FAMILIES

    assert set(PLANNED) == set(FAMILIES)


def test_a_vl_model_without_task_trains_as_vlm_and_says_so(vlm_dir, colours, tmp_path, capsys):
    """No task in the config: the run is task=vlm (its saved config says so), one note says why, and the
    conversations cut at data.max_length are counted in the run log at the start with the key to raise."""
    from rocktune.data.records import read_records
    from rocktune.tasks.vlm.data.vision import encode
    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.vision.model import vision_tokens, with_processor_template

    from transformers import AutoConfig

    tok = with_processor_template(load_tokenizer(str(vlm_dir), False), str(vlm_dir))
    vision = vision_tokens(str(vlm_dir), AutoConfig.from_pretrained(vlm_dir), tok, None, None)
    lengths = [len(encode(rec, colours[0].parent, tok, vision, 4096, loc).input_ids)
               for path in colours for loc, rec in read_records(path)]
    limit = sorted(lengths)[len(lengths) // 2]  # about half of them are longer
    cut = sum(n > limit for n in lengths)
    assert 0 < cut < len(lengths)
    config = _config(tmp_path, vlm_dir, colours, max_length=limit)
    capsys.readouterr()
    assert main(["train", "-c", str(config), "--no-supervise"]) == 0
    out = capsys.readouterr()
    said = out.out + out.err
    assert f"{vlm_dir} is a Qwen2.5-VL vision-language model (config.json: model_type qwen2_5_vl)" in said
    assert "so this is task: vlm" in said
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["task"] == "vlm"
    info = json.loads((run / "run_info.json").read_text())
    assert info["data"]["task"] == "vlm" and info["data"]["n_truncated"] <= cut  # run_info counts the train share
    assert any(note.startswith(f"{cut} of {len(lengths)} conversations") for note in info["notes"])
    share = f"{cut / len(lengths):.1%}"
    assert (f"{cut} of {len(lengths)} conversations ({share}) are longer than data.max_length={limit} and are cut"
            in " ".join(said.split()))
    assert "raise data.max_length" in said


@pytest.mark.parametrize("task", ["lm", "dpo", "grpo"])
def test_a_text_task_on_a_vl_model_is_refused_naming_task_vlm(vlm_dir, colours, tmp_path, capsys, task):
    config = _config(tmp_path, vlm_dir, colours, task=task)
    capsys.readouterr()
    assert main(["train", "-c", str(config)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"task={task} (the config's task key, or an override) trains a text-only model" in err
    assert "Qwen2.5-VL vision-language model" in err and "Set task: vlm" in err
    assert "Unrecognized configuration" not in err
    assert not (tmp_path / "run").exists()  # nothing written
    # the same refusal from an override, and from data preview
    assert main(["train", "-c", str(_config(tmp_path, vlm_dir, colours, name="no-task.yaml")), f"task={task}"]) == 2
    assert main(["data", "preview", "-c", str(config)]) == 2
    assert "Set task: vlm" in capsys.readouterr().err


def test_the_model_loader_refuses_a_vl_checkpoint_for_a_text_task(vlm_dir):
    """Every way into the text tasks' model load (the Python API, a hub id first cached by the worker)."""
    from rocktune.models.load import load_model

    with pytest.raises(UserError, match=r"Qwen2\.5-VL vision-language model .* Set task: vlm"):
        load_model(str(vlm_dir), "fp32", "sdpa", False, "cpu")


@pytest.mark.parametrize(("family", "name"), [("qwen3_5", "Qwen3.5"), ("qwen3_5_moe", "Qwen3.5-MoE")])
def test_qwen3_5_stays_a_text_model_unless_task_vlm_is_asked(vlm_dirs, colours, tmp_path, capsys, family, name):
    """Qwen3.5 is released as one model with its eyes, which the text tasks train as its causal LM
    (tests/test_family_checkpoints.py): a config without task stays task=lm (no note), an explicit task=lm is not
    refused, the text loader and the text plan take it, and generate without --image answers as text; task=vlm
    (tests/test_vlm_families.py), plan --task vlm and generate --image see its images."""
    from rocktune.cli import vision_task
    from rocktune.config import config_from_dict
    from rocktune.models.load import load_model

    model = vlm_dirs(family)
    for task in ({}, {"task": "lm"}, {"task": "dpo"}):
        cfg = config_from_dict({"model": {"name_or_path": str(model)}, "data": {"train_file": "t.jsonl"}, **task})
        assert vision_task(cfg).task == task.get("task", "lm")
    causal = name.replace(".", "_").replace("-MoE", "Moe") + "ForCausalLM"  # Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    assert type(load_model(str(model), "fp32", "sdpa", False, "cpu")).__name__ == causal
    capsys.readouterr()
    assert main(["plan", str(model), "--json"]) == 0
    assert "vision_forward" not in json.loads(capsys.readouterr().out)["terms"]
    assert main(["plan", str(model), "--task", "vlm", "--image-size", "64x64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["terms"]["vision_forward"] > 0
    assert main(["generate", str(model), "--prompt", "Colour?", "--max-new-tokens", "2"]) == 0
    assert "vision-language" not in capsys.readouterr().err
    image = colours[1].parent / "images" / "eval_0.png"
    assert main(["generate", str(model), "--image", str(image), "--prompt", "Colour?", "--max-new-tokens", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"{model} is a {name} vision-language model (config.json: model_type {family}), so it answers as " \
           "task: vlm does" in err


def test_data_preview_without_task_previews_images(vlm_dir, colours, capsys):
    """Before: `<image>` kept as text and "checks passed". Now: each image with its grid and tokens."""
    capsys.readouterr()
    assert main(["data", "preview", "--data", str(colours[0]), "--model", str(vlm_dir), "--json", "-n", "1"]) == 0
    out = capsys.readouterr()
    pv = json.loads(out.out)
    assert (pv["n_examples"], pv["n_images"]) == (16, 16)
    assert "so this is task: vlm" in out.err


def test_generate_says_when_no_image_is_given_and_where_a_relative_image_was_looked_for(vlm_dir, tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["generate", str(vlm_dir), "--prompt", "Colour?", "--max-new-tokens", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "no --image given: the model answers the prompt alone and sees no image" in err
    assert "is a Qwen2.5-VL vision-language model (config.json: model_type qwen2_5_vl)" in err
    assert main(["generate", str(vlm_dir), "--prompt", "Colour?", "--image", "nope.png"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"the image {tmp_path / 'nope.png'} does not exist (a relative path is read from the working " \
           f"directory, {tmp_path})" in err
    assert "data file" not in err


def test_plan_prints_a_small_model_in_a_readable_unit(vlm_dir, capsys):
    from rocktune.planner.report import param_count

    assert [param_count(n) for n in (812, 65_536, 1_234_567, 494_032_768, 7_615_616_512)] == \
        ["812", "65.5K", "1.2M", "494.0M", "7.62B"]
    capsys.readouterr()
    assert main(["plan", str(vlm_dir), "--task", "vlm", "--vram", "8GiB"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0.00B" not in out and "K params (language model, vision tower and projector)" in out


def test_the_adapter_card_names_every_family_and_what_autoprocessor_needs(vlm_dir, tmp_path):
    """The card's snippet, run here (no torchvision): the model and the adapter load; AutoProcessor fails exactly as
    the card says (Qwen's processor builds a torchvision video processor), with the release the card names."""
    import torch

    from rocktune.tasks.vlm.card import load_vision, torchvision_for
    from rocktune.tasks.vlm.vision.families import FAMILIES

    assert (torchvision_for("2.4.1"), torchvision_for("2.6.0"), torchvision_for("2.13.0")) == \
        ("0.19.1", "0.21.0", "0.28.0")
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(run / "adapter")
    card = " ".join(load_vision(str(vlm_dir), run).split())
    assert f"({', '.join(f.name for f in FAMILIES.values())})" in card
    release = torch.__version__.split("+")[0]
    assert f"pip install torchvision=={torchvision_for(release)}" in card and "Qwen2_5_VLProcessor" in card
    code = load_vision(str(vlm_dir), run).split("```python\n")[1].split("```")[0]
    head, processor_line = code.split("processor = ")[0], "processor = " + code.split("processor = ")[1].split("\n")[0]
    scope: dict = {}
    exec(head, scope)  # noqa: S102 -- the card's own snippet, the thing under test
    assert type(scope["model"]).__name__ == "PeftModel"
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="Torchvision"):
            exec(processor_line, scope)  # noqa: S102


def _card_commands(card: str) -> list[list[str]]:
    """The card's llama.cpp commands (`llama-mtmd-cli ...` in backticks), split as a shell splits them."""
    import re
    import shlex

    return [shlex.split(c) for c in re.findall(r"`(llama-mtmd-cli [^`]*)`", " ".join(card.split()))]


def _printed_command(stdout: str) -> list[str]:
    """The command export prints after ``then:``, as a shell splits it (export/next_command.parse_then)."""
    from rocktune.export.next_command import parse_then

    lines = [line for line in stdout.splitlines() if line.startswith("note: then: ")]
    assert len(lines) == 1, stdout
    return parse_then(lines[0])


def test_the_card_s_llama_cpp_commands_are_those_export_prints(vlm_dir, colours, tmp_path, capsys):
    """Without --image-min-tokens / --image-max-tokens llama.cpp makes another number of Qwen image tokens than the
    processor (9 instead of 4 at 56 x 56): the card of a run trained with its own pixel limits gives the very
    commands export prints for it, `--to gguf` and `--to gguf-lora --with-base` (which adds --lora)."""
    pytest.importorskip("gguf")
    config = _config(tmp_path, vlm_dir, colours, task="vlm", min_pixels=784 * 2, max_pixels=784 * 9)
    assert main(["train", "-c", str(config), "--no-supervise"]) == 0
    run = tmp_path / "run"
    card = (run / "adapter" / "README.md").read_text()
    merged, lora = _card_commands(card)
    capsys.readouterr()
    assert main(["export", str(run), "--to", "gguf"]) == 0
    assert merged == _printed_command(capsys.readouterr().out)
    assert main(["export", str(run), "--to", "gguf-lora", "--with-base"]) == 0
    assert lora == _printed_command(capsys.readouterr().out)
    for argv in (merged, lora):  # the run's limits (2 to 9 tokens of 28 x 28), not the base's (4 to 16)
        assert " ".join(argv).count("--image-min-tokens 2 --image-max-tokens 9 ") == 1
    assert "--lora" not in merged and lora[lora.index("--lora") + 1] == str(run / "export" / "adapter-f32.gguf")
    assert "at least 1024 image tokens" in " ".join(card.split())  # Ollama's own minimum


@pytest.mark.parametrize("family", ["gemma3", "smolvlm", "idefics3"])
def test_the_card_of_a_siglip_family_gives_no_image_token_flags_and_what_its_processor_needs(vlm_dirs, tmp_path,
                                                                                           family):
    """Gemma 3's, SmolVLM's and Idefics3's processors set the size themselves: no flags (as export prints none).
    SmolVLM's processor also needs num2words in its constructor, which the card says; Idefics3's does not."""
    from unittest import mock

    import transformers
    from transformers.processing_utils import ProcessorMixin

    from rocktune.tasks.vlm.card import load_vision

    base = vlm_dirs(family)
    card = " ".join(load_vision(str(base), tmp_path / "run").split())
    commands = _card_commands(card)
    assert len(commands) == 2 and all("--image-min-tokens" not in c and "--image-max-tokens" not in c
                                      for c in commands)
    assert "1024 image tokens" not in card
    assert ("pip install num2words" in card) == (family == "smolvlm")
    if family == "smolvlm":  # the claim, asked of the installed transformers (torchvision's class check left out)
        try:
            import num2words  # noqa: F401
        except ImportError:
            with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, n, arg: type(arg)):
                with pytest.raises(ImportError, match="num2words"):
                    transformers.SmolVLMProcessor(transformers.AutoImageProcessor.from_pretrained(base),
                                                  transformers.AutoTokenizer.from_pretrained(base), None)


def test_a_merged_gemma3_loads_with_autoprocessor_and_widens_as_rocktune(vlm_dirs, tmp_path):
    """Gemma 3's combined processor needs no torchvision; with the processor_config.json rocktune writes beside the
    model (export --to merged, the demo) it gives rocktune's own ids and pixels (its class default is 256 tokens)."""
    import torch
    from transformers import AutoConfig, AutoProcessor

    from rocktune.tasks.vlm.data.images import load
    from rocktune.tasks.vlm.data.vision import encode
    from rocktune.tasks.vlm.data.vision_batch import collate
    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.vision.model import vision_tokens, with_processor_template

    model = vlm_dirs("gemma3")
    config = AutoConfig.from_pretrained(model)
    assert json.loads((model / "processor_config.json").read_text()) == {"image_seq_length":
                                                                        config.mm_tokens_per_image}
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task

    train, _ = write_colour_task(tmp_path / "data", 2, 1)
    tok = with_processor_template(load_tokenizer(str(model), False), str(model))
    vision = vision_tokens(str(model), config, tok, None, None)
    rec = json.loads(train.read_text().splitlines()[0])
    example = encode(rec, train.parent, tok, vision, 512, "row")
    proc = AutoProcessor.from_pretrained(model)
    messages = [{"role": m["role"], "content": [{"type": "image"}, {"type": "text", "text": m["content"][1]["text"]}]
                 if m["role"] == "user" else m["content"]} for m in rec["messages"]]
    text = proc.apply_chat_template(messages, tokenize=False)
    image = load(example.images[0], "row")
    ref = proc(text=[text], images=[[image]], return_tensors="pt")
    assert ref["input_ids"][0].tolist() == example.input_ids
    batch = collate([example], tok.pad_token_id, vision)
    assert torch.equal(batch["pixel_values"], ref["pixel_values"])


def test_the_cut_note_gives_the_count_the_share_and_the_key_to_raise():
    """The line vlm, dpo/orpo and grpo put in the run log at the start (lm's describe carries the same share)."""
    from rocktune.data.truncate import cut_note, describe

    assert cut_note(259, 1000, "conversations", 64, "each loses its end") == [
        "259 of 1,000 conversations (25.9%) are longer than data.max_length=64 and are cut: each loses its end; "
        "raise data.max_length in the config's data section to keep them whole."]
    assert cut_note(0, 1000, "pairs", 64, "x") == []
    note = describe(1000, 259, 0, 259, 0, 64, "prompt")[0]
    assert note.startswith("259 of 1000 examples were longer than data.max_length=64")
    assert note.endswith("(25.9% of them; raise data.max_length in the config's data section to keep them whole)")
