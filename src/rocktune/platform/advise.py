"""Platform -> Advice: environment variables to set, training defaults, and findings, each with its reason.

Pure: reads the knowledge base, never a device. ``documented`` env advice may be applied by
``environment.apply_environment``; ``reported`` advice is only ever shown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rocktune.platform import knowledge, stack
from rocktune.platform.detect import Platform


@dataclass
class EnvAdvice:
    name: str
    value: str
    reason: str
    source: str
    confidence: str  # documented (applied when the user has not set it) | reported (shown only)


@dataclass
class Finding:
    id: str
    level: str  # error | warning | info
    message: str
    fix: str
    source: str
    confidence: str


@dataclass
class Defaults:
    precision: str = "fp32"  # fp32 | bf16 | fp16
    attn_implementation: str = "sdpa"
    num_workers: int = 0
    pin_memory: bool = False
    compile: bool = False
    grad_scaler: bool = False  # only with fp16


@dataclass
class Advice:
    arch: str
    facts: dict
    env: list[EnvAdvice] = field(default_factory=list)
    defaults: Defaults = field(default_factory=Defaults)
    reasons: dict[str, str] = field(default_factory=dict)  # default field -> why
    findings: list[Finding] = field(default_factory=list)

    @property
    def fallback_precision(self) -> str:
        """What ``auto`` uses when the bf16 self-test fails: fp16 where the arch has fp16 units, else fp32."""
        has_fp16_units = self.facts.get("precision") in ("bf16", "fp16") and self.facts.get("vendor") != "cpu"
        return "fp16" if has_fp16_units else "fp32"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["facts"] = {k: v for k, v in self.facts.items() if k != "ids"}
        return data


def advise(plat: Platform) -> Advice:
    facts = knowledge.arch_facts(plat.arch) or {}
    advice = Advice(arch=plat.arch, facts=dict(facts))
    _arch_defaults(plat, facts, advice)
    ctx = _context(plat, advice)
    for rule in knowledge.matching_rules(plat):
        _apply_rule(rule, ctx, advice)
    advice.defaults.grad_scaler = advice.defaults.precision == "fp16"
    for p in stack.problems(plat.torch, plat.libraries):  # what `doctor` and `train` refuse on the machine itself
        advice.findings.append(Finding(p.id, "error", p.message, p.fix, p.source, p.confidence))
    return advice


def _arch_defaults(plat: Platform, facts: dict, advice: Advice) -> None:
    d, why = advice.defaults, advice.reasons
    src = f"{plat.arch}: {facts.get('matrix', 'unknown arch')} ({facts.get('source', 'no entry')})"
    d.precision = facts.get("precision", "fp32") if plat.devices else "fp32"
    why["precision"] = src if plat.devices else "no GPU: the CPU trains in fp32"
    if d.precision == "fp16":
        why["precision"] += "; fp16 needs a GradScaler"
    fused = facts.get("sdpa_fused", "none")
    why["attn_implementation"] = (f"PyTorch SDPA picks the best sound backend; fused kernels for {plat.arch}: {fused}"
                                  if plat.devices else "SDPA (math / CPU flash kernels)")
    why["num_workers"] = "data is tokenised once up front; worker processes add risk (Windows + ROCm) and no speed"
    d.pin_memory = bool(plat.devices)
    why["pin_memory"] = ("pinned host memory speeds host-to-device copies" if plat.devices
                         else "no device to copy to")
    d.compile = bool(facts.get("compile")) and plat.os == "linux" and bool(plat.devices)
    why["compile"] = (f"torch.compile is sound on {plat.arch} (Linux)" if d.compile
                      else f"torch.compile off: {'not a sound default on ' + plat.arch if plat.devices else 'CPU'}")


def _context(plat: Platform, advice: Advice) -> dict:
    return {
        "arch": plat.arch, "torch": plat.torch, "hip": plat.hip, "rocm": plat.rocm, "cuda": plat.cuda,
        "python": plat.python, "os": plat.os, "backend": plat.backend, "env": plat.env,
        "devices": len(plat.devices), "precision": advice.defaults.precision,
        "iommu_text": f"iommu={plat.iommu}" if plat.iommu else "no iommu= parameter",
        "bnb": plat.libraries.get("bitsandbytes", "not installed"),
        "bnb_build": (knowledge.bnb_build(plat) or {}).get("library", f"no library for ROCm {plat.rocm}"),
        "bnb_fix": bnb_fix(plat),
    }


def quant_findings(plat: Platform, quant: str) -> list[Finding]:
    """What the knowledge base says about loading a ``quant`` base here; documented errors mean: refuse."""
    advice = Advice(arch=plat.arch, facts=dict(knowledge.arch_facts(plat.arch) or {}))
    _arch_defaults(plat, advice.facts, advice)
    ctx = {**_context(plat, advice), "quant": quant}
    for rule in knowledge.matching_quant_rules(plat, quant):
        _apply_rule(rule, ctx, advice)
    return advice.findings


def bnb_fix(plat: Platform) -> str:
    """Exactly which bitsandbytes to install for this platform, or that none carries its arch."""
    pip = "pip install 'rocktune[qlora]' (bitsandbytes >= 0.50)"
    if plat.backend != "rocm" or not plat.devices:
        return pip
    builds = knowledge.bnb_builds_with(plat.arch, plat.os)
    if not builds:
        return f"no bitsandbytes build carries {plat.arch} on {plat.os}: train LoRA without quantisation"
    if knowledge.bnb_build(plat) in builds:
        return f"{pip}: its {knowledge.bnb_build(plat)['library']} library carries {plat.arch}"
    first = builds[0]
    return (f"install a torch build for {first['library']} or later on {plat.os} (bitsandbytes picks its library by "
            f"the runtime's ROCm), then {pip}: its {first['library']} library carries {plat.arch}")


def _fmt(text: str, ctx: dict) -> str:
    try:
        return text.format_map(ctx)
    except (KeyError, IndexError, AttributeError):
        return text


def _apply_rule(rule: dict, ctx: dict, advice: Advice) -> None:
    src, conf = rule["source"], rule["confidence"]
    for name, value in (rule.get("env") or {}).items():
        advice.env.append(EnvAdvice(name, str(value), _fmt(rule.get("reason", rule["id"]), ctx), src, conf))
    why = _fmt(rule.get("message") or rule.get("reason") or rule["source"], ctx)
    for key, value in (rule.get("defaults") or {}).items():
        if conf == "documented":  # reported knowledge never changes what rocktune does
            setattr(advice.defaults, key, value)
            advice.reasons[key] = f"{why} [{rule['id']}]"
    if rule.get("message"):
        finding = Finding(rule["id"], rule.get("level", "info"), why, _fmt(rule.get("fix", ""), ctx), src, conf)
        advice.findings.append(finding)


def device_precision(device: str, plat: Platform | None = None) -> str:
    """The precision policy of the device that ``device`` names (``cpu``, ``cuda``, ``cuda:N``): fp32 on a CPU and on
    archs whose policy is fp32 (gfx906), the knowledge base's choice elsewhere. For inference (``rocktune generate``)
    as for training: ``torch.cuda.is_bf16_supported()`` says True on every ROCm device, so it is never asked.
    ``plat``: this machine's snapshot (detected when not given; tests feed one in)."""
    if not device.startswith("cuda"):
        return "fp32"
    from dataclasses import replace

    from rocktune.platform.detect import detect, torch_devices

    index = int(device.split(":")[1]) if ":" in device else 0
    if plat is None:
        plat = replace(detect("passive"), devices=torch_devices())
    devices = [d for d in plat.devices if d.index == index] or plat.devices[index:index + 1]
    return advise(replace(plat, devices=devices)).defaults.precision if devices else "fp32"
