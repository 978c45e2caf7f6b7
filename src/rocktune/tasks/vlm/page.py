"""``rocktune data preview --html`` for task: vlm: the vision preview (report/vision_preview.py) as one self-contained
page (report/page.py). Each shown image is a thumbnail embedded as a data URL, with its original and processed
sizes, grid and token count; the tokens are the text preview's highlighted runs (report/preview_view.py), each
image's tokens one boxed block labelled with their count."""

from __future__ import annotations

import io

import rocktune.report.page as page
from rocktune.report.preview_view import example_html

THUMB = 160  # pixels on the longer side: enough to recognise an image, small enough for a page of many


def thumbnail_png(image) -> bytes:
    """``image`` (a Pillow image) shrunk to at most THUMB pixels a side, aspect kept, as PNG bytes."""
    small = image.copy()
    small.thumbnail((THUMB, THUMB))
    out = io.BytesIO()
    small.save(out, format="PNG")
    return out.getvalue()


def vision_preview_html(pv: dict) -> str:
    lengths = pv["tokens_per_example"]
    summary = [("data", pv["data_file"]), ("conversations", pv["n_examples"]), ("images", pv["n_images"]),
               ("image tokens", f"{pv['image_tokens']:,} (never trained)"),
               ("trained tokens", f"{pv['trained_tokens']:,}"),
               ("cut", f"{pv['n_truncated']} (longer than data.max_length={pv['max_length']})"),
               ("tokens per example", f"min {lengths['min']}, mean {lengths['mean']:.1f}, max {lengths['max']}")]
    body = ["<h2>Summary</h2>", page.table(summary), "<p>All rows and images read and checked as training reads "
            "them.</p>", "<h2>Examples</h2><p><span class=\"trained\">green: carries loss</span>, "
            "<span class=\"prompt\">grey: not trained</span>, <span class=\"special\">boxed: a special token, or "
            "one image's tokens with their count</span></p>"]
    for ex in pv["examples"]:
        body += [example_html(ex), _images_table(ex["images"])]
    return page.document(f"rocktune data preview — {pv['data_file']}", body)


def _images_table(images: list[dict]) -> str:
    head = ("image", "", "source", "original size", "processed size", "grid (t, h, w)", "tokens", "positions")
    rows = "".join(_image_row(n, im) for n, im in enumerate(images, 1))
    return "<table><tr>" + "".join(f"<th>{page.esc(h)}</th>" for h in head) + "</tr>" + rows + "</table>"


def _image_row(n: int, im: dict) -> str:
    thumb = page.image(im["thumbnail_png"], f"image {n}") if im.get("thumbnail_png") else ""
    processed = im.get("processed_size")
    cells = [f"image {n}", None, im["source"], _size(im["size"]), _size(processed) if processed else "",
             ", ".join(str(x) for x in im["grid_thw"]), im["tokens"],
             f"{im['positions'][0]}-{im['positions'][1] - 1}"]
    return "<tr>" + "".join(f"<td>{thumb}</td>" if c is None else
                            f"<td class=\"num\">{c}</td>" if isinstance(c, int) else f"<td>{page.esc(c)}</td>"
                            for c in cells) + "</tr>"


def _size(wh: list[int]) -> str:
    return f"{wh[0]}x{wh[1]}"
