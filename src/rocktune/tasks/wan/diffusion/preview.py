"""``rocktune data preview -c CONFIG`` for video-lora / image-lora: what training would read, before it reads it.

The same listing, probing and bucket assignment the run does (so the same errors, all at once, naming each file),
then how many files went to each bucket and what each file trains on. Nothing is encoded or written.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from rocktune.config import RunConfig
from rocktune.tasks.wan.diffusion import components, media


def run_media_preview(cfg: RunConfig, n_show: int, as_json: bool, html: str | None = None) -> int:
    diff = cfg.diffusion
    layout = components.read_layout(cfg.model.name_or_path, diff.expert)
    frames = [1] if cfg.task == "image-lora" else diff.frames
    media.check_buckets(diff.resolutions, frames, layout.spatial_multiple, layout.temporal, cfg.task)
    assert cfg.data.train_file is not None  # the config requires it
    sources: dict[str, str] = {"train": cfg.data.train_file,
                               **({"eval": cfg.data.eval_file} if cfg.data.eval_file else {})}
    found = {name: media.assign_buckets(media.list_items(src, diff.media_field, diff.caption_field),
                                        diff.resolutions, frames, cfg.task) for name, src in sources.items()}
    doc: dict[str, Any] = {name: {"source": sources[name], "files": len(pairs),
                  "videos": sum(media.is_video(m.path) for m, _ in pairs),
                  "buckets": dict(Counter(str(b) for _, b in pairs)),
                  "shown": [{"file": str(m.path), "bucket": str(b), "caption": m.caption} for m, b in pairs[:n_show]]}
           for name, pairs in found.items()}
    doc["valid"] = {"sides_multiple_of": layout.spatial_multiple, "frames": f"{layout.temporal}k+1"}
    if as_json:
        sys.stdout.write(json.dumps(doc) + "\n")
        return 0
    from rich.console import Console

    out = Console(highlight=False)
    for name in sources:
        part = doc[name]
        out.print(f"[bold]{name}[/]: {part['files']} files ({part['videos']} videos) from {part['source']}, all "
                  "readable and captioned")
        for bucket, count in sorted(part["buckets"].items()):
            out.print(f"  {bucket:>14}  {count} file{'s' if count != 1 else ''}")
        for row in part["shown"]:
            out.print(f"  [dim]{row['file']}[/] -> {row['bucket']}: {row['caption'][:100]}")
    if not cfg.data.eval_file and cfg.data.eval_fraction > 0:
        out.print(f"eval: data.eval_fraction={cfg.data.eval_fraction:g} of the train files is held out when training "
                  "starts (seeded)")
    out.print(f"valid shapes for this checkpoint: sides multiple of {layout.spatial_multiple}, frames "
              f"{layout.temporal}k+1; nothing was encoded (training caches latents on its first run)")
    return 0
