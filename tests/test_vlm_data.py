"""Vision-language data (tasks/vlm/data/images.py, tasks/vlm/data/vision.py): every shape the ecosystem writes gives the
same tokens, loss sits on the assistant's tokens only (never on image tokens), the pixel limits reach the image
processor, and every bad image is a UserError naming its row. The tokenizer and Qwen's image processor are built offline
(tasks/vlm/demo/tiny_vlm.py); no model weights are needed."""

from __future__ import annotations

import base64
import json
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from rocktune.data.encode import IGNORE
from rocktune.data.records import read_records
from rocktune.tasks.vlm.data.vision import encode
from rocktune.tasks.vlm.demo.tiny_vlm import build_image_processor, build_vl_tokenizer
from rocktune.tasks.vlm.demo.vision_task import QUESTION, draw
from rocktune.errors import UserError
from rocktune.tasks.vlm.vision.model import vision_tokens

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def tok():
    return build_vl_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok) -> Path:
    """A directory with the image processor and tokenizer files a model directory has (no weights)."""
    out = tmp_path_factory.mktemp("vl-processor")
    build_image_processor().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _config(tok):
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("image_token_id", "<|image_pad|>"),
           ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    return SimpleNamespace(model_type="qwen2_5_vl", **ids)


@pytest.fixture(scope="module")
def vision(model_dir, tok):
    return vision_tokens(str(model_dir), _config(tok), tok, None, None)


@pytest.fixture()
def folder(tmp_path) -> Path:
    import random

    (tmp_path / "images").mkdir()
    draw("red", random.Random(0), size=64).save(tmp_path / "images" / "red.png")
    return tmp_path


def _encode_rows(folder: Path, rows: list[dict], tok, vision, max_length: int = 128):
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [encode(rec, data.parent, tok, vision, max_length, loc) for loc, rec in read_records(data)]


def _user(parts):
    return [{"role": "user", "content": parts}, {"role": "assistant", "content": "red"}]


def test_every_format_gives_the_same_tokens_labels_and_grid(folder, tok, vision):
    png = (folder / "images" / "red.png").read_bytes()
    text = {"type": "text", "text": QUESTION}
    rows = [
        {"messages": _user([{"type": "image_url", "image_url": {"url": "images/red.png"}}, text])},  # OpenAI
        {"messages": _user([{"type": "image_url", "image_url": "images/red.png"}, text])},  # url as a string
        {"messages": _user([{"type": "image_url", "image_url": {"url": (folder / "images/red.png").as_uri()}},
                            text])},  # file:// URL
        {"messages": _user([{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(png).decode()}}, text])},  # base64 data URL
        {"messages": _user([{"type": "image", "image": "images/red.png"}, text])},  # HF's image part
        {"messages": _user([{"type": "input_image", "image_url": "images/red.png"},
                            {"type": "input_text", "text": QUESTION}])},  # OpenAI's Responses API
        {"messages": _user([{"type": "image", "image": {"path": "images/red.png"}}, text])},  # a datasets Image
        {"messages": _user([{"type": "image"}, text]), "images": ["images/red.png"]},  # TRL's images column
        {"conversations": [{"from": "human", "value": "<image>" + QUESTION}, {"from": "gpt", "value": "red"}],
         "image": "images/red.png"},  # LLaVA / ShareGPT
    ]
    out = _encode_rows(folder, rows, tok, vision)
    first = out[0]
    for e in out[1:]:
        assert (e.input_ids, e.labels, e.grids) == (first.input_ids, first.labels, first.grids)
    assert first.images[0].path == folder / "images" / "red.png"
    assert out[3].images[0].data == png and len(out) == 9
    from rocktune.tasks.vlm.data.images import ImageRef, resolve

    assert resolve({"bytes": png, "path": None}, folder, "x") == ImageRef(data=png)  # a datasets Image's bytes


def test_loss_is_on_the_assistant_tokens_only_and_never_on_image_tokens(folder, tok, vision):
    row = {"messages": _user([{"type": "image_url", "image_url": {"url": "images/red.png"}},
                              {"type": "text", "text": QUESTION}])}
    (e,) = _encode_rows(folder, [row], tok, vision)
    # a 64x64 image within [4, 16] x 28x28 pixels: resized to 56x56, 4x4 patches of 14, merged 2x2 into 4 tokens
    assert e.grids == ((1, 4, 4),)
    assert e.input_ids.count(vision.image_token_id) == 4
    trained = [t for t, label in zip(e.input_ids, e.labels) if label != IGNORE]
    assert tok.decode(trained) == "red<|im_end|>\n"
    assert all(label == IGNORE for t, label in zip(e.input_ids, e.labels) if t in vision.masked_ids)
    assert tok.decode(e.input_ids).startswith("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4)


def test_llava_markers_keep_their_text_and_several_images_keep_their_order(folder, tok, vision):
    import random

    draw("blue", random.Random(1), size=200).save(folder / "images" / "blue.png")
    row = {"conversations": [{"from": "human", "value": "<image>\nfirst, then <image>\n" + QUESTION},
                             {"from": "gpt", "value": "red, blue"}], "images": ["images/red.png", "images/blue.png"]}
    (e,) = _encode_rows(folder, [row], tok, vision)
    assert [r.path.name for r in e.images] == ["red.png", "blue.png"]
    assert e.grids == ((1, 4, 4), (1, 8, 8))  # 200x200 -> 112x112 under max_pixels 28*28*16: 16 tokens
    assert e.input_ids.count(vision.image_token_id) == 4 + 16
    assert "<|vision_end|>\nfirst, then <|vision_start|>" in tok.decode(e.input_ids)


def test_max_and_min_pixels_reach_the_image_processor(folder, model_dir, tok):
    import random

    draw("blue", random.Random(1), size=200).save(folder / "images" / "big.png")
    row = {"messages": _user([{"type": "image", "image": "images/big.png"}, {"type": "text", "text": "?"}])}
    grids = {}
    for limit in (28 * 28 * 4, 28 * 28 * 16, 28 * 28 * 64):
        v = vision_tokens(str(model_dir), _config(tok), tok, None, limit)
        (e,) = _encode_rows(folder, [row], tok, v)
        grids[limit] = e.grids[0]
    assert grids == {3136: (1, 4, 4), 12544: (1, 8, 8), 50176: (1, 14, 14)}
    v = vision_tokens(str(model_dir), _config(tok), tok, 28 * 28 * 36, 28 * 28 * 64)  # a small image is enlarged
    (e,) = _encode_rows(folder, [{"messages": _user([{"type": "image", "image": "images/red.png"}])}], tok, v)
    assert e.grids == ((1, 12, 12),)


def test_a_long_example_is_cut_at_its_end_but_never_through_an_image(folder, tok, vision):
    long = {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/red.png"},
                                                      {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": "red " * 40}]}
    (e,) = _encode_rows(folder, [long], tok, vision, max_length=60)
    assert e.truncated and len(e.input_ids) == 60 and e.input_ids.count(vision.image_token_id) == 4
    with pytest.raises(UserError, match=r"train.jsonl:1: .* would cut through an image's tokens"):
        _encode_rows(folder, [long], tok, vision, max_length=8)


def _png_claiming(width: int, height: int, real: bytes) -> bytes:
    """``real`` with its IHDR chunk's size rewritten (its CRC recomputed): a header that promises a huge image."""
    ihdr = real[16:29]
    patched = struct.pack(">II", width, height) + ihdr[8:]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + patched) & 0xFFFFFFFF)
    return real[:16] + patched + crc + real[33:]


def _bad_image_cases(folder: Path) -> dict[str, tuple[object, str]]:
    png = (folder / "images" / "red.png").read_bytes()
    (folder / "images" / "text.png").write_text("not an image at all")
    (folder / "images" / "cut.png").write_bytes(png[: len(png) // 2])
    (folder / "images" / "bomb.png").write_bytes(_png_claiming(40_000, 40_000, png))
    return {
        "missing": ("images/nope.png", r"images/nope.png does not exist"),
        "not an image": ("images/text.png", r"text.png is not an image Pillow can read"),
        "truncated": ("images/cut.png", r"cut.png cannot be read .*truncated or damaged"),
        "bomb": ("images/bomb.png", r"bomb.png has more than 89,478,485 pixels \(a decompression bomb guard\)"),
        "bad base64": ("data:image/png;base64,@@@", r"base64 text does not decode"),
        "not base64": ("data:image/png,abc", r"is not base64"),
        "remote": ("https://example.invalid/x.png", r"is a remote URL; rocktune reads local images only"),
        "not a string": (42, r"an image must be a path"),
    }


@pytest.mark.parametrize("case", ["missing", "not an image", "truncated", "bomb", "bad base64", "not base64", "remote",
                                  "not a string"])
def test_a_bad_image_is_a_clear_error_naming_its_row(folder, tok, vision, case):
    source, message = _bad_image_cases(folder)[case]
    good = {"messages": _user([{"type": "image", "image": "images/red.png"}])}
    bad = {"messages": _user([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": source}}])}
    with pytest.raises(UserError, match=r"train.jsonl:2, image 1: .*" + message):
        _encode_rows(folder, [good, bad], tok, vision)


def test_placeholders_and_images_must_match(folder, tok, vision):
    row = {"messages": _user([{"type": "image"}, {"type": "image"}]), "images": ["images/red.png"]}
    with pytest.raises(UserError, match=r"train.jsonl:1: 2 image placeholders .* but 1 images"):
        _encode_rows(folder, [row], tok, vision)
    llava = {"conversations": [{"from": "human", "value": "no marker"}, {"from": "gpt", "value": "x"}],
             "image": "images/red.png"}
    with pytest.raises(UserError, match=r"0 image placeholders .* but 1 images"):
        _encode_rows(folder, [llava], tok, vision)


def test_a_template_that_drops_images_is_refused(folder, vision):
    from rocktune.demo.tiny import build_tokenizer

    text_only = build_tokenizer()  # its template renders content as a string: the image part is lost
    text_only.add_special_tokens({"additional_special_tokens": ["<|image_pad|>"]})
    row = {"messages": _user([{"type": "image", "image": "images/red.png"}, {"type": "text", "text": "?"}])}
    with pytest.raises(UserError, match=r"rendered 0 image placeholders for 1 images; use the model's own chat"):
        _encode_rows(folder, [row], text_only, vision)


def test_malformed_records_name_their_turn(folder, tok, vision):
    cases = [({"messages": []}, r"non-empty 'messages'"),
             ({"messages": [{"role": "robot", "content": "x"}]}, r"turn 1: unknown role 'robot'"),
             ({"messages": _user([{"type": "audio"}])}, r"turn 1: a content part must be"),
             ({"messages": [{"role": "user", "content": [{"type": "image", "image": "images/red.png"}]}]},
              r"no assistant turn")]
    for row, message in cases:
        with pytest.raises(UserError, match=r"train.jsonl:1.*" + message):
            _encode_rows(folder, [row], tok, vision)


def test_the_shipped_example_encodes_every_row(tok, vision):
    """examples/vision/chat.jsonl (docs/vision.md's example): all four shapes, a system turn, two assistant turns."""
    data = Path(__file__).parents[1] / "examples" / "vision" / "chat.jsonl"
    out = [encode(rec, data.parent, tok, vision, 256, loc) for loc, rec in read_records(data)]
    assert [len(e.images) for e in out] == [1, 1, 1, 1]
    answers = [tok.decode([t for t, label in zip(e.input_ids, e.labels) if label != IGNORE]) for e in out]
    assert answers == ["red<|im_end|>\n", "blue<|im_end|>\nyes<|im_end|>\n", "green<|im_end|>\n", "green<|im_end|>\n"]


@pytest.mark.parametrize(("processor", "patch"), [("Qwen2_5_VLProcessor", 14), ("Qwen3VLProcessor", 16),
                                                   ("Qwen2VLProcessor", 14)])
def test_the_tokens_and_pixels_are_those_of_transformers_own_processor(folder, tok, processor, patch, tmp_path):
    """Qwen2_5_VLProcessor widens the placeholders and makes the pixels for the same rendered text: the same ids and
    pixel values. (Its constructor's class check wants a torchvision video processor, absent here: patched out, the
    video side is not used.)"""
    import random
    from unittest import mock

    import torch
    import transformers
    from transformers.processing_utils import ProcessorMixin

    from rocktune.tasks.vlm.data.images import load
    from rocktune.tasks.vlm.data.vision_batch import collate

    build_image_processor(patch).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    vision = vision_tokens(str(tmp_path), _config(tok), tok, None, None)
    draw("blue", random.Random(2), size=200).save(folder / "images" / "wide.png")
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/red.png"},
                                                     {"type": "text", "text": "and"},
                                                     {"type": "image", "image": "images/wide.png"}]},
                        {"role": "assistant", "content": "red, blue"}]}
    (e,) = _encode_rows(folder, [row], tok, vision)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg)):
        proc = getattr(transformers, processor)(image_processor=vision.image_processor, tokenizer=tok,
                                                 video_processor=None, chat_template=tok.chat_template)
    messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                 [{"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})} for p in m["content"]]}
                for m in row["messages"]]
    text = tok.apply_chat_template(messages, tokenize=False)
    ref = proc(text=[text], images=[load(r, "x") for r in e.images], return_tensors="pt")
    assert ref["input_ids"][0].tolist() == e.input_ids
    batch = collate([e], tok.pad_token_id, vision)
    assert torch.equal(batch["pixel_values"], ref["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], ref["image_grid_thw"])
    if "mm_token_type_ids" in ref:  # transformers 5 processors mark the image tokens; the collate marks them alike
        assert torch.equal(batch["mm_token_type_ids"], ref["mm_token_type_ids"])


def test_a_template_kept_only_by_the_processor_is_used(tmp_path, tok):
    """Vision-language checkpoints may keep the chat template in the processor's chat_template.json."""
    from transformers import AutoTokenizer

    from rocktune.tasks.vlm.vision.model import with_processor_template

    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": tok.chat_template}))
    bare = AutoTokenizer.from_pretrained(tmp_path)
    assert not bare.chat_template
    assert with_processor_template(bare, str(tmp_path)).chat_template == tok.chat_template


def test_parquet_and_save_to_disk_image_columns_give_the_same_tokens(folder, tok, vision, tmp_path):
    """TRL's vision sets: list content parts and a list-of-Image column (bytes embedded), read through datasets
    undecoded; the same tokens, labels and pixels' grid as the JSONL row naming the file."""
    from datasets import Dataset, Features, Image, Sequence, Value

    from rocktune.config import DataConfig
    from rocktune.tasks.vlm.data.vision_source import read_rows

    png = (folder / "images" / "red.png").read_bytes()
    part = {"type": Value("string"), "text": Value("string")}
    features = Features({"messages": [{"role": Value("string"), "content": [part]}], "images": Sequence(Image())})
    messages = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": QUESTION}]},
                {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    ds = Dataset.from_dict({"messages": [messages], "images": [[{"bytes": png, "path": None}]]}, features=features)
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    (want,) = _encode_rows(folder, [{"messages": _user([{"type": "image", "image": "images/red.png"},
                                                        {"type": "text", "text": QUESTION}])}], tok, vision)
    for spec, where in ((tmp_path / "rows.parquet", "rows.parquet[row 0]"), (tmp_path / "saved", "saved[row 0]")):
        rows, base = read_rows(str(spec), DataConfig(train_file=str(spec)), tmp_path / "cache", "data.train_file")
        ((loc, rec),) = rows
        assert str(loc).endswith(where)
        got = encode(rec, base, tok, vision, 128, str(loc))
        assert (got.input_ids, got.labels, got.grids) == (want.input_ids, want.labels, want.grids)
        assert got.images[0].data == png


def test_data_columns_split_and_eval_split_reach_vision_sources(folder, tok, vision, tmp_path):
    """A source whose columns have other names (data.columns) and a DatasetDict folder whose splits are named
    (data.split for training, data.eval_split for the eval side); a JSONL file is renamed the same way."""
    from datasets import Dataset, DatasetDict, Features, Image, Sequence, Value

    from rocktune.config import DataConfig
    from rocktune.tasks.vlm.data.vision_source import read_rows

    import random

    draw("blue", random.Random(1), size=64).save(folder / "images" / "blue.png")
    png = {c: (folder / "images" / f"{c}.png").read_bytes() for c in ("red", "blue")}
    part = {"type": Value("string"), "text": Value("string")}
    features = Features({"dialog": [{"role": Value("string"), "content": [part]}], "pictures": Sequence(Image())})

    def rows(colour):
        dialog = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": QUESTION}]},
                  {"role": "assistant", "content": [{"type": "text", "text": colour}]}]
        return Dataset.from_dict({"dialog": [dialog], "pictures": [[{"bytes": png[colour], "path": None}]]},
                                 features=features)

    DatasetDict({"fit": rows("red"), "check": rows("blue")}).save_to_disk(str(tmp_path / "saved"))
    d = DataConfig(train_file=str(tmp_path / "saved"), eval_file=str(tmp_path / "saved"), split="fit",
                   eval_split="check", columns={"messages": "dialog", "images": "pictures"})
    for key, colour in (("data.train_file", "red"), ("data.eval_file", "blue")):
        ((loc, rec),) = read_rows(str(tmp_path / "saved"), d, tmp_path / "cache", key)[0]
        assert rec["images"][0]["bytes"] == png[colour] and rec["messages"][1]["content"][0]["text"] == colour
    jsonl = folder / "renamed.jsonl"
    parts = [{"type": "image", "image": "images/red.png"}, {"type": "text", "text": QUESTION}]
    jsonl.write_text(json.dumps({"dialog": _user(parts)}) + "\n")
    (want,) = _encode_rows(folder, [{"messages": _user(parts)}], tok, vision)
    ((loc, rec),), base = read_rows(str(jsonl), DataConfig(train_file=str(jsonl), columns={"messages": "dialog"}),
                                    tmp_path / "cache", "data.train_file")
    got = encode(rec, base, tok, vision, 128, str(loc))
    assert (got.input_ids, got.labels, got.grids) == (want.input_ids, want.labels, want.grids)
    with pytest.raises(UserError, match=r"renamed.jsonl:1: data.columns maps to \['talk'\], which this row does not"):
        read_rows(str(jsonl), DataConfig(train_file=str(jsonl), columns={"messages": "talk"}), tmp_path / "c", "k")
    with pytest.raises(UserError, match=r"data.columns has \['prompt'\], which a vision-language row does not use"):
        read_rows(str(jsonl), DataConfig(train_file=str(jsonl), columns={"prompt": "dialog"}), tmp_path / "c", "k")
