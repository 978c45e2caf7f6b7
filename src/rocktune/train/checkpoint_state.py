"""Reading a checkpoint's state safely: everything is loaded into memory and checked against the model and the
optimizer before any of it is applied, so a checkpoint that cannot be used is refused whole (``Damaged``) and the
caller can fall back to the previous one with the model untouched by the bad one.

Safe means: tensors come from safetensors or ``torch.load(weights_only=True)``, which refuses any pickle that would
run code or build objects other than tensors and plain containers — a refusal is reported, never worked around.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rocktune.errors import first_line
from rocktune.readers.json_file import parse_json

ADAPTER = "adapter_model.safetensors"
STATE = "trainer_state.pt"
META = "meta.json"
REFUSED = "contains data other than tensors; it may have been tampered with — it was not executed"


class Damaged(Exception):
    """The checkpoint cannot be used; the message says which file and why."""


@dataclass
class State:
    adapter: dict
    trainer: dict
    meta: dict
    py_random: tuple
    np_random: tuple


def read(path: Path, model, optimizer) -> State:
    """Load and check every part of the checkpoint at ``path``; raises ``Damaged``. Applies nothing."""
    _check_adapter_files(path)
    adapter = _read_adapter(path / ADAPTER, next(p.device for p in model.parameters()))
    _check_adapter(adapter, model)
    trainer = _read_trainer(path / STATE)
    _check_optimizer(trainer["optimizer"], optimizer)
    meta = _read_meta(path / META)
    py_state, np_state = _random_states(meta)
    return State(adapter, trainer, meta, py_state, np_state)


def apply(state: State, model, optimizer, scheduler, scaler) -> None:
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, state.adapter)
    optimizer.load_state_dict(state.trainer["optimizer"])
    scheduler.load_state_dict(state.trainer["scheduler"])
    scaler.load_state_dict(state.trainer["scaler"])
    rng = state.trainer["rng"]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(state.py_random)
    np.random.set_state(state.np_random)


def _check_adapter_files(path: Path) -> None:
    """The adapter part read by the same reader as ``export`` and ``generate`` use (config fields typed, the weights
    file whole), so a damaged one is named the same way before its tensors are loaded."""
    from rocktune.errors import UserError
    from rocktune.readers.adapter import read_adapter

    try:
        read_adapter(path, "the checkpoint was damaged after it was written")
    except UserError as exc:
        raise Damaged(str(exc)) from None


def _read_adapter(file: Path, device) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file, device=str(device))
    except (OSError, SafetensorError, ValueError) as exc:
        raise Damaged(f"{file.name} cannot be read ({first_line(exc)})") from None


def _check_adapter(tensors: dict, model) -> None:
    from peft import get_peft_model_state_dict

    expected = get_peft_model_state_dict(model)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        name, what = (missing[0], "lacks") if missing else (extra[0], "holds an unknown tensor")
        raise Damaged(f"{ADAPTER} {what} {name} ({len(missing)} missing, {len(extra)} unknown): it does not belong "
                      "to this model and LoRA config")
    for name, want in expected.items():
        got = tensors[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise Damaged(f"{ADAPTER}: {name} is {got.dtype} {list(got.shape)}, the model's is {want.dtype} "
                          f"{list(want.shape)}")


def _read_trainer(file: Path) -> dict:
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower() or "weights_only" in str(exc):
            raise Damaged(f"{file.name} {REFUSED} (or it was written by a newer torch than "
                          f"{torch.__version__})") from None
        raise Damaged(f"{file.name} cannot be read ({first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 — any failure to read is a damaged file, whatever torch raises
        raise Damaged(f"{file.name} cannot be read ({type(exc).__name__}: {first_line(exc)})") from None
    parts = ("optimizer", "scheduler", "scaler", "rng")
    if not isinstance(state, dict) or any(not isinstance(state.get(k), dict) for k in parts):
        raise Damaged(f"{file.name} does not hold the optimizer, scheduler, scaler and RNG states")
    if not isinstance(state["rng"].get("cpu"), torch.Tensor) or state["rng"]["cpu"].dtype != torch.uint8:
        raise Damaged(f"{file.name}: the CPU random-number state is not a byte tensor")
    return state


def _check_optimizer(saved: dict, optimizer) -> None:
    """torch checks the parameter counts per group; a wrongly shaped moment would only fail inside a later step."""
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict) or \
            [len(g.get("params", ())) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise Damaged(f"{STATE}: the optimizer state does not match this model's trainable parameters")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    for key, moments in saved["state"].items():
        if key not in ids or not isinstance(moments, dict):
            raise Damaged(f"{STATE}: optimizer state for an unknown parameter {key!r}")
        param = params[ids.index(key)]
        for name, value in moments.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                raise Damaged(f"{STATE}: optimizer {name} has shape {list(value.shape)}, its parameter "
                              f"{list(param.shape)}")


def _read_meta(file: Path) -> dict:
    try:
        meta = parse_json(file.read_bytes())
        ok = isinstance(meta["step"], int) and isinstance(meta["position"], dict) and isinstance(meta["extra"], dict)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Damaged(f"{META} cannot be read ({first_line(exc)})") from None
    if not ok:
        raise Damaged(f"{META}: step, data position or run state has the wrong type")
    return meta


def _random_states(meta: dict) -> tuple[tuple, tuple]:
    try:
        py, npy = meta["py_random"], meta["np_random"]
        py_state = (py[0], tuple(py[1]), py[2])
        np_state = (npy[0], np.array(npy[1], dtype=np.uint32), npy[2], npy[3], npy[4])
        random.Random().setstate(py_state)  # tried on throwaway generators: a bad state must not half-set the real ones
        np.random.RandomState().set_state(np_state)
    except (TypeError, ValueError, IndexError, KeyError, OverflowError) as exc:
        raise Damaged(f"{META}: unusable random-number state ({first_line(exc)})") from None
    return py_state, np_state

