"""Videos and images with captions, listed from a folder or a JSONL manifest, put in buckets and decoded to pixels.

Problems are collected over the whole dataset and raised as one UserError, so a user fixes every file in one pass
instead of one per run. PyAV decodes video (it honours the container's rotation), Pillow reads images (EXIF
orientation) and resizes with LANCZOS.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

from rocktune.tasks.wan.diffusion.buckets import (
    Bucket,
    check_buckets,
    degenerate,
    frame_buckets,
    frames_for,
    nearest_resolution,
)
from rocktune.errors import UserError
from rocktune.readers.json_file import JsonProblem, parse_json

if TYPE_CHECKING:
    import torch
    from PIL import Image

__all__ = ["IMAGE_SUFFIXES", "VIDEO_SUFFIXES", "Bucket", "MediaItem", "assign_buckets", "check_buckets",
           "list_items", "load_pixels", "media_fingerprint"]

# .gif counts as video: PyAV decodes its frames like any clip's, and a 1-frame GIF still fits a frame bucket of 1.
VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v", ".gif"})
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
MAX_LISTED = 20
# Bumped when decoding or resizing changes, so latents cached by older code are not reused.
FINGERPRINT_VERSION = "media-v1"


@dataclass(frozen=True)
class MediaItem:
    path: Path  # absolute
    caption: str
    where: str  # where it was listed, for errors: "manifest.jsonl:7", or the file path itself


class _Bad(Exception):
    """One file's problem, collected with the others before anything is raised."""


def _raise_all(problems: list[str], header: str, fix: str) -> None:
    shown = problems[:MAX_LISTED]
    more = [f"and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else []
    raise UserError(f"{header}:\n" + "\n".join(f"  - {p}" for p in shown + more) + f"\n{fix}")


def _supported() -> str:
    return f"videos {' '.join(sorted(VIDEO_SUFFIXES))}; images {' '.join(sorted(IMAGE_SUFFIXES))}"


def list_items(source: str | Path, media_field: str = "path", caption_field: str = "caption") -> list[MediaItem]:
    """Every media file of a folder (recursive, sorted by relative path, caption in the .txt of the same stem beside
    it) or of a .jsonl manifest (one object per line, media path relative to the manifest's folder or absolute)."""
    source = Path(source)
    if source.is_dir():
        items, problems = _from_folder(source)
    elif source.is_file() and source.suffix.lower() == ".jsonl":
        items, problems = _from_manifest(source, media_field, caption_field)
    else:
        state = "is neither a folder nor a .jsonl file" if source.exists() else "does not exist"
        raise UserError(f"data.train_file {source} {state}; point it at a folder of videos/images with a .txt caption "
                        "beside each, or at a JSONL manifest.")
    if problems:
        _raise_all(problems, f"data.train_file {source}: {len(problems)} problem(s) with the listed media",
                   "Fix or remove these entries and run again.")
    if not items:
        raise UserError(f"data.train_file {source} lists no media files ({_supported()}); add clips or images with "
                        "captions.")
    return items


def _from_folder(folder: Path) -> tuple[list[MediaItem], list[str]]:
    folder = Path(os.path.abspath(folder))
    # Hidden entries are skipped: macOS writes ._clip.mp4 resource forks that look like media and are not.
    files = sorted((p for p in folder.rglob("*") if p.is_file() and not _hidden(p, folder)),
                   key=lambda p: p.relative_to(folder).as_posix())
    items, problems = [], []
    for path in files:
        suffix = path.suffix.lower()
        if suffix not in VIDEO_SUFFIXES | IMAGE_SUFFIXES:
            # A file with a caption was meant as training data: say why it is left out rather than drop it quietly.
            if suffix != ".txt" and path.with_suffix(".txt").is_file():
                problems.append(f"{path}: has a caption but {suffix or 'no suffix'} is not supported ({_supported()})")
            continue
        try:
            items.append(MediaItem(path, _read_caption(path.with_suffix(".txt")), str(path)))
        except _Bad as exc:
            problems.append(f"{path}: {exc}")
    return items, problems


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _read_caption(txt: Path) -> str:
    try:
        caption = txt.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise _Bad(f"no caption: write it to {txt.name} beside the file") from None
    except UnicodeDecodeError:
        raise _Bad(f"caption {txt.name} is not UTF-8 text") from None
    if not caption:
        raise _Bad(f"caption {txt.name} is empty")
    return caption


def _from_manifest(manifest: Path, media_field: str, caption_field: str) -> tuple[list[MediaItem], list[str]]:
    try:
        lines = manifest.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise UserError(f"{manifest} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8.") from None
    base = Path(os.path.abspath(manifest.parent))
    items, problems = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{manifest}:{number}"
        try:
            items.append(_manifest_item(parse_json(line), base, where, (media_field, caption_field)))
        except JsonProblem as exc:
            problems.append(f"{where}: {str(exc).replace('malformed JSON', 'not valid JSON', 1)}")
        except _Bad as exc:
            problems.append(f"{where}: {exc}")
    return items, problems


def _manifest_item(row: object, base: Path, where: str, fields: tuple[str, str]) -> MediaItem:
    media_field, caption_field = fields
    if not isinstance(row, dict):
        raise _Bad(f"expected a JSON object, got {type(row).__name__}")
    media, caption = row.get(media_field), row.get(caption_field)
    if not isinstance(media, str) or not media.strip():
        raise _Bad(f"no '{media_field}' field with the media file's path (diffusion.media_field)")
    if not isinstance(caption, str):
        raise _Bad(f"no '{caption_field}' field with a text caption (diffusion.caption_field)")
    if not caption.strip():
        raise _Bad(f"the caption of {media} is empty")
    path = Path(os.path.abspath(base / media))
    if path.suffix.lower() not in VIDEO_SUFFIXES | IMAGE_SUFFIXES:
        raise _Bad(f"{media}: suffix {path.suffix or '(none)'} is not supported ({_supported()})")
    if not path.is_file():
        raise _Bad(f"{media} not found (looked for {path})")
    return MediaItem(path, caption.strip(), where)


def is_video(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES


def _reason(exc: Exception) -> str:
    """FFmpeg's and the OS's own words without the path, which the message already names."""
    return getattr(exc, "strerror", None) or str(exc)


def _named(item: MediaItem) -> str:
    return item.where if item.where == str(item.path) else f"{item.where} ({item.path.name})"


def assign_buckets(items: Sequence[MediaItem], resolutions: Sequence[Sequence[int]], frames: Sequence[int],
                   task: str) -> list[tuple[MediaItem, Bucket]]:
    """Each item with its bucket: the resolution nearest its aspect ratio and, for a clip, the largest frame count
    it fills from its first frames. Images are single frames: in video-lora they need 1 in diffusion.frames; in
    image-lora (frames treated as [1]) a video is reported, not cut to one frame."""
    buckets = frame_buckets(frames, task)
    assigned, problems = [], []
    for item in items:
        try:
            assigned.append((item, _bucket_for(item, resolutions, buckets, task)))
        except _Bad as exc:
            problems.append(f"{_named(item)}: {exc}")
    if problems:
        _raise_all(problems, f"{len(problems)} media file(s) cannot be used for {task}",
                   "Fix or remove these files (or change diffusion.frames as suggested) and run again.")
    return assigned


def _bucket_for(item: MediaItem, resolutions: Sequence[Sequence[int]], buckets: list[int], task: str) -> Bucket:
    try:
        if item.path.stat().st_size == 0:
            raise _Bad("empty file (0 bytes)")
    except OSError as exc:
        raise _Bad(f"cannot be read ({exc.strerror})") from None
    if is_video(item.path) and task == "image-lora":
        raise _Bad("is a video, and image-lora trains on still images; use task: video-lora, or remove it")
    width, height, available = _probe_video(item.path, buckets[-1]) if is_video(item.path) else _probe_image(item.path)
    count = frames_for(available, buckets)
    if count is None and not is_video(item.path):
        raise _Bad("is an image but diffusion.frames has no 1-frame bucket; add 1 to diffusion.frames to train on "
                   "images beside clips, or remove it")
    if count is None:
        raise _Bad(f"has {available} frame(s), fewer than the smallest frame bucket ({buckets[0]}); add a smaller "
                   "count to diffusion.frames, or remove the clip")
    if min(width, height) < 1:  # a decoder's oddity; the aspect ratio below would divide by it
        raise _Bad(f"is {width}x{height} pixels, which holds no picture")
    bucket = Bucket(*nearest_resolution(width, height, resolutions), count)
    problem = degenerate(width, height, bucket)
    if problem:
        raise _Bad(problem)
    return bucket


def _probe_video(path: Path, enough: int) -> tuple[int, int, int]:
    """Width and height as displayed, and the frame count, counted by decoding up to ``enough`` frames: a
    container's own count is not trusted (a truncated file keeps its header's count), so a clip whose frames do not
    decode is reported here with the others, not midway through encoding."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise _Bad("has no video stream")
            stream = container.streams.video[0]
            first = next(container.decode(stream), None)
            if first is None:
                raise _Bad("has no decodable frames")
            turned = _rotation(first) % 180 == 90
            width, height = (first.height, first.width) if turned else (first.width, first.height)
            frames = 1 + sum(1 for _ in islice(container.decode(stream), enough - 1))
    except av.error.FFmpegError as exc:
        raise _Bad(f"cannot be decoded as video ({_reason(exc)})") from None
    return width, height, frames


def _rotation(frame) -> int:
    """Counter-clockwise degrees from the container; PyAV releases before 14 do not expose it (then 0)."""
    return int(getattr(frame, "rotation", 0) or 0)


def _probe_image(path: Path) -> tuple[int, int, int]:
    """Width and height as displayed (EXIF orientations 5-8 swap them); the pixels are decoded too, so a truncated
    file is reported here with the others."""
    from PIL import ExifTags, Image

    try:
        with Image.open(path) as image:
            image.load()
            width, height = image.size
            if image.getexif().get(ExifTags.Base.Orientation) in (5, 6, 7, 8):
                width, height = height, width
    except (OSError, Image.DecompressionBombError) as exc:
        raise _Bad(f"cannot be read as an image ({_reason(exc)})") from None
    return width, height, 1


def load_pixels(item: MediaItem, bucket: Bucket) -> torch.Tensor:
    """float32 [3, frames, height, width] in [-1, 1]: the first ``bucket.frames`` frames, each resized (LANCZOS,
    aspect kept) to cover the bucket and centre-cropped."""
    import av
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    try:
        images = _decode_video(item.path, bucket.frames) if is_video(item.path) else [_open_image(item.path)]
    except (av.error.FFmpegError, OSError, Image.DecompressionBombError) as exc:
        raise UserError(f"{_named(item)} cannot be decoded ({_reason(exc)}); fix or remove the file.") from None
    if len(images) < bucket.frames:
        raise UserError(f"{_named(item)} has only {len(images)} decodable frame(s) but its bucket {bucket} needs "
                        f"{bucket.frames}; re-encode or remove the file.")
    size = (bucket.width, bucket.height)
    frames = np.stack([np.asarray(ImageOps.fit(img, size, Image.Resampling.LANCZOS)) for img in images])
    return (torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 127.5 - 1.0).contiguous()


def _decode_video(path: Path, count: int) -> list[Image.Image]:
    import av
    from PIL import Image

    # PyAV's rotation is counter-clockwise degrees, as PIL's ROTATE_* transposes are.
    turns = {90: Image.Transpose.ROTATE_90, -90: Image.Transpose.ROTATE_270, 180: Image.Transpose.ROTATE_180,
             -180: Image.Transpose.ROTATE_180}
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        images = []
        for frame in islice(container.decode(stream), count):
            image = frame.to_image()
            images.append(image.transpose(turns[_rotation(frame)]) if _rotation(frame) in turns else image)
    return images


def _open_image(path: Path) -> Image.Image:
    from PIL import Image, ImageOps

    with Image.open(path) as image:
        return ImageOps.exif_transpose(image).convert("RGB")


def media_fingerprint(items_with_buckets: Iterable[tuple[MediaItem, Bucket]]) -> str:
    """Hex digest over each file's path, size, mtime, caption and bucket, in order: a latent cache keyed on it is
    rebuilt when any file, caption or bucket changes."""
    digest = hashlib.sha256(FINGERPRINT_VERSION.encode())
    for item, bucket in items_with_buckets:
        try:
            stat = item.path.stat()
        except OSError as exc:
            raise UserError(f"{_named(item)} cannot be read ({exc.strerror}); restore or remove it.") from None
        row = [str(item.path), stat.st_size, stat.st_mtime_ns, item.caption, str(bucket)]
        digest.update(json.dumps(row).encode() + b"\n")
    return digest.hexdigest()
