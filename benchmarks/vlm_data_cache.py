"""How long task=vlm's data takes to read at a first start (every image opened, verified and processed, the token
cache written) and at a second start (the token cache read back), on random-noise photos and the tiny Qwen2.5-VL's
image processor (tasks/vlm/demo/tiny_vlm.py). Prints one JSON object.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/vlm_data_cache.py --images 40 --max-pixels 401408
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def _photos(folder: Path, n: int, size: tuple[int, int]) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    (folder / "images").mkdir(parents=True)
    rows = []
    for i in range(n):
        noise = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(noise).save(folder / "images" / f"{i}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": f"images/{i}.png"},
                                                               {"type": "text", "text": "What is in the picture?"}]},
                                  {"role": "assistant", "content": "noise"}]})
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def _read_once(model: Path, cfg, cache_dir: Path) -> tuple[float, list]:
    from transformers import AutoConfig

    from rocktune.data.dataset import Pending
    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm import task
    from rocktune.tasks.vlm.vision.model import vision_tokens, with_processor_template

    d = cfg.data
    tokenizer = with_processor_template(load_tokenizer(str(model), False), str(model))
    vision = vision_tokens(str(model), AutoConfig.from_pretrained(model), tokenizer, d.min_pixels, d.max_pixels)
    started = time.perf_counter()
    pending = Pending.start(cache_dir)
    train, held = task._read(cfg, tokenizer, vision, cache_dir, pending)
    pending.commit()
    return time.perf_counter() - started, train + held


def main() -> None:
    from rocktune.config import config_from_dict
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=40)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--max-pixels", type=int, default=401408)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_vlm(root / "model")
        data = _photos(root / "data", args.images, (args.width, args.height))
        cfg = config_from_dict({"task": "vlm", "model": {"name_or_path": str(model)},
                                "data": {"train_file": str(data), "eval_fraction": 0.0, "max_length": 4096,
                                         "max_pixels": args.max_pixels},
                                "output": {"dir": str(root / "run")}})
        first, examples = _read_once(model, cfg, root / "cache")
        second, again = _read_once(model, cfg, root / "cache")
    assert again == examples
    print(json.dumps({"images": args.images, "size": [args.width, args.height], "max_pixels": args.max_pixels,
                      "tokens": sum(len(e.input_ids) for e in examples), "first_start_s": round(first, 3),
                      "second_start_s": round(second, 3), "speedup": round(first / second, 1),
                      "omp_threads": os.environ.get("OMP_NUM_THREADS"), "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
