"""``rocktune data preview --html`` for task=vlm (tasks/vlm/page.py): one self-contained page with each shown
image as an embedded thumbnail (decoded back here), its original and processed sizes, grid and token count, the
trained tokens highlighted, each image's tokens one labelled block, all text escaped; a bad image is the usual
error naming its row and no page is written. On a tiny random-init Qwen2.5-VL built offline."""

from __future__ import annotations

import base64
import io
import json
import random
import re
from pathlib import Path

import pytest

from rocktune.cli import main

pytest.importorskip("PIL")


@pytest.fixture()
def data(tmp_path) -> Path:
    """Two conversations: a 300x200 photo-like image with text that needs escaping, then two small images."""
    from PIL import Image

    from rocktune.tasks.vlm.demo.vision_task import draw

    (tmp_path / "images").mkdir()
    Image.new("RGB", (300, 200), (200, 30, 30)).save(tmp_path / "images" / "wide.png")
    draw("blue", random.Random(1), size=56).save(tmp_path / "images" / "blue.png")
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "images/wide.png"},
                                                        {"type": "text", "text": "Is <b>this</b> & that red?"}]},
                          {"role": "assistant", "content": "yes <i>"}]},
            {"conversations": [{"from": "human", "value": "<image><image>\nSame colour?"},
                               {"from": "gpt", "value": "no"}], "images": ["images/blue.png", "images/wide.png"]}]
    out = tmp_path / "train.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _preview(vlm_dir: Path, data: Path, *extra: str) -> int:
    return main(["data", "preview", "--data", str(data), "--model", str(vlm_dir), "task=vlm", "data.max_length=256",
                 *extra])


def _thumbnails(page: str) -> list[tuple[str, tuple[int, int]]]:
    from PIL import Image

    found = re.findall(r'<img class="plot" alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', page)
    return [(alt, Image.open(io.BytesIO(base64.b64decode(b64))).size) for alt, b64 in found]


def test_the_html_page_shows_thumbnails_sizes_tokens_and_escaped_text(vlm_dir, data, tmp_path, capsys):
    html = tmp_path / "out" / "preview.html"
    capsys.readouterr()
    assert _preview(vlm_dir, data, "--json", "--html", str(html)) == 0
    pv = json.loads(capsys.readouterr().out)
    assert "thumbnail_png" not in json.dumps(pv)  # the bytes are for the page only
    page = html.read_text()
    assert not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page  # one self-contained file
    # the 300x200 image: resized by Qwen's processor within the tiny model's max_pixels, to whole 28-pixel merged
    # patches (112x84: 4x3 tokens)
    wide = pv["examples"][0]["images"][0]
    assert (wide["size"], wide["processed_size"], wide["grid_thw"], wide["tokens"]) == \
        ([300, 200], [112, 84], [1, 6, 8], 12)
    start, end = wide["positions"]
    assert _thumbnails(page) == [("image 1", (160, 107)), ("image 1", (56, 56)), ("image 2", (160, 107))]
    row = (f"<td>image 1</td><td>{_img(page, 0)}</td><td>{data.parent / 'images' / 'wide.png'}</td><td>300x200</td>"
           f"<td>112x84</td><td>1, 6, 8</td><td class=\"num\">12</td><td>{start}-{end - 1}</td>")
    assert row in page
    # one labelled block per image, never the hundreds of placeholders; the trained answer highlighted, escaped
    assert page.count('<span class="prompt special">&lt;image 1: 12 tokens&gt;</span>') == 1
    assert '<span class="prompt special">&lt;image 1: 4 tokens&gt;</span>' in page
    assert '<span class="prompt special">&lt;image 2: 12 tokens&gt;</span>' in page
    assert "&lt;|image_pad|&gt;" not in page and "<b>this</b>" not in page
    assert "Is &lt;b&gt;this&lt;/b&gt; &amp; that red?" in page
    assert '<span class="trained">yes &lt;i&gt;</span><span class="trained special">&lt;|im_end|&gt;</span>' in page
    assert "<td>image tokens</td><td>28 (never trained)</td>" in page
    assert pv["image_tokens"] == 12 + 4 + 12 and pv["examples"][1]["text"].count("<image ") == 2


def _img(page: str, k: int) -> str:
    return re.findall(r'<img class="plot"[^>]*>', page)[k]


def test_the_terminal_preview_says_the_processed_size(vlm_dir, data, capsys):
    capsys.readouterr()
    assert _preview(vlm_dir, data, "-n", "1") == 0
    out = capsys.readouterr().out
    assert "300x200 pixels (resized to 112x84) -> grid [1, 6, 8], 12 tokens at positions" in out
    assert "<image 1: 12 tokens>" in out and "[yes <i><|im_end|>\n]" in out


def test_a_bad_image_is_the_usual_error_naming_its_row_and_no_page_is_written(vlm_dir, data, tmp_path, capsys):
    (data.parent / "images" / "blue.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    html = tmp_path / "preview.html"
    capsys.readouterr()
    assert _preview(vlm_dir, data, "--html", str(html)) == 2
    err = capsys.readouterr().err
    assert f"{data}:2, image 1:" in err and "blue.png" in err and "Traceback" not in err
    assert not html.exists()


def test_the_page_loads_in_a_real_browser_with_every_thumbnail_decoded(vlm_dir, data, tmp_path):
    from tests.test_report import _browser, _load_in_browser

    if _browser() is None:
        pytest.skip("no headless browser: apt-get install chromium (see README)")
    html = tmp_path / "preview.html"
    assert _preview(vlm_dir, data, "--html", str(html)) == 0
    dom, log = _load_in_browser(_browser(), html, tmp_path / "shot.png")
    assert 'data-loaded="3/3"' in dom, dom[-500:]
    assert [line for line in log.splitlines() if ":CONSOLE" in line] == []
