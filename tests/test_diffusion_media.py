"""The Wan media layer: listing (folder, JSONL), problems reported together, buckets, decoding to pixels."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rocktune.tasks.wan.diffusion.buckets import check_buckets
from rocktune.tasks.wan.diffusion.media import (
    Bucket,
    MediaItem,
    assign_buckets,
    list_items,
    load_pixels,
    media_fingerprint,
)
from rocktune.tasks.wan.diffusion.tiny import write_clips
from rocktune.errors import UserError

# PyAV (video decoding) is optional, and absent on the GPU test machine: skip this module there, never fail collection
av = pytest.importorskip("av")

SQUARE, WIDE, TALL = (32, 32), (64, 32), (32, 64)
RESOLUTIONS = [SQUARE, WIDE, TALL]


def clip(folder: Path, size=(32, 32), frames=9, caption="a clip") -> Path:
    return write_clips(folder, [caption], size=size, frames=frames)[0]


def image(path: Path, colour=(255, 0, 0), size=(32, 32), caption: str | None = "an image") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def item(path: Path) -> MediaItem:
    return MediaItem(path, "caption", str(path))


def error_of(fn, *args) -> str:
    with pytest.raises(UserError) as info:
        fn(*args)
    return str(info.value)


def test_folder_lists_recursively_in_order_with_captions(tmp_path):
    write_clips(tmp_path / "b", ["  second clip\n", "third clip"])
    image(tmp_path / "a" / "still.png", caption="a still")
    (tmp_path / "README.md").write_text("not media, no caption: ignored")
    (tmp_path / "b" / "._clip_000.mp4").write_bytes(b"macOS resource fork")
    items = list_items(tmp_path)
    assert [p.path.relative_to(tmp_path).as_posix() for p in items] == ["a/still.png", "b/clip_000.mp4",
                                                                       "b/clip_001.mp4"]
    assert [p.caption for p in items] == ["a still", "second clip", "third clip"]
    assert all(p.path.is_absolute() and p.where == str(p.path) for p in items)


def test_manifest_paths_relative_to_its_folder_or_absolute(tmp_path):
    first = clip(tmp_path / "clips")
    still = image(tmp_path / "elsewhere" / "x.jpg", caption=None)
    manifest = tmp_path / "data" / "train.jsonl"
    manifest.parent.mkdir()
    rows = [{"file": "../clips/clip_000.mp4", "text": " a cat "}, {"file": str(still), "text": "a still"}]
    manifest.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    items = list_items(manifest, media_field="file", caption_field="text")
    assert [(p.path, p.caption, p.where) for p in items] == [(first, "a cat", f"{manifest}:1"),
                                                            (still, "a still", f"{manifest}:3")]


def test_folder_problems_reported_together(tmp_path):
    paths = write_clips(tmp_path, ["ok", "gone", "blank"])
    paths[1].with_suffix(".txt").unlink()
    paths[2].with_suffix(".txt").write_text("  \n")
    (tmp_path / "old.mpg").write_bytes(b"x")
    (tmp_path / "old.txt").write_text("meant as data")
    message = error_of(list_items, tmp_path)
    assert "3 problem(s)" in message
    assert f"{paths[1]}: no caption: write it to clip_001.txt" in message
    assert f"{paths[2]}: caption clip_002.txt is empty" in message
    assert "old.mpg: has a caption but .mpg is not supported" in message
    assert str(paths[0]) not in message


def test_manifest_problems_name_their_lines(tmp_path):
    clip(tmp_path)
    manifest = tmp_path / "m.jsonl"
    lines = [
        '{"path": "clip_000.mp4", "caption": "fine"}',
        '{"path": "clip_000.mp4", "caption": ',
        '{"path": "missing.mp4", "caption": "x"}',
        '{"path": "clip_000.mp4"}',
        '{"path": "clip_000.mp4", "caption": ""}',
        '{"path": "notes.doc", "caption": "x"}',
        '["path"]',
    ]
    manifest.write_text("\n".join(lines))
    message = error_of(list_items, manifest)
    assert "6 problem(s)" in message
    assert f"{manifest}:2: not valid JSON" in message
    assert f"{manifest}:3: missing.mp4 not found" in message
    assert f"{manifest}:4: no 'caption' field" in message and "diffusion.caption_field" in message
    assert f"{manifest}:5: the caption of clip_000.mp4 is empty" in message
    assert f"{manifest}:6: notes.doc: suffix .doc is not supported" in message
    assert f"{manifest}:7: expected a JSON object, got list" in message
    assert f"{manifest}:1" not in message


def test_long_problem_lists_are_capped(tmp_path):
    for i in range(25):
        (tmp_path / f"c{i:02d}.png").write_bytes(b"")
    message = error_of(list_items, tmp_path)
    assert message.count("no caption") == 20 and "and 5 more" in message


def test_empty_or_missing_source(tmp_path):
    assert "lists no media files" in error_of(list_items, tmp_path)
    assert "does not exist" in error_of(list_items, tmp_path / "nope")
    (tmp_path / "data.csv").write_text("a,b")
    assert "neither a folder nor a .jsonl file" in error_of(list_items, tmp_path / "data.csv")


def test_unusable_files_named_with_reason(tmp_path):
    good = clip(tmp_path / "good")
    short = clip(tmp_path / "short", frames=5)
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    still = image(tmp_path / "still.png")
    items = [item(p) for p in (good, short, corrupt, empty, still)]
    message = error_of(assign_buckets, items, RESOLUTIONS, [9], "video-lora")
    assert "4 media file(s) cannot be used for video-lora" in message
    assert f"{short}: has 5 frame(s), fewer than the smallest frame bucket (9)" in message
    assert f"{corrupt}: cannot be decoded as video (Invalid data" in message
    assert f"{empty}: empty file (0 bytes)" in message
    assert f"{still}: is an image but diffusion.frames has no 1-frame bucket; add 1 to diffusion.frames" in message
    assert f"{good}:" not in message


def test_image_lora_reports_videos_and_takes_images_as_one_frame(tmp_path):
    still = image(tmp_path / "still.png", size=(64, 32))
    video = clip(tmp_path)
    assert "is a video, and image-lora trains on still images" in error_of(
        assign_buckets, [item(still), item(video)], RESOLUTIONS, [33], "image-lora")
    assert assign_buckets([item(still)], RESOLUTIONS, [33], "image-lora") == [(item(still), Bucket(64, 32, 1))]


def test_bucket_nearest_aspect_and_largest_frame_count(tmp_path):
    paths = [clip(tmp_path / "wide", size=WIDE), clip(tmp_path / "tall", size=TALL),
             clip(tmp_path / "long", frames=17), clip(tmp_path / "mid", frames=12),
             image(tmp_path / "img.png", size=(40, 36))]
    buckets = [b for _, b in assign_buckets([item(p) for p in paths], RESOLUTIONS, [17, 1, 9], "video-lora")]
    assert buckets == [Bucket(64, 32, 9), Bucket(32, 64, 9), Bucket(32, 32, 17), Bucket(32, 32, 9),
                       Bucket(32, 32, 1)]
    assert str(buckets[0]) == "64x32x9"


def test_frame_count_is_counted_when_the_container_does_not_say(tmp_path):
    path = tmp_path / "clip.mkv"
    write_frames(path, [np.zeros((32, 32, 3), np.uint8)] * 13)
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0  # Matroska keeps no count: the probe must decode
    assert assign_buckets([item(path)], RESOLUTIONS, [9, 17], "video-lora")[0][1] == Bucket(32, 32, 9)
    assert "has 13 frame(s)" in error_of(assign_buckets, [item(path)], RESOLUTIONS, [17], "video-lora")


def write_frames(path: Path, frames: list[np.ndarray], rotation: int = 0) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        if rotation:
            stream.set_display_rotation(rotation)
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def test_load_pixels_shape_range_and_content(tmp_path):
    path = clip(tmp_path, size=WIDE, frames=12)
    pixels = load_pixels(item(path), Bucket(32, 32, 9))
    assert pixels.shape == (3, 9, 32, 32) and pixels.dtype.is_floating_point
    assert pixels.min() >= -1 and pixels.max() <= 1 and pixels.std() > 0.1
    assert not (pixels[:, 0] == pixels[:, 8]).all()  # the square moves: frames differ


def test_solid_colour_and_centre_crop(tmp_path):
    # Blue left quarter, red middle half, green right quarter: a 64x32 image cropped to 32x32 keeps only red.
    array = np.zeros((32, 64, 3), np.uint8)
    array[:, :16, 2] = 255
    array[:, 16:48, 0] = 255
    array[:, 48:, 1] = 255
    path = tmp_path / "flag.png"
    Image.fromarray(array).save(path)
    pixels = load_pixels(item(path), Bucket(32, 32, 1))
    assert pixels.shape == (3, 1, 32, 32)
    assert pixels[0].min() > 0.98 and pixels[1:].max() < -0.98
    wide = load_pixels(item(path), Bucket(64, 32, 1))
    assert wide[2, 0, :, :8].mean() > 0.98 and wide[1, 0, :, -8:].mean() > 0.98


def test_rotated_clip_is_probed_and_decoded_upright(tmp_path):
    frame = np.zeros((32, 64, 3), np.uint8)
    frame[:, :32, 0] = 255  # red on the left of the stored frame
    path = write_frames(tmp_path / "phone.mp4", [frame] * 9, rotation=90)
    (bucket,) = [b for _, b in assign_buckets([item(path)], RESOLUTIONS, [9], "video-lora")]
    assert bucket == Bucket(32, 64, 9)
    pixels = load_pixels(item(path), bucket)
    # Turned 90 degrees counter-clockwise, the stored left side is displayed at the bottom.
    assert pixels[0, :, 40:].mean() > 0.9 and pixels[0, :, :24].mean() < -0.9


def test_load_pixels_reports_the_file(tmp_path):
    path = clip(tmp_path, frames=9)
    assert f"{path} has only 9 decodable frame(s) but its bucket 32x32x17 needs 17" in error_of(
        load_pixels, item(path), Bucket(32, 32, 17))
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00" * 100)
    assert f"{bad} cannot be decoded" in error_of(load_pixels, item(bad), Bucket(32, 32, 9))


def test_fingerprint_follows_files_captions_and_buckets(tmp_path):
    path = clip(tmp_path)
    pairs = [(item(path), Bucket(32, 32, 9))]
    base = media_fingerprint(pairs)
    assert base == media_fingerprint(list(pairs)) and len(base) == 64
    assert media_fingerprint([(MediaItem(path, "other", str(path)), Bucket(32, 32, 9))]) != base
    assert media_fingerprint([(item(path), Bucket(32, 32, 5))]) != base
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert media_fingerprint(pairs) != base


def test_check_buckets_names_the_key_and_nearest_values():
    check_buckets([(832, 480), (480, 832)], [1, 33, 81], 16, 4, "video-lora")
    message = error_of(check_buckets, [(30, 32), (64, 64)], [9, 8], 16, 4, "video-lora")
    assert "diffusion.resolutions: 30x32" in message and "nearest valid size is 32x32" in message
    assert "diffusion.frames: 8 is not 4k+1" in message and "use 5 or 9" in message
    assert "64x64" not in message and "9 is not" not in message
    assert "848x480" in error_of(check_buckets, [(848, 480)], [33], 32, 4, "video-lora")  # Wan 2.2 TI2V: x32
    check_buckets([(32, 32)], [8], 16, 4, "image-lora")  # image-lora treats frames as [1]
    assert "diffusion.frames is empty" in error_of(check_buckets, [(32, 32)], [], 16, 4, "video-lora")
