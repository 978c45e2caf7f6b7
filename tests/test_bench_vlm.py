"""``rocktune bench --suite vlm`` (tasks/vlm/bench/vlm.py, tasks/vlm/bench/hf_vlm.py): task=vlm against the HF Trainer +
PEFT on the same tiny Qwen2.5-VL. The HF side's collator gives the model exactly the inputs rocktune's gives (same
tokens, labels, pixels and grids), and the whole bench reports both rows as JSON with their speed, memory and ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> tuple[Path, Path]:
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task

    root = tmp_path_factory.mktemp("bench-vlm")
    train, _ = write_colour_task(root / "data", n_train=6, n_eval=0, seed=1)
    return build_tiny_vlm(root / "model"), train


def test_the_hf_collator_feeds_the_model_what_rocktune_feeds_it(colours):
    from rocktune.tasks.vlm.bench.hf_vlm import ImageCollator, _Conversations, encoded
    from rocktune.tasks.vlm.data.vision_batch import collate

    model, data = colours
    examples, tokenizer, vision = encoded(str(model), str(data), 128)
    ours = collate(examples[:4], tokenizer.pad_token_id, vision)
    theirs = ImageCollator(vision.image_processor, tokenizer.pad_token_id, vision.image_token_id)(
        [_Conversations(examples)[i] for i in range(4)])
    # mm_token_type_ids: without it the model trains on 1-D positions and answers at chance with its image positions
    assert set(theirs) == {"input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw",
                           "mm_token_type_ids"}
    for key, value in theirs.items():
        assert torch.equal(value, ours[key]), key
    assert int((theirs["labels"][:, 1:] != -100).sum()) > 0


@pytest.mark.long
def test_the_vlm_bench_reports_both_rows_with_speed_memory_and_ratios(tmp_path, capsys):
    from rocktune.cli import main

    assert main(["bench", "--suite", "vlm", "--steps", "3", "--warmup", "1", "--threads", "1", "--device", "cpu",
                 "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    rows = {r["name"]: r for r in report["configs"]}
    assert set(rows) == {"vlm-hf", "vlm-rocktune"}
    for row in rows.values():
        assert row["status"] == "ok", row.get("reason")
        assert len(row["losses"]) == 4 and row["loss_fell"], row["losses"]
        assert row["useful_tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0
    ratios = rows["vlm-rocktune"]["ratios"]["best-hf"]
    assert ratios["against"] == "vlm-hf"
    assert report["vlm"] == {"tokens_per_s_vs_hf": ratios["tokens_per_s"], "memory_vs_hf": ratios["memory"]}
    assert report["workload"]["samples_per_step"] == 8 and report["workload"]["images_per_example"] == 1
