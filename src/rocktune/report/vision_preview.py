"""``rocktune data preview -c CONFIG`` for task: vlm: every row read, every image opened and encoded as training
does (data/vision.py), then the first examples shown with each image's size, its token count and where its tokens
sit, the trained tokens in [brackets]. A bad row or image stops the preview with the error training would give."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rocktune.data.encode import IGNORE
from rocktune.data.images import check
from rocktune.data.vision import VisionExample, VisionTokens, encode
from rocktune.data.vision_source import read_rows


def build_vision_preview(data, tokenizer, vision: VisionTokens, n_show: int) -> dict:
    """``data``: the config's data section."""
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
            "examples": [_shown(loc, e, tokenizer, vision) for loc, e in examples[:n_show]]}


def _shown(loc: str, e: VisionExample, tokenizer, vision: VisionTokens) -> dict:
    spans = _image_spans(e.input_ids, vision.image_token_id, [vision.rule.tokens(g) for g in e.grids])
    images = []
    for i, (ref, grid, (start, end)) in enumerate(zip(e.images, e.grids, spans)):
        width, height = check(ref, f"{loc}, image {i + 1}")
        images.append({"source": ref.describe(), "size": [width, height], "grid_thw": list(grid),
                       "tokens": vision.rule.tokens(grid), "positions": [start, end]})
    return {"loc": loc, "tokens": len(e.input_ids), "truncated": e.truncated, "images": images,
            "text": _text(e, tokenizer, spans)}


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


def _text(e: VisionExample, tokenizer, spans) -> str:
    """The sequence as text: each image's tokens as one <image N: T tokens> mark, trained tokens in [brackets]."""
    out, i, k = [], 0, 0
    while i < len(e.input_ids):
        if k < len(spans) and i == spans[k][0]:
            out.append(f"<image {k + 1}: {spans[k][1] - spans[k][0]} tokens>")
            i, k = spans[k][1], k + 1
            continue
        trained = i > 0 and e.labels[i] != IGNORE
        j = i
        while j < len(e.input_ids) and (j == 0 or (e.labels[j] != IGNORE) == trained) and \
                not (k < len(spans) and j == spans[k][0]):
            j += 1
        text = tokenizer.decode(e.input_ids[i:j])
        out.append(f"[{text}]" if trained else text)
        i = j
    return "".join(out)


def run_vision_preview(cfg, n_show: int, as_json: bool) -> int:
    from transformers import AutoConfig

    from rocktune.model import load_tokenizer
    from rocktune.vision_model import model_type, vision_tokens, with_processor_template

    m, d = cfg.model, cfg.data
    model_type(m.name_or_path)
    tokenizer = with_processor_template(load_tokenizer(m.name_or_path, False), m.name_or_path)
    vision = vision_tokens(m.name_or_path, AutoConfig.from_pretrained(m.name_or_path), tokenizer, d.min_pixels,
                           d.max_pixels)
    pv = build_vision_preview(d, tokenizer, vision, n_show)
    if as_json:
        print(json.dumps(pv, indent=1))
        return 0
    lengths = pv["tokens_per_example"]
    print(f"{pv['data_file']}: {pv['n_examples']} conversations with {pv['n_images']} images ({pv['image_tokens']} "
          f"image tokens, never trained); {pv['trained_tokens']} trained tokens; {pv['n_truncated']} cut to "
          f"data.max_length={pv['max_length']}; tokens per example {lengths['min']}-{lengths['max']}, mean "
          f"{lengths['mean']:.1f}. [brackets]: the tokens the loss scores.")
    for ex in pv["examples"]:
        print(f"\n{ex['loc']}: {ex['tokens']} tokens{' (cut)' if ex['truncated'] else ''}")
        for n, im in enumerate(ex["images"], 1):
            print(f"  image {n}: {im['source']}, {im['size'][0]}x{im['size'][1]} pixels -> grid {im['grid_thw']}, "
                  f"{im['tokens']} tokens at positions {im['positions'][0]}-{im['positions'][1] - 1}")
        print(ex["text"])
    print("\nchecks passed: every row and image read as training reads them.")
    return 0
