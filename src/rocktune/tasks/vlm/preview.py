"""``rocktune data preview -c CONFIG`` for task: vlm: every row read, every image opened and encoded as training
does (tasks/vlm/data/vision.py), then the first examples shown with each image's size, its token count and where its
tokens sit, the trained tokens in [brackets] (``--html``: the same as one page with thumbnails, report/vision_page.py).
A bad row or image stops the preview with the error training would give, before the page is written."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rocktune.atomic import write_atomic
from rocktune.data.encode import IGNORE
from rocktune.tasks.vlm.data.images import load
from rocktune.tasks.vlm.data.vision import VisionExample, VisionTokens, encode
from rocktune.tasks.vlm.data.vision_source import read_rows
from rocktune.data.preview import runs
from rocktune.tasks.vlm.page import thumbnail_png, vision_preview_html


def build_vision_preview(data, tokenizer, vision: VisionTokens, n_show: int, thumbnails: bool = False) -> dict:
    """``data``: the config's data section. ``thumbnails``: each shown image also as a small PNG
    (``thumbnail_png``, bytes: for the HTML page, left out of the JSON)."""
    with tempfile.TemporaryDirectory(prefix="rocktune-preview-") as tmp:
        rows, base = read_rows(data.train_file, data, Path(tmp) / "cache", "data.train_file")
        examples = [(str(loc), encode(rec, base, tokenizer, vision, data.max_length, str(loc))) for loc, rec in rows]
    lengths = [len(e.input_ids) for _, e in examples]
    return {"data_file": data.train_file, "n_examples": len(examples),
            "n_images": sum(len(e.images) for _, e in examples),
            "image_tokens": sum(e.image_tokens for _, e in examples),
            "trained_tokens": sum(sum(label != IGNORE for label in e.labels[1:]) for _, e in examples),
            "n_truncated": sum(e.truncated for _, e in examples), "max_length": data.max_length,
            "tokens_per_example": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)},
            "examples": [_shown(loc, e, tokenizer, vision, thumbnails) for loc, e in examples[:n_show]]}


def _shown(loc: str, e: VisionExample, tokenizer, vision: VisionTokens, thumbnails: bool) -> dict:
    spans = _image_spans(e.input_ids, vision.image_token_id, [vision.rule.tokens(g) for g in e.grids])
    patch = getattr(vision.image_processor, "patch_size", None)
    images = []
    for i, (ref, grid, (start, end)) in enumerate(zip(e.images, e.grids, spans)):
        image = load(ref, f"{loc}, image {i + 1}", verify=True)
        im = {"source": ref.describe(), "size": list(image.size), "grid_thw": list(grid),
              "tokens": vision.rule.tokens(grid), "positions": [start, end]}
        if patch and len(grid) == 3:  # Qwen: the pixels the image processor resized it to, whole patches a side
            im["processed_size"] = [grid[2] * patch, grid[1] * patch]
        if thumbnails:
            im["thumbnail_png"] = thumbnail_png(image)
        images.append(im)
    runs = _runs(e, tokenizer, spans)
    return {"loc": loc, "tokens": len(e.input_ids), "truncated": e.truncated, "images": images,
            "text": _text(runs), "runs": runs}


def _image_spans(ids: list[int], image_id: int, counts: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each image's tokens, in order: from its first image token to its last (Idefics3's tiles have
    their tags between)."""
    at = [i for i, tok in enumerate(ids) if tok == image_id]
    spans, k = [], 0
    for n in counts:
        if k + n <= len(at):
            spans.append((at[k], at[k + n - 1] + 1))
        k += n
    return spans


def _runs(e: VisionExample, tokenizer, spans) -> list[list]:
    """The sequence as the text preview's ``[text, trained, is_special]`` runs, each image's tokens one special run
    ``<image N: T tokens>`` (never trained) instead of T placeholders."""
    special = set(tokenizer.all_special_ids)
    out, i = [], 0
    for k, (start, end) in enumerate(spans + [(len(e.input_ids), len(e.input_ids))]):
        if start > i:
            out += runs(e.input_ids[i:start], e.labels[i:start], tokenizer, special, start=i)
        if end > start:
            out.append([f"<image {k + 1}: {end - start} tokens>", False, True])
        i = end
    return out


def _text(shown: list[list]) -> str:
    """The runs as one line of text, each stretch of trained tokens in [brackets]."""
    out, inside = [], False
    for chunk, trained, _ in shown:
        if trained != inside:
            out.append("[" if trained else "]")
            inside = trained
        out.append(chunk)
    return "".join(out) + ("]" if inside else "")


def public(pv: dict) -> dict:
    """The preview without its thumbnails' bytes (the JSON output)."""
    examples = [{**ex, "images": [{k: v for k, v in im.items() if k != "thumbnail_png"} for im in ex["images"]]}
                for ex in pv["examples"]]
    return {**pv, "examples": examples}


def run_vision_preview(cfg, n_show: int, as_json: bool, html: str | None = None) -> int:
    """Print the preview (or ``as_json``); ``html``: also write it as one self-contained page there."""
    from transformers import AutoConfig

    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.vision.model import model_type, vision_tokens, with_processor_template

    m, d = cfg.model, cfg.data
    model_type(m.name_or_path)
    tokenizer = with_processor_template(load_tokenizer(m.name_or_path, False), m.name_or_path)
    vision = vision_tokens(m.name_or_path, AutoConfig.from_pretrained(m.name_or_path), tokenizer, d.min_pixels,
                           d.max_pixels)
    pv = build_vision_preview(d, tokenizer, vision, n_show, thumbnails=bool(html))
    if html:
        write_atomic(Path(html), vision_preview_html(pv))
    if as_json:
        print(json.dumps(public(pv), indent=1))
        return 0
    lengths = pv["tokens_per_example"]
    print(f"{pv['data_file']}: {pv['n_examples']} conversations with {pv['n_images']} images ({pv['image_tokens']} "
          f"image tokens, never trained); {pv['trained_tokens']} trained tokens; {pv['n_truncated']} cut to "
          f"data.max_length={pv['max_length']}; tokens per example {lengths['min']}-{lengths['max']}, mean "
          f"{lengths['mean']:.1f}. [brackets]: the tokens the loss scores.")
    for ex in pv["examples"]:
        print(f"\n{ex['loc']}: {ex['tokens']} tokens{' (cut)' if ex['truncated'] else ''}")
        for n, im in enumerate(ex["images"], 1):
            print(f"  image {n}: {im['source']}, {_size(im['size'])} pixels{_resized(im)} -> grid {im['grid_thw']}, "
                  f"{im['tokens']} tokens at positions {im['positions'][0]}-{im['positions'][1] - 1}")
        print(ex["text"])
    print("\nchecks passed: every row and image read as training reads them.")
    if html:
        print(f"preview page: {html}")
    return 0


def _size(wh: list[int]) -> str:
    return f"{wh[0]}x{wh[1]}"


def _resized(im: dict) -> str:
    return f" (resized to {_size(im['processed_size'])})" if im.get("processed_size") else ""
