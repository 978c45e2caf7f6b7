"""How close packed vision-language rows on varlen attention come to SDPA, per family, on the CPU (JSON).

The batch, model and stand-in kernel of tests/test_vlm_varlen.py (``reference_varlen`` registered in place of
torch's CUDA/ROCm-only kernel): the worst relative loss difference and the worst adapter-gradient difference (over
tensors, relative to each tensor's largest entry) of varlen against the same packed batch on SDPA and against the
conversations one per row; for Qwen2.5-VL also the loss difference when the bounds are one whole row (the mutant
the test proves fails). The figures in docs/vision.md's Packing section:

    PYTHONPATH=src:. OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=default python benchmarks/vlm_varlen_equality.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
from rocktune.tasks.vlm import loss as vlm_loss
from tests.test_vlm_packing import _loss_and_grads, _model
from tests.test_vlm_train import FAMILIES
from tests.test_vlm_varlen import _batches, _varlen_twin


def _gap(got, want) -> dict:
    worst = max(float((got[2][n] - want[2][n]).abs().max() / want[2][n].abs().max()) for n in want[2])
    return {"loss_rel": abs(got[0] - want[0]) / abs(want[0]), "grad_rel": worst}


def _whole_rows(packed: dict):
    rows, width = packed["input_ids"].shape
    return lambda text: (torch.arange(0, rows * width + 1, width, dtype=torch.int32), width)


def family(name: str, folder: Path) -> dict:
    vlm_dir = build_tiny_vlm(folder / name, family=name)
    _, one_per_row, packed = _batches(vlm_dir)
    sdpa = _model(vlm_dir)
    rows, sdpa_packed = _loss_and_grads(sdpa, one_per_row), _loss_and_grads(sdpa, packed)
    varlen = _varlen_twin(sdpa, vlm_dir)
    got = _loss_and_grads(varlen, packed, varlen=True)
    out = {"vs_sdpa_packed": _gap(got, sdpa_packed), "vs_one_per_row": _gap(got, rows)}
    if name == "qwen2_5_vl":
        right = vlm_loss.document_bounds
        vlm_loss.document_bounds = _whole_rows(packed)
        try:
            out["whole_row_bounds_loss_rel"] = _gap(_loss_and_grads(varlen, packed, varlen=True), sdpa_packed)[
                "loss_rel"]
        finally:
            vlm_loss.document_bounds = right
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = {"device": "cpu", "kernel": "reference_varlen", "torch": torch.__version__,
                  "families": {name: family(name, Path(tmp)) for name in FAMILIES}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
