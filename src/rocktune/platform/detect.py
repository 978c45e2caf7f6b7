"""Platform snapshot: what this machine is, as plain data that round-trips through JSON.

Three ways to fill the device list, because the runtime reads its environment variables when the device is first
initialised and some callers must not initialise it yet:

- ``device``: ask torch in this process (initialises the GPU runtime here);
- ``passive``: read the kernel's view (``/sys/class/kfd`` on Linux ROCm, ``nvidia-smi``) — no GPU runtime;
- ``child``: ask torch in a child process, so this process stays uninitialised but still learns the true arch.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform as _pyplatform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from rocktune.errors import UserError

LIBRARIES = ("transformers", "peft", "bitsandbytes", "flash-attn", "liger-kernel", "torchao", "triton",
             "diffusers", "av",  # these two: task video-lora / image-lora
             "huggingface-hub", "datasets", "accelerate")  # and these: which of them fit the torch (platform/stack)
ENV_PREFIXES = ("HSA_", "HIP_", "ROCR_", "ROCM_", "AMD_", "CUDA_", "NCCL_", "RCCL_", "PYTORCH_", "TORCH_",
                "MIOPEN_", "FLASH_ATTENTION_", "GPU_", "DISABLE_ADDMM", "OMP_NUM_THREADS")
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")
_KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")


@dataclass
class Device:
    index: int
    name: str
    arch: str  # gfx942 (ROCm, gcnArchName before ':'), sm_89 (NVIDIA compute capability)
    vram_bytes: int | None = None  # on APUs only the carve-out (pytorch#107605)
    shared_memory: bool = False  # APU / integrated: host and device share RAM
    source: str = "torch"  # torch | sysfs | nvidia-smi | simulated


@dataclass
class Platform:
    os: str  # linux | windows | darwin
    python: str
    backend: str  # rocm | cuda | cpu (the torch build)
    torch: str | None = None
    hip: str | None = None  # torch.version.hip
    rocm: str | None = None  # ROCm release the wheel was built for (+rocmX.Y), else HIP major.minor
    cuda: str | None = None
    build_archs: list[str] = field(default_factory=list)  # archs the torch build carries kernels for, if known
    devices: list[Device] = field(default_factory=list)
    libraries: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    iommu: str | None = None  # the iommu= kernel parameter on Linux, "" when absent, None when unknown
    os_release: str = ""
    machine: str = ""
    cpu_count: int = 0
    probe: str = "device"  # how devices were found: device | passive | child | simulated

    @property
    def arch(self) -> str:
        """Arch of the training device (device 0); ``cpu`` when there is no GPU."""
        return self.devices[0].arch if self.devices else "cpu"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Platform:
        if isinstance(data, dict) and "platform" in data and "os" not in data:
            data = data["platform"]  # a whole `rocktune doctor --json` report
        if not isinstance(data, dict) or not {"os", "python", "backend"} <= data.keys():
            raise UserError("platform JSON needs at least the keys 'os', 'python' and 'backend' "
                            "(write one with `rocktune doctor --json`)")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        devs = kwargs.pop("devices", []) or []
        dev_known = {f.name for f in fields(Device)}
        kwargs["devices"] = [Device(**{k: v for k, v in d.items() if k in dev_known}) for d in devs]
        if kwargs["backend"] not in ("rocm", "cuda", "cpu"):
            raise UserError(f"platform backend must be rocm, cuda or cpu, not {kwargs['backend']!r}")
        return cls(**kwargs)


def load_platform(path: str | os.PathLike) -> Platform:
    from rocktune.readers.json_file import read_json

    return Platform.from_dict(read_json(Path(path), "write one with `rocktune doctor --json`."))


def detect(probe: str = "device") -> Platform:
    """Snapshot this machine; ``probe`` is device, passive or child (see the module docstring)."""
    import torch

    hip, cuda = getattr(torch.version, "hip", None), getattr(torch.version, "cuda", None)
    plat = Platform(
        os=_os_name(), python=_pyplatform.python_version(), backend="rocm" if hip else "cuda" if cuda else "cpu",
        torch=torch.__version__, hip=hip, rocm=_rocm_release(torch.__version__, hip), cuda=cuda,
        build_archs=_build_archs(torch), libraries=_libraries(), env=_relevant_env(os.environ),
        iommu=_iommu(), os_release=_pyplatform.release(), machine=_pyplatform.machine(),
        cpu_count=os.cpu_count() or 0, probe=probe,
    )
    if plat.backend != "cpu":
        plat.devices = _find_devices(plat, probe)
    return plat


def _find_devices(plat: Platform, probe: str) -> list[Device]:
    if probe == "device":
        return torch_devices()
    if probe == "child":
        found = _child_devices()
        if found is not None:
            return found
        plat.probe = "passive"
    return _kfd_devices() if plat.backend == "rocm" else _nvidia_smi_devices()


def torch_devices() -> list[Device]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        if torch.version.hip:
            # gcnArchName looks like "gfx942:sramecc+:xnack-"; major/minor are the gfx version, not a capability
            arch = (getattr(p, "gcnArchName", "") or "").split(":")[0] or "unknown"
        else:
            arch = f"sm_{p.major}{p.minor}"
        out.append(Device(i, p.name, arch, int(p.total_memory), bool(getattr(p, "is_integrated", False))))
    return out


def _child_devices() -> list[Device] | None:
    code = "import json,rocktune.platform.detect as d;print(json.dumps([vars(x) for x in d.torch_devices()]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
        return [Device(**d) for d in json.loads(proc.stdout.strip().splitlines()[-1])]
    except (subprocess.SubprocessError, ValueError, IndexError, TypeError, OSError):
        return None  # the caller falls back to the passive view


def _kfd_devices() -> list[Device]:
    """GPUs from the KFD topology: gfx_target_version 90010 is gfx90a (major, minor and stepping in hex)."""
    out: list[Device] = []
    nodes = sorted(_KFD_NODES.glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0)
    for node in nodes:
        props = _read_props(node / "properties")
        version = props.get("gfx_target_version", 0)
        if not version:
            continue  # a CPU node
        arch = f"gfx{version // 10000}{(version // 100) % 100:x}{version % 100:x}"
        vram = sum(_read_props(b / "properties").get("size_in_bytes", 0) for b in (node / "mem_banks").glob("*"))
        # a hint only (advise also knows which archs are APUs): a node with CPU cores and SIMDs is an APU
        shared = props.get("cpu_cores_count", 0) > 0
        out.append(Device(len(out), arch, arch, vram or None, shared, "sysfs"))
    return out


def _read_props(path: Path) -> dict[str, int]:
    try:
        pairs = (line.split() for line in path.read_text().splitlines())
        return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
    except OSError:
        return {}


def _nvidia_smi_devices() -> list[Device]:
    cmd = ["nvidia-smi", "--query-gpu=index,name,memory.total,compute_cap", "--format=csv,noheader,nounits"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    out = []
    for line in proc.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            arch = "sm_" + parts[3].replace(".", "")
            vram = int(float(parts[2]) * 2**20) if parts[2].replace(".", "").isdigit() else None
            out.append(Device(int(parts[0]), parts[1], arch, vram, False, "nvidia-smi"))
    return out


def _os_name() -> str:
    return {"win32": "windows", "darwin": "darwin"}.get(sys.platform, "linux" if sys.platform.startswith("linux")
                                                         else sys.platform)


def _rocm_release(torch_version: str, hip: str | None) -> str | None:
    if not hip:
        return None
    m = re.search(r"\+rocm(\d+(?:\.\d+)*)", torch_version)
    return m.group(1) if m else ".".join(hip.split(".")[:2])


def _build_archs(torch) -> list[str]:
    # Compile-time flags only: reading them does not initialise a device.
    getter = getattr(torch._C, "_cuda_getArchFlags", None)
    try:
        flags = getter() if getter else None
    except Exception:  # noqa: BLE001 -- a probe of an optional library: absent is the answer
        return []
    return sorted(set(flags.split())) if flags else []


def _libraries() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _relevant_env(environ) -> dict[str, str]:
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(ENV_PREFIXES) and not any(w in k.upper() for w in _SECRET_WORDS)}


def _iommu() -> str | None:
    try:
        cmdline = Path("/proc/cmdline").read_text()
    except OSError:
        return None
    m = re.search(r"\b(?:amd_)?iommu=(\S+)", cmdline)
    return m.group(1) if m else ""


if __name__ == "__main__":  # used by the `child` probe and handy for bug reports
    print(json.dumps(detect("device").to_dict(), indent=2))
