"""The token cache of task=vlm (tasks/vlm/data/vision_cache.py): a second start reads the encoded conversations back
(the same ids, labels, grids and image references, no image processed again, the same losses), and whatever determines
them (an image file, data.max_pixels / max_length, the chat template, the data) changes the key, so it is encoded again.
On a tiny random-init Qwen2.5-VL built offline."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest

from rocktune.config import config_from_dict
from rocktune.data.dataset import Pending
from rocktune.tasks.vlm import task as vlm_task

pytest.importorskip("PIL")


@pytest.fixture()
def data(tmp_path) -> Path:
    """12 colour-task rows with image files, and one with its image embedded as a data URL."""
    from rocktune.tasks.vlm.demo.vision_task import draw, write_colour_task

    train, _ = write_colour_task(tmp_path / "data", n_train=12, n_eval=0, seed=3)
    png = tmp_path / "embedded.png"
    draw("green", random.Random(5), size=56).save(png)
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    with train.open("a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": url},
                                                                      {"type": "text", "text": "Colour?"}]},
                                         {"role": "assistant", "content": "green"}]}) + "\n")
    return train


def _config(model: Path, data: Path, tmp: Path, name: str = "run", **data_settings) -> dict:
    return {"task": "vlm", "model": {"name_or_path": str(model)}, "lora": {"r": 4, "alpha": 8},
            "data": {"train_file": str(data), "eval_fraction": 0.25, "max_length": 64, "cache_dir": str(tmp / "cache"),
                     **data_settings},
            "training": {"max_steps": 2, "micro_batch_size": 4, "grad_accum": 1, "lr": 1e-3, "warmup_steps": 0,
                         "eval_every": 0, "precision": "fp32", "device": "cpu", "seed": 0},
            "reliability": {"save_every": 0, "min_free_disk_mb": 0}, "output": {"dir": str(tmp / name)}}


@pytest.fixture()
def encodes(monkeypatch) -> list[str]:
    """The rows encoded (images opened and processed) since the test began."""
    seen: list[str] = []
    real = vlm_task.encode

    def counted(rec, base, tokenizer, vision, max_length, loc):
        seen.append(loc)
        return real(rec, base, tokenizer, vision, max_length, loc)

    monkeypatch.setattr(vlm_task, "encode", counted)
    return seen


def _read(model: Path, data: Path, tmp: Path, template: str | None = None, **data_settings):
    """(train, eval) as task=vlm's prepare reads them, the cache committed as there."""
    from transformers import AutoConfig

    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.vision.model import vision_tokens, with_processor_template

    cfg = config_from_dict(_config(model, data, tmp, **data_settings))
    tokenizer = with_processor_template(load_tokenizer(str(model), False), str(model))
    if template is not None:
        tokenizer.chat_template = template
    d = cfg.data
    vision = vision_tokens(str(model), AutoConfig.from_pretrained(model), tokenizer, d.min_pixels, d.max_pixels)
    pending = Pending.start(tmp / "cache")
    out = vlm_task._read(cfg, tokenizer, vision, tmp / "cache", pending)
    pending.commit()
    return out


def test_a_second_read_comes_from_the_cache_with_the_same_examples(vlm_dir, data, tmp_path, encodes):
    first = _read(vlm_dir, data, tmp_path)
    assert len(encodes) == 13
    second = _read(vlm_dir, data, tmp_path)
    assert len(encodes) == 13  # nothing encoded again: no image opened or processed
    assert second == first  # ids, labels, grids, the cut flags and the image references (embedded bytes too)
    assert any(ref.data is not None for e in first[0] + first[1] for ref in e.images)
    assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 1


@pytest.mark.parametrize("change", ["image", "max_pixels", "max_length", "template", "data", "columns"])
def test_what_determines_the_tokens_changes_the_key(vlm_dir, data, tmp_path, encodes, change):
    from PIL import Image

    _read(vlm_dir, data, tmp_path)
    settings, template = {}, None
    if change == "image":  # a wider image: more tokens, and its file's size and time change
        Image.new("RGB", (112, 56), (250, 10, 10)).save(data.parent / "images" / "train_0.png")
    elif change == "max_pixels":
        settings = {"max_pixels": 28 * 28 * 2}
    elif change == "max_length":
        settings = {"max_length": 60}
    elif change == "columns":  # the same file's rows renamed (here to themselves: a new key, the same examples)
        settings = {"columns": {"messages": "messages"}}
    elif change == "template":
        from rocktune.models.load import load_tokenizer
        from rocktune.tasks.vlm.vision.model import with_processor_template

        base = with_processor_template(load_tokenizer(str(vlm_dir), False), str(vlm_dir)).chat_template
        template = base.replace("<|im_start|>", "<|im_start|> ")  # a space after each turn marker
    else:
        with data.open("a") as f:
            f.write(data.read_text().splitlines()[0] + "\n")
    again = _read(vlm_dir, data, tmp_path, template, **settings)
    assert len(encodes) == 13 + 13 + (change == "data")
    assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 2
    fresh = _read(vlm_dir, data, tmp_path / "fresh", template, **settings)  # an empty cache: the same examples
    assert again == fresh
    if change == "image":
        grids = [e.grids for e in again[0] + again[1] if e.images[0].path and e.images[0].path.name == "train_0.png"]
        assert grids == [((1, 4, 8),)]


def test_a_second_run_starts_from_the_cache_and_trains_the_same(vlm_dir, data, tmp_path, encodes):
    from rocktune.tasks import train

    train(config_from_dict(_config(vlm_dir, data, tmp_path, "first")), quiet=True)
    assert len(encodes) == 13
    train(config_from_dict(_config(vlm_dir, data, tmp_path, "second")), quiet=True)
    assert len(encodes) == 13
    info = [json.loads((tmp_path / name / "run_info.json").read_text()) for name in ("first", "second")]
    assert [i["data"]["cache_hit"] for i in info] == [False, True]
    assert info[0]["data"]["fingerprint"] == info[1]["data"]["fingerprint"]
    losses = [[json.loads(x).get("loss") for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
              for name in ("first", "second")]
    assert losses[0] == losses[1] and len([x for x in losses[0] if x is not None]) == 2
