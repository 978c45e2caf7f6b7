"""task=vlm on the families beyond Qwen: Gemma 3 (fixed soft tokens per image, token_type_ids for its bidirectional
image attention) and SmolVLM / Idefics3 (images split into tiles, pixels batched per conversation). Tiny random-init
models built offline (tasks/vlm/demo/tiny_vlm_families.py) with the families' real image processors: the tokens and
pixels equal transformers' own combined processors', every data shape encodes, the OOM split cuts the per-conversation
pixels right, a run trains, exports merged (the same logits) and answers with ``generate --image``, and what is not
supported is refused with its reason; the chunked loss and adapter gradients equal PEFT's forward with torch's
cross-entropy, and a tiny Gemma 3 and SmolVLM learn the colour task (make test-long), by test_vlm_train.py's checks.
Qwen3.5 and Qwen3.5-MoE (Qwen3-VL's tower and processor before a hybrid Gated DeltaNet language model; the MoE's
expert stacks adapted as the text tasks adapt them) run the same checks, and their recurrent layers refuse packed
rows. These families need transformers 5 (the torch 2.4/2.5 stacks' 4.57 is refused for them: untested there)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rocktune.config import config_from_dict
from rocktune.data.encode import IGNORE
from rocktune.data.records import read_records
from rocktune.tasks.vlm.data.vision import encode
from rocktune.tasks.vlm.data.vision_batch import collate
from rocktune.tasks.vlm.demo.tiny_vlm_families import (build_family_image_processor, build_family_tokenizer,
                                                       tiny_family_config)
from rocktune.tasks.vlm.demo.vision_task import draw
from rocktune.errors import UserError
from rocktune.tasks import train
from rocktune.tasks.vlm.vision.model import vision_tokens
from tests.test_vlm_train import _metrics, chunked_loss_matches, learns_the_colour, vlm_config

pytest.importorskip("PIL")

NEW = ["gemma3", "smolvlm", "idefics3"]
ANSWER_END = {"gemma3": "<end_of_turn>\n", "smolvlm": "<end_of_utterance>\n", "idefics3": "<end_of_utterance>\n"}


def _vision(family: str, folder: Path):
    """(tokenizer, vision tokens, config) of a tiny ``family`` without weights: its tokenizer and image processor
    saved in ``folder`` as a model directory holds them."""
    tok = build_family_tokenizer(family)
    build_family_image_processor(family).save_pretrained(folder)
    config = tiny_family_config(tok, family)
    return tok, vision_tokens(str(folder), config, tok, None, None), config


@pytest.fixture()
def folder(tmp_path) -> Path:
    (tmp_path / "images").mkdir()
    draw("red", random.Random(0), size=56).save(tmp_path / "images" / "red.png")
    draw("blue", random.Random(2), size=200).resize((200, 90)).save(tmp_path / "images" / "wide.png")
    return tmp_path


def _rows() -> list[dict]:
    two = {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/red.png"},
                                                     {"type": "text", "text": "and"},
                                                     {"type": "image", "image": "images/wide.png"}]},
                        {"role": "assistant", "content": "red, blue"}]}
    one = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Colour?"},
                                                     {"type": "image", "image": "images/wide.png"}]},
                        {"role": "assistant", "content": "blue"}]}
    return [two, one]


def _processor(family: str, tok, vision, config):
    """transformers' own combined processor around the same tokenizer and image processor (the class check of
    SmolVLM's video processor, which needs torchvision, patched out; num2words is only for videos)."""
    from unittest import mock

    import transformers
    from transformers.processing_utils import ProcessorMixin

    images = vision.image_processor
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg)):
        if family == "gemma3":
            return transformers.Gemma3Processor(images, tok, image_seq_length=config.mm_tokens_per_image)
        if family == "idefics3":
            return transformers.Idefics3Processor(images, tok, image_seq_len=vision.rule.count)
        with mock.patch("transformers.models.smolvlm.processing_smolvlm.num2words", str):
            return transformers.SmolVLMProcessor(images, tok, None, image_seq_len=vision.rule.count)


@pytest.mark.parametrize("family", NEW)
def test_the_tokens_and_pixels_are_those_of_transformers_own_processor(folder, tmp_path, family):
    """Two conversations (a square and a wide image, then the wide one alone): each row's ids equal the processor's
    for the same rendered text, and the batch's pixel values (Idefics3/SmolVLM: per conversation, with the pixel
    attention mask) and Gemma 3's token_type_ids equal the processor's for the batch."""
    import torch

    from rocktune.tasks.vlm.data.images import load

    tok, vision, config = _vision(family, tmp_path / "model")
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    examples = [encode(rec, folder, tok, vision, 512, loc) for loc, rec in read_records(data)]
    proc = _processor(family, tok, vision, config)
    texts = [tok.apply_chat_template(_plain(r["messages"]), tokenize=False) for r in _rows()]
    images = [[load(ref, "x") for ref in e.images] for e in examples]
    for e, text, ims in zip(examples, texts, images):
        ref = proc(text=[text], images=[ims], return_tensors="pt")
        assert ref["input_ids"][0].tolist() == e.input_ids
    assert examples[0].image_tokens == sum(vision.rule.tokens(g) for g in examples[0].grids)
    if family != "gemma3":  # the wide image is split into more tiles than the square one
        assert examples[0].grids == ((2, 2), (1, 2)) and examples[0].image_tokens == (5 + 3) * vision.rule.count
    batch = collate(examples, tok.pad_token_id, vision)
    ref = proc(text=texts, images=images, return_tensors="pt", padding=True)
    assert torch.equal(batch["pixel_values"], ref["pixel_values"])
    if family == "gemma3":
        assert torch.equal(batch["token_type_ids"] * batch["attention_mask"], ref["token_type_ids"])
    else:
        assert torch.equal(batch["pixel_attention_mask"], ref["pixel_attention_mask"])


def _plain(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [{"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})} for p in m["content"]]}
            for m in messages]


def test_an_image_processor_of_another_family_is_refused(tmp_path):
    from rocktune.tasks.vlm.demo.tiny_vlm import build_image_processor

    tok = build_family_tokenizer("gemma3")
    build_image_processor().save_pretrained(tmp_path)  # Qwen's
    with pytest.raises(UserError, match=r"a Gemma 3 model, whose images need Gemma3ImageProcessor; its "
                                        r"preprocessor_config.json gives Qwen2VLImageProcessor"):
        vision_tokens(str(tmp_path), tiny_family_config(tok, "gemma3"), tok, None, None)


@pytest.mark.parametrize("family", NEW)
def test_every_shape_of_the_shipped_example_encodes_with_loss_on_the_answers_only(tmp_path, family):
    tok, vision, _ = _vision(family, tmp_path / "model")
    data = Path(__file__).parents[1] / "examples" / "vision" / "chat.jsonl"
    out = [encode(rec, data.parent, tok, vision, 512, loc) for loc, rec in read_records(data)]
    end = ANSWER_END[family]
    answers = [tok.decode([t for t, label in zip(e.input_ids, e.labels) if label != IGNORE]) for e in out]
    lead = " " if family != "gemma3" else ""  # SmolVLM's style writes "Assistant: answer"
    assert answers == [f"{lead}red{end}", f"{lead}blue{end}{lead}yes{end}", f"{lead}green{end}", f"{lead}green{end}"]
    for e in out:  # image tokens and their markers never carry loss
        assert all(label == IGNORE for t, label in zip(e.input_ids, e.labels) if t in vision.masked_ids)


@pytest.mark.parametrize("family", ["gemma3", "smolvlm", "qwen3_5"])
def test_the_oom_split_gives_the_whole_batch_loss(tmp_path, folder, family):
    """Cut between conversations: Gemma 3's pixels one image per row of pixel_values, SmolVLM's per conversation
    (zero images padding the shorter rows), Qwen3.5's flat patches by each conversation's share; the pieces' summed
    loss is the batch's. For Qwen3.5 this is also the padding's proof: the pieces are unpadded, so the right padding
    of the whole batch must leave the Gated DeltaNet layers' state of each conversation as it is."""
    import torch

    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.models.load import apply_lora, load_tokenizer
    from rocktune.tasks.vlm.feed import split_rows
    from rocktune.tasks.vlm.loss import VisionLoss
    from rocktune.tasks.vlm.vision.model import language_targets, load_vlm

    model_dir = build_tiny_vlm(tmp_path / "m", family=family)
    tok = load_tokenizer(str(model_dir), False)
    from transformers import AutoConfig

    vision = vision_tokens(str(model_dir), AutoConfig.from_pretrained(model_dir), tok, None, None)
    data = folder / "rows.jsonl"
    rows = _rows() + [{"messages": [{"role": "user", "content": "no image"}, {"role": "assistant", "content": "ok"}]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = collate([encode(rec, folder, tok, vision, 512, loc) for loc, rec in read_records(data)],
                    tok.pad_token_id, vision)
    base = load_vlm(str(model_dir), "fp32", "sdpa", "cpu")
    loss = VisionLoss(apply_lora(base, 8, 16, 0.0, language_targets(base), False), chunk_size=16)
    with torch.no_grad():
        whole, n = loss.sum_and_count(batch)
        parts = [loss.sum_and_count(p) for p in split_rows(batch, 3)]
    assert [int(p["input_ids"].shape[0]) for p in split_rows(batch, 3)] == [1, 1, 1]
    assert "pixel_values" not in split_rows(batch, 3)[2]
    assert sum(c for _, c in parts) == n
    assert float(sum(v for v, _ in parts)) == pytest.approx(float(whole), rel=1e-5)


def _config(model: Path, data, out: Path, **training) -> dict:
    cfg = vlm_config(model, data, out, **training)
    cfg["data"]["max_length"] = 128  # SmolVLM's 56-pixel image: 4 tiles and the global view, 20 image tokens
    return cfg


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> tuple[Path, Path]:
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task

    return write_colour_task(tmp_path_factory.mktemp("colours"), n_train=64, n_eval=8, seed=0)


@pytest.mark.parametrize(("family", "note"), [
    ("gemma3", "LoRA on 14 language-model modules; the vision tower and projector (vision_tower.*, "
     "multi_modal_projector.*) are frozen"),
    ("smolvlm", "LoRA on 14 language-model modules; the vision tower and projector (vision_model.*, connector.*) are "
     "frozen"),
    ("idefics3", "LoRA on 14 language-model modules; the vision tower and projector (vision_model.*, connector.*) "
     "are frozen"),
    # the Gated DeltaNet layer's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj, the full-attention
    # layer's q/k/v/o and both MLPs
    ("qwen3_5", "LoRA on 15 language-model modules; the vision tower and projector (visual.*) are frozen"),
    # the same 15 but the MLPs' 6 in each layer: the shared expert's 3 and the routed experts' 2 stacks; the router and
    # the 1-wide shared_expert_gate are left out
    ("qwen3_5_moe", "LoRA on 19 language-model modules; the vision tower and projector (visual.*) are frozen")])
def test_a_run_trains_exports_merged_and_answers_about_an_image(tmp_path, colours, capsys, family, note):
    import torch
    from safetensors import safe_open

    from rocktune.cli import main
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.export.source import resolve
    from rocktune.tasks.vlm.export.vision_generate import is_vision_dir, load
    from rocktune.tasks.vlm.vision.model import model_inputs

    run = tmp_path / "run"
    model_dir = build_tiny_vlm(tmp_path / "m", family=family)
    train(config_from_dict(_config(model_dir, colours, run, max_steps=16, eval_every=8, sample_count=1)), quiet=True)
    rows = _metrics(run)
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 1.0 and evals[-1] < evals[0] - 1.0
    info = json.loads((run / "run_info.json").read_text())
    assert note in info["notes"] and info["data"]["train_images"] == 64
    with safe_open(str(run / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    modules = int(note.split()[2])
    assert len(keys) == 2 * modules and all(".language_model." in k or ".text_model." in k for k in keys)
    assert not any(root in k for root in ("vision", "visual", "projector", "connector") for k in keys)
    assert any(".experts." in k for k in keys) == (family == "qwen3_5_moe")
    assert not any(".mlp.gate." in k or "shared_expert_gate" in k for k in keys)  # no router, no 1-wide gate
    assert main(["export", str(run), "--to", "merged"]) == 0
    merged = run / "export" / "merged"
    # a merged Qwen3.5 is a text model too: generate takes it as one unless --image is given (as below)
    assert is_vision_dir(str(merged)) is not family.startswith("qwen3_5")
    assert (merged / "preprocessor_config.json").is_file()
    logits = []
    for where in (run, merged):
        model, tok, vision = load(resolve(str(where)), "cpu")
        batch = collate([encode(r, colours[1].parent, tok, vision, 128, loc) for loc, r in
                         read_records(colours[1])[:2]], tok.pad_token_id, vision)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        with torch.no_grad():
            logits.append(model(**model_inputs(base, batch)).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-4)
    assert main(["export", str(run), "--to", "gguf"]) == 0  # llama.cpp's language model and its mmproj
    assert sorted(p.name for p in (run / "export").iterdir()) == ["merged", "mmproj-f16.gguf", "model-f16.gguf"]
    capsys.readouterr()
    image = colours[1].parent / "images" / "eval_0.png"
    for where in (run, merged):
        assert main(["generate", str(where), "--image", str(image), "--prompt", "What colour is the shape?",
                     "--max-new-tokens", "4"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and said[0] == said[1]  # the merged model answers as the adapter did


def test_gemma3_lora_on_the_vision_side(tmp_path, colours):
    """Gemma 3's projector is a bare weight matrix: lora.vision=projector is refused with the reason; ``all`` adapts
    the vision tower's linear layers and says the projector stays frozen."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "m", family="gemma3")
    cfg = _config(model_dir, colours, tmp_path / "a", max_steps=2)
    cfg["lora"]["vision"] = "projector"
    with pytest.raises(UserError, match=r"lora.vision=projector: Gemma 3's projector has no linear layer for LoRA"):
        train(config_from_dict(cfg), quiet=True)
    cfg = _config(model_dir, colours, tmp_path / "b", max_steps=2)
    cfg["lora"]["vision"] = "all"
    train(config_from_dict(cfg), quiet=True)
    notes = json.loads((tmp_path / "b" / "run_info.json").read_text())["notes"]
    assert "LoRA on 14 language-model and 6 vision-tower modules; the projector is frozen" in notes


def test_smolvlm_lora_on_its_connector(tmp_path, colours):
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "m", family="smolvlm")
    cfg = _config(model_dir, colours, tmp_path / "run", max_steps=2)
    cfg["lora"]["vision"] = "projector"
    train(config_from_dict(cfg), quiet=True)
    notes = json.loads((tmp_path / "run" / "run_info.json").read_text())["notes"]
    assert "LoRA on 14 language-model and 1 projector modules; the vision tower (vision_model.*) is frozen" in notes


@pytest.mark.parametrize(("change", "message"), [
    ({"data": {"max_pixels": 50176}}, r"data.min_pixels/max_pixels set the resolution of Qwen's image processors; "
                                      r"Gemma 3's sets it in the model's preprocessor_config.json"),
    ({"model": {"vision_patch_embed": "linear"}}, r"model.vision_patch_embed=linear .* Gemma 3's vision tower has "
                                                  r"none"),
    ({"data": {"packing": True}}, r"data.packing with task=vlm packs Qwen-VL conversations .* Gemma 3 would need"),
])
def test_what_gemma3_cannot_do_is_refused(tmp_path, colours, change, message):
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "m", family="gemma3")
    cfg = _config(model_dir, colours, tmp_path / "run", max_steps=2)
    for section, values in change.items():
        cfg[section].update(values)
    with pytest.raises(UserError, match=message):
        train(config_from_dict(cfg), quiet=True)
    if "data" in change:  # refused before anything is written
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("change", "undo"), [
    ({"data": {"packing": True}}, "set data.packing: false"),
    ({"training": {"batching": "tokens"}}, "set training.batching: examples")])
def test_qwen3_5_refuses_packed_rows_for_its_recurrent_layers(tmp_path, colours, change, undo):
    """Packing keeps conversations apart in attention (masks, positions); a Gated DeltaNet layer's state would run on
    from one conversation into the next: refused before anything is written, naming the layers. Padded rows train
    (the run above, and the OOM split's equal loss)."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "m", family="qwen3_5")
    cfg = _config(model_dir, colours, tmp_path / "run", max_steps=2)
    for section, values in change.items():
        cfg[section].update(values)
    setting = "data.packing" if "data" in change else "training.batching=tokens"
    with pytest.raises(UserError, match=rf"{setting} with task=vlm packs conversations into rows, but .* has recurrent "
                                        rf"layers \(linear_attention in layers 0\) whose state .*; {undo} \(padded"):
        train(config_from_dict(cfg), quiet=True)
    assert not (tmp_path / "run").exists()


def test_qwen3_5_moe_lora_on_the_vision_side_is_refused(tmp_path, colours):
    """The expert stacks take LoRA through the text tasks' all-linear (PEFT's target_parameters), which reaches the
    language model only: lora.vision is refused with the reason rather than leaving the experts or the tower out."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    cfg = _config(build_tiny_vlm(tmp_path / "m", family="qwen3_5_moe"), colours, tmp_path / "run", max_steps=2)
    cfg["lora"]["vision"] = "projector"
    with pytest.raises(UserError, match=r"lora.vision=projector with a mixture-of-experts language model "
                                        r"\(Qwen3.5-MoE\): its expert stacks take LoRA through"):
        train(config_from_dict(cfg), quiet=True)


def test_data_preview_shows_each_split_image_and_its_tokens(tmp_path, capsys):
    from rocktune.cli import main
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "m", family="smolvlm")
    data = Path(__file__).parents[1] / "examples" / "vision" / "chat.jsonl"
    capsys.readouterr()
    assert main(["data", "preview", "--data", str(data), "--model", str(model_dir), "task=vlm", "data.max_length=256",
                 "--json", "-n", "1"]) == 0
    pv = json.loads(capsys.readouterr().out)
    assert (pv["n_examples"], pv["n_images"], pv["image_tokens"]) == (4, 4, 4 * 20)
    (image,) = pv["examples"][0]["images"]
    assert image["grid_thw"] == [2, 2] and image["tokens"] == 20
    start, end = image["positions"]
    # from its first image token to its last: 20 image tokens, 3 more tiles' <fake_token_around_image><row_r_col_c>,
    # the line breaks after each row of tiles and before the global view, and the global view's two tags
    assert end - start == 20 + 3 * 2 + 3 + 2
    text = pv["examples"][0]["text"]
    assert text.startswith("User:<fake_token_around_image><row_1_col_1><image 1: 31 tokens><fake_token_around_image>"
                           " What colour is the shape?")


@pytest.mark.parametrize("family", [*NEW, "qwen3_5"])
def test_the_chunked_loss_is_hf_own_forward_loss_and_gradients(tmp_path, colours, family):
    """Gemma 3 with its token_type_ids, SmolVLM/Idefics3 with their tiles' pixels batched per conversation, Qwen3.5
    with its Gated DeltaNet layer (15 adapted modules)."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    chunked_loss_matches(build_tiny_vlm(tmp_path / "m", family=family), colours, max_length=128,
                         modules=15 if family == "qwen3_5" else 14)


@pytest.fixture(scope="module")
def colour_task(tmp_path_factory) -> tuple[Path, Path]:
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task

    return write_colour_task(tmp_path_factory.mktemp("colour-task"), n_train=256, n_eval=32, seed=0)


@pytest.mark.parametrize("family", [pytest.param("gemma3", marks=pytest.mark.long),
                                    pytest.param("smolvlm", marks=pytest.mark.long), "qwen3_5",
                                    pytest.param("qwen3_5_moe", marks=pytest.mark.long)])
def test_a_tiny_model_learns_the_colour_of_a_shape(tmp_path, colour_task, capsys, family):
    """Held-out accuracy 1.0 measured for each (docs/vision.md); Gemma 3, SmolVLM and Qwen3.5-MoE 30-80 s each beside
    other jobs (make test-long), Qwen3.5 about 20 s."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    learns_the_colour(build_tiny_vlm(tmp_path / "m", family=family), colour_task, tmp_path, capsys, max_length=128)


def test_plan_models_the_families(tmp_path, capsys):
    """plan --task vlm sizes a Gemma 3 too (tests/test_planner_vlm.py checks it against real steps): its fixed soft
    tokens per image, and no max_pixels to choose."""
    import json

    from rocktune.cli import main
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "m", family="gemma3")
    capsys.readouterr()
    assert main(["plan", str(model_dir), "--task", "vlm", "--vram", "4GiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["images"]["tokens_per_image"] == {"min": 4, "max": 4} and doc["fit"]["max_pixels"] is None


def test_qwen3_5_vlm_loader_chooses_its_recurrent_kernels(tmp_path, monkeypatch):
    """task=vlm's loader settles Qwen3.5's Gated DeltaNet kernels as the text loader does (kernels/recurrent.py:
    a fast kernel only where it passes its self-test on the device; tests/test_recurrent_kernels.py covers the
    choice itself), once, on the run's device."""
    from rocktune.kernels import recurrent as recurrent_kernels
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.tasks.vlm.vision.model import load_vlm

    settled = []
    real = recurrent_kernels.settle
    monkeypatch.setattr(recurrent_kernels, "settle", lambda model, device, stand_ins=None:
                        settled.append((type(model).__name__, device)) or real(model, device, stand_ins))
    model = load_vlm(str(build_tiny_vlm(tmp_path / "m", family="qwen3_5")), "fp32", "sdpa", "cpu")
    assert settled == [("Qwen3_5ForConditionalGeneration", "cpu")]
    assert recurrent_kernels.layer_kernels(model)  # its layers call kernels rocktune chooses
