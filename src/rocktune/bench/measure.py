"""Memory probes and the environment record, used inside each benchmark child process.

On Linux the peak RSS is reset after the model is loaded (``/proc/self/clear_refs`` value 5 resets VmHWM), so
the growth of RSS over the loaded model is measured, not the transient peak of loading; elsewhere
``ru_maxrss`` is used and said so. On a GPU the device's max allocated and reserved bytes are read.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
from pathlib import Path

from rocktune.train.memory import resident_bytes


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    return resident_bytes() or None  # the training loop's own reader (train/memory.py), so both report one figure


class MemoryProbe:
    def __init__(self, device: str):
        self.device = device
        self.loaded: dict = {}
        self.peak_source = "ru_maxrss (includes model loading)"
        self.shape: dict | None = None
        self.step_peaks: list[tuple[int, int]] = []  # (allocated, reserved) peaks of each optimizer step
        self.journal: Path | None = None  # where ``log_step`` appends each step of a run that keeps no metrics

    def mark_loaded(self, model=None) -> None:
        """Called once the model (with LoRA) is in memory and before the first training step."""
        import torch

        if model is not None:
            self.shape = model_shape(model)
        self.loaded["rss_bytes"] = rss_bytes()
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.peak_source = "VmHWM reset after model load"
        except OSError:
            pass
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.loaded["device_allocated_bytes"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def step_done(self, step: int) -> None:
        """After each optimizer step: the training loop resets the device's peak counters as each step starts (its
        log shows each step's peak), so the run's peak is the largest of the steps' peaks, read here."""
        if self.device == "cuda":
            import torch

            self.step_peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))

    def log_step(self, record: dict) -> None:
        """One optimizer step of the HF baseline, appended as a line of ``metrics.jsonl`` (rocktune's loop writes its
        own): what a run cut by its time limit still reports (``runner.partial_result``)."""
        if self.journal is None:
            return
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        peak = None
        if self.device == "cuda":
            import torch

            peak = torch.cuda.max_memory_allocated()  # since the model was loaded: never reset on this side
        with self.journal.open("a") as f:
            f.write(json.dumps({**record, "peak_mem_bytes": peak}) + "\n")

    def report(self) -> dict:
        import torch

        if not self.loaded:  # the training ran in other processes (bench --nproc): nothing of ours to report
            return {"rss_loaded_bytes": None, "rss_peak_bytes": None, "rss_growth_bytes": None,
                    "rss_peak_source": "not measured (worker processes)"}

        hwm = _status_kib("VmHWM") if self.peak_source.startswith("VmHWM") else None
        peak = hwm * 1024 if hwm is not None else _maxrss_bytes()
        loaded = self.loaded.get("rss_bytes")
        out = {"rss_loaded_bytes": loaded, "rss_peak_bytes": peak,
               "rss_growth_bytes": peak - loaded if loaded is not None and peak is not None else None,
               "rss_peak_source": self.peak_source}
        if self.device == "cuda":
            torch.cuda.synchronize()
            peaks = self.step_peaks + [(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())]
            out.update(device_loaded_bytes=self.loaded.get("device_allocated_bytes"),
                       device_peak_allocated_bytes=max(a for a, _ in peaks),
                       device_peak_reserved_bytes=max(r for _, r in peaks),
                       device_step_peak_allocated_bytes=[a for a, _ in self.step_peaks])
        return out


def _maxrss_bytes() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage if sys.platform == "darwin" else usage * 1024  # bytes on macOS, KiB on Linux


def model_shape(model) -> dict:
    """Counted from the loaded module tree: weights of every matmul (LoRA excluded), layers, attention width."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    n = sum(m.weight.numel() for name, m in base.named_modules()
            if isinstance(m, torch.nn.Linear) and "lora_" not in name)
    cfg = base.config.get_text_config()  # a vision-language model's language model (a text model: its own config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"matmul_params": n, "layers": cfg.num_hidden_layers, "attn_dim": cfg.num_attention_heads * head_dim,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "head_params": base.get_output_embeddings().weight.numel(),
            "dtype": str(next(base.parameters()).dtype).removeprefix("torch.")}


def environment(device: str, threads: int) -> dict:
    import importlib.metadata as md

    import torch

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    env = {"python": platform.python_version(), "os": platform.platform(), "machine": platform.machine(),
           "cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": threads,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "device": device,
           "torch": torch.__version__, "hip": torch.version.hip, "cuda": torch.version.cuda,
           **{pkg: version(pkg) for pkg in ("transformers", "peft", "accelerate", "liger-kernel", "rocktune")}}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_arch=getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}",
                   gpu_memory_bytes=props.total_memory)
    return env


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for results that depend on the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
