"""The images of vision-language data: where each comes from, and the proof that it opens.

A source is what a record names: a path (relative to the data file, as the ecosystem's datasets write them), a
``file://`` URL, a ``data:image/...;base64,`` URL, or the ``{"bytes": ..., "path": ...}`` dict of a ``datasets``
Image column. ``check`` opens every image once before anything is trained: a missing file, bytes Pillow cannot
read, a truncated file and a decompression bomb (more pixels than ``MAX_PIXELS``) are each a ``UserError`` naming
the row, never a traceback and never a hang on an enormous allocation. ``load`` opens it again, as RGB, when a
batch needs its pixels (images are not kept in memory between steps).
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from rocktune.errors import UserError

# Pillow's own guard (Image.MAX_IMAGE_PIXELS, 89.5 million by default) warns at that size and raises only at twice
# it; here the warning is an error too, so an image past it is refused before it is decoded.
MAX_PIXELS = 89_478_485


@dataclass(frozen=True)
class ImageRef:
    """One image of a record: a file on disk or bytes decoded from the record itself."""

    path: Path | None = None
    data: bytes | None = None
    # for a path the record gave relative: the folder it was read from, as the error of a missing file says it
    relative_to: str | None = field(default=None, compare=False)

    def describe(self) -> str:
        return str(self.path) if self.path is not None else f"an embedded image of {len(self.data or b'')} bytes"


def resolve(source, base: Path, loc: str, base_is: str = "the data file's folder") -> ImageRef:
    """The image a record's value names; ``base`` is the data file's folder (relative paths start there), or what
    ``base_is`` says it is (``generate --image``: the working directory)."""
    if isinstance(source, dict) and ("bytes" in source or "path" in source):  # a datasets Image feature's value
        if source.get("bytes"):
            return ImageRef(data=bytes(source["bytes"]))
        source = source.get("path")
    if not isinstance(source, str) or not source.strip():
        raise UserError(f"{loc}: an image must be a path, a file:// URL or a data:image/...;base64 URL, not "
                        f"{type(source).__name__} {str(source)[:60]!r}.")
    if source.startswith("data:"):
        return ImageRef(data=_base64(source, loc))
    if source.startswith("file://"):
        return ImageRef(path=Path(unquote(urlparse(source).path)))
    if "://" in source:
        raise UserError(f"{loc}: the image {source[:80]!r} is a remote URL; rocktune reads local images only "
                        "(download them and name the files, relative to the data file).")
    path = Path(source).expanduser()
    return ImageRef(path=path) if path.is_absolute() else ImageRef(path=base / path, relative_to=f"{base_is}, {base}")


def _base64(url: str, loc: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise UserError(f"{loc}: the data URL {url[:40]!r}... is not base64 (expected data:image/png;base64,...).")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"{loc}: the data URL's base64 text does not decode ({url[:40]!r}...).") from None


def check(ref: ImageRef, loc: str) -> tuple[int, int]:
    """Open, verify and decode the image once: its (width, height), or a UserError saying what is wrong with it."""
    image = load(ref, loc, verify=True)
    return image.size


def size(ref: ImageRef, loc: str) -> tuple[int, int]:
    """(width, height) from the image's header, nothing decoded (the planner's question; training reads it whole)."""
    from PIL import UnidentifiedImageError

    try:
        with _open(ref) as image:
            return image.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise UserError(f"{loc}: the image {ref.describe()} cannot be read ({type(exc).__name__}: {exc}).") from None


def load(ref: ImageRef, loc: str, verify: bool = False):
    """The image as an RGB Pillow image. ``verify``: Pillow's structural check first (a truncated or corrupt file
    that would otherwise decode into garbage)."""
    from PIL import Image, UnidentifiedImageError

    what = ref.describe()
    if ref.path is not None and not ref.path.is_file():
        where = f" (a relative path is read from {ref.relative_to})" if ref.relative_to else ""
        raise UserError(f"{loc}: the image {what} does not exist{where}.")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            if verify:
                with _open(ref) as image:
                    _bounded(image, what, loc)
                    image.verify()
            with _open(ref) as image:
                _bounded(image, what, loc)
                return image.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise UserError(f"{loc}: the image {what} has more than {MAX_PIXELS:,} pixels (a decompression bomb "
                        "guard); shrink it before training.") from None
    except UnidentifiedImageError:
        raise UserError(f"{loc}: {what} is not an image Pillow can read (damaged, or not an image file).") from None
    except (OSError, SyntaxError, ValueError) as exc:  # Pillow's errors for truncated and corrupt files
        raise UserError(f"{loc}: the image {what} cannot be read ({type(exc).__name__}: {exc}): it is truncated or "
                        "damaged; replace the file.") from None


def _open(ref: ImageRef):
    from PIL import Image

    if ref.path is not None:
        return Image.open(ref.path)
    assert ref.data is not None  # resolve() makes every ImageRef, with a path or with bytes
    return Image.open(io.BytesIO(ref.data))


def _bounded(image, what: str, loc: str) -> None:
    """The header's size, before a pixel is decoded: Pillow's own check applies only to the formats that run it."""
    from PIL import Image

    width, height = image.size
    if width * height > MAX_PIXELS:
        raise Image.DecompressionBombError(f"{width}x{height}")
    if width < 1 or height < 1:
        raise UserError(f"{loc}: the image {what} is empty ({width}x{height} pixels).")
