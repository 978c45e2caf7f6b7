"""The token cache of vision-language data: a second start (or a resume) reads the encoded conversations back
instead of opening, verifying and processing every image again.

An entry (data/cache.py's format: flat int32 ``input_ids`` and ``labels`` with their offsets) holds each
conversation's tokens and labels; its meta holds each image's grid and whether the conversation was cut. Pixels are
never stored, nor the images' references: those are resolved again from the rows (cheap: no image is opened), so
an image embedded in the data is read from the data as before.

The key covers what determines the tokens: the data (a file's bytes, or the rows themselves for a folder or a hub
id), the tokenizer and its chat template, the image processor's whole configuration (the pixel limits included),
the vision token ids, ``data.max_length``, and every image file's path, size and modification time, so a changed
image or setting is a new key and is encoded again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from rocktune.data import cache
from rocktune.tasks.vlm.data.images import ImageRef
from rocktune.tasks.vlm.data.vision import VisionExample

RECORDS = "vlm-v2"  # bump when the encoding of a conversation changes (v2: image_tokens kept)


def key(data_id: str | Path, rows: list, refs: list[list[ImageRef]], tokenizer, vision, d) -> str:
    """``data_id``: the source as configured (a file's bytes are hashed; otherwise the ``rows`` are)."""
    if not Path(data_id).is_file():
        data_id = _rows_digest(rows)
    processor = vision.image_processor
    processor_config = processor.to_json_string() if hasattr(processor, "to_json_string") else repr(processor)
    return cache.fingerprint(data_id, cache.tokenizer_fingerprint(tokenizer), records=RECORDS,
                             image_processor=processor_config, image_token_id=vision.image_token_id,
                             masked_ids=sorted(vision.masked_ids), rule=repr(vision.rule),
                             max_length=d.max_length, min_pixels=d.min_pixels, max_pixels=d.max_pixels,
                             columns=sorted(d.columns.items()),  # a file's rows renamed otherwise
                             images=_stamps(refs))


def _rows_digest(rows: list) -> str:
    h = hashlib.blake2b(digest_size=16)
    for loc, rec in rows:
        h.update(repr((str(loc), rec)).encode())
    return f"rows:{h.hexdigest()}"


def _stamps(refs: list[list[ImageRef]]) -> str:
    """Every image file's path, size and modification time, hashed (embedded images are in the data's identity)."""
    h = hashlib.blake2b(digest_size=16)
    for row in refs:
        for ref in row:
            if ref.path is not None:
                try:
                    st = ref.path.stat()
                    h.update(f"{ref.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
                except OSError:  # missing: encoding says so, naming the row
                    h.update(f"{ref.path}\0missing\n".encode())
            else:
                h.update(b"embedded\n")
    return h.hexdigest()


def load(cache_dir: Path, k: str, refs: list[list[ImageRef]]) -> list[VisionExample] | None:
    """The cached conversations with their images' references, or None (no entry, or one that does not fit)."""
    hit = cache.load(cache_dir, k)
    if hit is None:
        return None
    arrays, meta = hit
    if meta.get("records") != RECORDS:
        return None
    # stage() writes these beside "records": an entry of this RECORDS has them
    grids: list[list[list[int]]] = meta["grids"]
    cut: list[bool] = meta["truncated"]
    counts: list[int] = meta["image_tokens"]
    if len(grids) != len(refs) or any(len(g) != len(r) for g, r in zip(grids, refs)):
        return None
    ids, labels, offsets = arrays["input_ids"], arrays["labels"], arrays["offsets"]
    return [VisionExample(ids[a:b].tolist(), labels[a:b].tolist(), tuple(r), tuple(tuple(x) for x in g), c, n)
            for a, b, r, g, c, n in zip(offsets[:-1].tolist(), offsets[1:].tolist(), refs, grids, cut, counts)]


def stage(cache_dir: Path, k: str, examples: list[VisionExample]) -> tuple[cache.Entry, dict]:
    """The entry written under a temporary name, with its meta: ``(entry, meta)`` for ``Pending.entries``, committed
    once every source of the run was read."""
    from rocktune.data.tokens import from_lists

    flat_ids, offsets = from_lists([e.input_ids for e in examples])
    flat_labels, _ = from_lists([e.labels for e in examples])
    entry = cache.Entry(cache_dir, k)
    for name, arr in (("input_ids", flat_ids), ("labels", flat_labels), ("offsets", offsets)):
        entry.write(name, len(arr), arr.dtype, [arr])
    meta = {"records": RECORDS, "n": len(examples), "grids": [[list(g) for g in e.grids] for e in examples],
            "truncated": [e.truncated for e in examples], "image_tokens": [e.image_tokens for e in examples]}
    return entry, meta
