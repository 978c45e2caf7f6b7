"""``model.quantization`` before anything is loaded: the knowledge base's verdict, then the kernels proven here.

The verdict (``rocktune.models.quant.gate``) refuses the combinations known to fail. What it cannot know — a build that
loads but computes garbage (bitsandbytes#2087), or a kernel wrong for some row lengths (bitsandbytes 0.50.2's CPU
dequantisation of rows that are not a multiple of 64 values, measured by rocktune) — the self-test finds: the
model's own row lengths are quantised and dequantised on the training device against a plain-torch reference,
and on a GPU the 4-bit linear runs too. It costs well under a second.
"""

from __future__ import annotations

import dataclasses

from rocktune.errors import UserError


def check_quantization(quantization: str, name_or_path: str, precision: str, device: str, max_length: int,
                       lora_r: int, platform=None) -> list[str]:
    """Raise UserError when the run must not load a quantised base here; else the notes to log."""
    if quantization == "none":
        return []
    from rocktune.models import quant

    plat = _platform(platform, device, quant.installed_bnb())
    vram = plat.devices[0].vram_bytes if plat.devices else None
    notes = quant.gate(plat, quantization, name_or_path, precision, vram, max_length, lora_r)
    quant.check_installed(quantization)
    notes.append(_self_test(device, quantization, name_or_path))
    return notes


def _platform(plat, device: str, bnb_version: str | None):
    """The run's platform snapshot (``platform``; detected here when none is given) as the training device sees it."""
    from rocktune.platform.detect import detect, torch_devices

    plat = plat or detect("passive")
    libraries = {k: v for k, v in plat.libraries.items() if k != "bitsandbytes"}
    if bnb_version:
        libraries["bitsandbytes"] = bnb_version  # what is importable now, not when the snapshot was taken
    devices = [] if device == "cpu" else (torch_devices()[:1] or plat.devices[:1])
    return dataclasses.replace(plat, devices=devices, libraries=libraries)


def row_lengths(name_or_path: str) -> list[int]:
    """Input widths of the model's linear layers (from config.json); the doctor's 512 when the shape is unknown."""
    from rocktune.planner.shapes import load_shape

    try:
        shape = load_shape(name_or_path)
    except UserError:
        return [512]
    return sorted({n_in for _, n_in, _, _ in shape.linears()})


def _self_test(device: str, quantization: str, name_or_path: str) -> str:
    from rocktune.models import quant
    from rocktune.doctor.quant_checks import check_linear4bit, check_linear8bit, check_quant4

    if quantization == "int8":
        widths, results = [], [("int8 linear", check_linear8bit(device))]
    else:
        widths = row_lengths(name_or_path)
        results = [(f"{quantization} rows of {n}", check_quant4(device, quantization, shape=(64, n))) for n in widths]
        if device != "cpu":
            results.append((f"{quantization} linear", check_linear4bit(device, quantization)))
    failed = [(what, r) for what, r in results if r.status == "fail"]
    if failed:
        what, r = failed[0]
        raise UserError(
            f"model.quantization={quantization}: bitsandbytes {quant.installed_bnb()} computes wrong {quantization} "
            f"results on {device} ({what}: {r.detail}); training on it would learn from garbage. Run `rocktune doctor` "
            "for the details and the bitsandbytes build to install, or set model.quantization=none.")
    if quantization == "int8":
        return f"int8 self-test on {device} passed (the int8 linear against a row-quantised reference)"
    return (f"{quantization} self-test on {device} passed (rows of {', '.join(map(str, widths))}"
            f"{' and the 4-bit linear' if device != 'cpu' else ''})")
