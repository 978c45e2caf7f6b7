"""safetensors files checked before any loader opens them: the header length bounded by the file and by the
library's own limit, then the header parsed by the safetensors library, which checks that the tensors cover the data
exactly (none starts or ends beyond the end of the file). Nothing is read beyond the header, so a file that lies
about its size costs no memory."""

from __future__ import annotations

import struct
from pathlib import Path

from rocktune.errors import UserError, first_line
from rocktune.readers.json_file import JsonProblem, parse_json

# safetensors refuses headers above 100 MB itself; the same bound here lets the message say so before it is opened.
MAX_HEADER = 100_000_000


def check_safetensors(file: Path, fix: str) -> None:
    """Raise a ``UserError`` naming ``file`` (ending in ``fix``) unless its header and sizes are consistent."""
    from safetensors import SafetensorError, safe_open

    file = Path(file)
    size = file.stat().st_size
    if size < 8:
        raise UserError(f"{file} is {size} bytes, too short for a safetensors file (an interrupted copy?); {fix}")
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER:
        raise UserError(f"{file} is not a valid safetensors file: its header claims {n:,} bytes, more than the "
                        f"{MAX_HEADER:,} the format allows (the file holds {size:,}); {fix}")
    if 8 + n > size:
        raise UserError(f"{file} is truncated or damaged: its header claims {n:,} bytes, but the whole file holds "
                        f"only {size:,}; {fix}")
    try:
        with safe_open(str(file), framework="numpy"):
            pass
    except (SafetensorError, OSError) as exc:
        expected = described_size(file)
        if expected is not None and size < expected:
            why = f"is truncated: {size:,} bytes, but its header describes {expected:,} (an interrupted download?)"
        else:
            why = f"is not a valid safetensors file ({first_line(exc)})"
        raise UserError(f"{file} {why}; {fix}") from None


def described_size(file: Path) -> int | None:
    """The size a safetensors file must have according to its header, or None when the header does not parse."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER:
                return None
            header = parse_json(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return 8 + n + max(ends, default=0)
    except (OSError, JsonProblem, struct.error, TypeError, KeyError, IndexError, AttributeError, ValueError):
        return None
