"""Load ``knowledge.yaml`` and decide which of its rules match a Platform.

The hardware facts live in the data file; this module only knows how to read a ``when`` clause. The few
conditions that need arithmetic over several fields are named predicates (``check: <name>``) defined here.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml

from rocktune.platform.detect import Platform

CONFIDENCES = ("documented", "reported")
LEVELS = ("error", "warning", "info")
_PATH = Path(__file__).with_name("knowledge.yaml")


@functools.lru_cache(maxsize=None)
def load(path: str | None = None) -> dict:
    data = yaml.safe_load(Path(path or _PATH).read_text())
    data.setdefault("qlora", [])
    data.setdefault("bnb_builds", [])
    data.setdefault("stacks", [])
    for entry in data["archs"] + data["rules"] + data["qlora"] + data["bnb_builds"] + data["stacks"]:
        name = entry.get("id") or entry.get("ids") or entry.get("library") or entry.get("torch")
        if not entry.get("source") or entry.get("confidence") not in CONFIDENCES:
            raise ValueError(f"knowledge entry {name}: needs a source and confidence documented|reported")
        if entry.get("level", "info") not in LEVELS:
            raise ValueError(f"knowledge entry {name}: level must be one of {LEVELS}")
        unknown = set(entry.get("when", {})) - set(_MATCHERS)
        if unknown:
            raise ValueError(f"knowledge entry {name}: unknown condition(s) {sorted(unknown)}")
        if not set(entry.get("quant", ())) <= {"nf4", "fp4", "int8"}:
            raise ValueError(f"knowledge entry {name}: quant lists nf4, fp4 and/or int8")
    return data


def arch_facts(arch: str) -> dict | None:
    for entry in load()["archs"]:
        if arch in entry["ids"]:
            return entry
    return None


def matching_rules(plat: Platform) -> list[dict]:
    return [rule for rule in load()["rules"] if all(_MATCHERS[k](plat, v) for k, v in rule["when"].items())]


def matching_quant_rules(plat: Platform, quant: str) -> list[dict]:
    """The ``qlora`` entries about loading a ``quant`` (nf4 | fp4 | int8) base on this platform."""
    return [rule for rule in load()["qlora"] if quant in rule.get("quant", (quant,))
            and all(_MATCHERS[k](plat, v) for k, v in rule["when"].items())]


def bnb_build(plat: Platform) -> dict | None:
    """The bitsandbytes ROCm library this platform loads (by OS and HIP version); None off ROCm or when none."""
    if plat.backend != "rocm":
        return None
    return next((b for b in load()["bnb_builds"]
                 if b["os"] == plat.os and version_matches(plat.hip or plat.rocm, b["hip"])), None)


def bnb_builds_with(arch: str, os_name: str) -> list[dict]:
    """The bitsandbytes ROCm libraries for ``os_name`` that carry ``arch``, oldest ROCm first."""
    return [b for b in load()["bnb_builds"] if b["os"] == os_name and arch in b["archs"]]


# --- version specs ------------------------------------------------------------------------------------------


def version_tuple(text: str | None) -> tuple[int, ...]:
    """'2.5.1+rocm6.2' -> (2, 5, 1); '6.2.41133-dd7f95766' -> (6, 2, 41133). Local labels are ignored."""
    m = re.match(r"\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def version_matches(version: str | None, spec: str) -> bool:
    """True when ``version`` satisfies every clause of ``spec`` (">=2.5,<2.6"); '*' means present."""
    if version is None:
        return False
    have = version_tuple(version)
    for clause in spec.split(","):
        clause = clause.strip()
        if clause == "*":
            continue
        op, want = re.match(r"(>=|<=|==|!=|>|<)?\s*(.+)", clause).groups()
        want_t = version_tuple(want)
        # compare on the spec's precision: "3.12" == "3.12.3"; "<2.6" is false for 2.6.0
        got = have[: len(want_t)] + (0,) * max(0, len(want_t) - len(have))
        ok = {">=": got >= want_t, "<=": got <= want_t, ">": got > want_t, "<": got < want_t,
              "!=": got != want_t, "==": got == want_t, None: got == want_t}[op]
        if not ok:
            return False
    return True


# --- predicates for `check:` ---------------------------------------------------------------------------------


def _override(plat: Platform) -> str | None:
    return plat.env.get("HSA_OVERRIDE_GFX_VERSION")


def native_override(arch: str) -> str | None:
    """gfx906 -> '9.0.6', gfx90a -> '9.0.10', gfx1151 -> '11.5.1' (major, then minor and stepping in hex)."""
    m = re.fullmatch(r"gfx(\d+)([0-9a-f])([0-9a-f])", arch)
    return f"{m.group(1)}.{int(m.group(2), 16)}.{int(m.group(3), 16)}" if m else None


def _build_covers(plat: Platform) -> bool:
    """ROCm code objects are per ISA; CUDA cubins run on later minors of the same major, PTX JITs forward."""
    if plat.arch in plat.build_archs:
        return True
    m = re.fullmatch(r"sm_(\d+)(\d)", plat.arch)
    if plat.backend != "cuda" or not m:
        return False
    major, minor = int(m.group(1)), int(m.group(2))
    for flag in plat.build_archs:
        b = re.fullmatch(r"(sm|compute)_(\d+)(\d)", flag)
        if b and ((b.group(1) == "sm" and int(b.group(2)) == major and int(b.group(3)) <= minor)
                  or (b.group(1) == "compute" and (int(b.group(2)), int(b.group(3))) <= (major, minor))):
            return True
    return False


def _documented_override(plat: Platform) -> bool:
    """An override the advice will set (Linux, documented): the arch then runs its sibling's kernels."""
    facts = arch_facts(plat.arch) or {}
    return plat.os == "linux" and bool(facts.get("override")) and facts.get("confidence") == "documented"


def _sdpa_experimental(plat: Platform) -> bool:
    facts = arch_facts(plat.arch) or {}
    if facts.get("sdpa_fused") != "experimental":
        return False
    official_from = facts.get("sdpa_official_from")
    if plat.arch == "gfx1200":
        return True  # gfx1200 stays experimental where gfx1201 became official
    return not (official_from and version_matches(plat.torch, f">={official_from}"))


def _expandable_without_support(plat: Platform) -> bool:
    conf = " ".join(v for k, v in plat.env.items() if k.endswith("ALLOC_CONF"))
    if "expandable_segments:true" not in conf.replace(" ", "").lower():
        return False
    return not (version_matches(plat.torch, ">=2.11") and version_matches(plat.hip, ">=7.0"))


def _gc_threshold_out_of_range(plat: Platform) -> bool:
    for key, value in plat.env.items():
        if key.endswith("ALLOC_CONF"):
            m = re.search(r"garbage_collection_threshold:([^,]+)", value)
            try:
                if m and not 0.0 < float(m.group(1)) < 1.0:
                    return True
            except ValueError:
                return True
    return False


PREDICATES = {
    "unknown_arch": lambda p: arch_facts(p.arch) is None,
    "arch_missing_from_build": lambda p: bool(p.devices and p.build_archs and not _build_covers(p)
                                              and not _override(p) and not _documented_override(p)),
    "gpu_build_without_devices": lambda p: p.backend != "cpu" and not p.devices,
    "override_needed": lambda p: not _override(p) and not (p.build_archs and p.arch in p.build_archs),
    "override_wrong": lambda p: bool(_override(p)) and _override(p) not in (
        native_override(p.arch), (arch_facts(p.arch) or {}).get("override")),
    "override_native": lambda p: bool(_override(p)) and _override(p) == native_override(p.arch),
    "sdpa_experimental": _sdpa_experimental,
    "expandable_without_support": _expandable_without_support,
    "gc_threshold_out_of_range": _gc_threshold_out_of_range,
    "iommu_not_pt": lambda p: p.iommu is not None and p.iommu != "pt",
    "not_cdna_ck": lambda p: p.arch not in ("gfx90a", "gfx942", "gfx950"),
    "bnb_missing": lambda p: "bitsandbytes" not in p.libraries,
    "bnb_no_library": lambda p: p.backend == "rocm" and bnb_build(p) is None,
    "bnb_build_lacks_arch": lambda p: bool(p.devices and bnb_build(p)) and p.arch not in bnb_build(p)["archs"],
    "bnb_cannot_run": lambda p: bool(p.devices) and p.arch not in (bnb_build(p) or {}).get("archs", ()),
}


def _any_arch(plat: Platform, archs: list[str]) -> bool:
    return any(d.arch in archs for d in plat.devices) or (not plat.devices and "cpu" in archs)


def _fact(plat: Platform, want: dict) -> bool:
    facts = arch_facts(plat.arch) or {}
    return all(facts.get(k, False if isinstance(v, bool) else None) == v for k, v in want.items())


def _libs(plat: Platform, want: dict) -> bool:
    return all(version_matches(plat.libraries.get(name), spec) for name, spec in want.items())


def _one_of(value, want) -> bool:
    return value in want if isinstance(want, list) else value == want


_MATCHERS = {
    "backend": lambda p, v: _one_of(p.backend, v),
    "os": lambda p, v: _one_of(p.os, v),
    "arch": _any_arch,
    "vendor": lambda p, v: _one_of((arch_facts(p.arch) or {}).get("vendor"), v),
    "torch": lambda p, v: version_matches(p.torch, v),
    "hip": lambda p, v: version_matches(p.hip, v),
    "rocm": lambda p, v: version_matches(p.rocm, v),
    "cuda": lambda p, v: version_matches(p.cuda, v),
    "python": lambda p, v: version_matches(p.python, v),
    "devices": lambda p, v: version_matches(str(len(p.devices)), v),
    "fact": _fact,
    "libs": _libs,
    "env_set": lambda p, v: all(name in p.env for name in v),
    "env_unset": lambda p, v: all(name not in p.env for name in v),
    "env_match": lambda p, v: all(re.search(rx, p.env.get(k, "")) and k in p.env for k, rx in v.items()),
    "apu": lambda p, v: (any(d.shared_memory for d in p.devices) or bool((arch_facts(p.arch) or {}).get("apu")))
    == v,
    "check": lambda p, v: PREDICATES[v](p),
}
