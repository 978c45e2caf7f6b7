"""Peak matrix throughput per device (``peaks.yaml``), for MFU.

Loaded strictly: every figure must be a positive number. PyYAML reads ``989.4e12`` (no exponent sign) as a string,
which once crashed the bench at the end of every GPU run; now such a value is converted, and anything that is not a
number fails here, in CI, instead of after a GPU run.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

DTYPES = ("bf16", "fp16", "fp32")
TORCH_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@lru_cache(maxsize=1)
def load_peaks(path: str | None = None) -> tuple[dict, ...]:
    rows = yaml.safe_load(Path(path or Path(__file__).parent / "peaks.yaml").read_text())
    out = []
    for row in rows:
        clean = {"match": str(row["match"]), "source": row.get("source")}
        for dtype in DTYPES:
            if dtype in row:
                value = float(row[dtype])  # raises on anything that is not a number
                if value <= 0:
                    raise ValueError(f"peaks.yaml: {row['match']} {dtype} must be positive, not {value}")
                clean[dtype] = value
        out.append(clean)
    return tuple(out)


def peak_flops(device_name: str | None, dtype: str, peaks: tuple[dict, ...] | None = None) -> float | None:
    """FLOP/s of the first table row whose ``match`` is in the device name; None when unknown (no MFU)."""
    if not device_name:
        return None
    key = TORCH_DTYPE.get(dtype, dtype)
    return next((p.get(key) for p in peaks or load_peaks() if p["match"] in device_name), None)
