"""Encode once: VAE latents (fp32) and text-encoder outputs for every media file, checked, stored on disk.

The cache is keyed by a fingerprint of the media (paths, sizes, times, captions, buckets), the checkpoint's VAE and
text encoder and the text length, like the LM token cache: a second run over the same data reads it back and loads
neither encoder. It is written to a temporary folder that is renamed into place only when every item passed its
checks, so a crash or a bad file never leaves a cache that a later run would trust.

Why the checks: seed 004's Wan user lost weeks to VAE encodes that came back as zeros on ROCm (bf16 conversions,
host-to-device copies). Here the VAE always runs in fp32, every latent and text embedding must be finite and not all
zero, and on a GPU the first item is encoded again on the CPU in fp32 and compared, as ``rocktune doctor`` compares
device results with the CPU.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from rocktune.tasks.wan.diffusion.components import Layout, load_text_encoder, load_vae
from rocktune.tasks.wan.diffusion.media import Bucket, MediaItem, load_pixels, media_fingerprint
from rocktune.errors import UserError

CACHE_VERSION = 1
INDEX = "index.json"
# Relative L2 difference allowed between the device's encode and the CPU's fp32 encode of the same input. A broken
# kernel or copy gives ~1.0 (zeros) or NaN; TF32 convolutions give ~1e-3 and a bf16 text encoder ~1e-2.
CROSS_CHECK_TOLERANCE = {"vae": 0.02, "text": 0.05}
CHECK_FRAMES = 5  # the VAE is causal in time: the first 5 frames' latents do not depend on later frames


@dataclass(frozen=True)
class LatentItem:
    file: Path  # safetensors: "latents" [C, F', H', W'] and "text" [tokens, text_dim], both fp32
    bucket: Bucket
    name: str  # the media file, for messages
    elements: int  # latent values: the loss is a mean over these


@dataclass
class LatentSet:
    items: list[LatentItem]
    fingerprint: str
    cache_hit: bool
    notes: list[str]

    def subset(self, idx: list[int]) -> LatentSet:
        return LatentSet([self.items[i] for i in idx], self.fingerprint, self.cache_hit, self.notes)

    def __len__(self) -> int:
        return len(self.items)


def load_item(item: LatentItem) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(item.file)
    except (OSError, SafetensorError) as exc:
        raise UserError(f"the latent cache file {item.file} (for {item.name}) cannot be read ({exc}); delete "
                        f"{item.file.parent} and run again to encode the data afresh.") from None


def cache_key(assigned: list[tuple[MediaItem, Bucket]], layout: Layout, max_text_tokens: int,
              device: str = "cpu") -> str:
    """Everything the cached numbers depend on: the media, the checkpoint's encoders (local files, or the hub
    snapshot in the local cache), the text length, where and in what precision the text encoder ran (a GPU's bf16
    cache is not the CPU's fp32 one), and the libraries that clean and tokenise captions."""
    import importlib.util

    import diffusers
    import transformers

    h = hashlib.sha256()
    h.update(json.dumps({"version": CACHE_VERSION, "media": media_fingerprint(assigned), "source": layout.source,
                         "vae": layout.vae, "text_tokens": max_text_tokens, "weights": _weight_stamps(layout.source),
                         "text_dtype": str(_text_dtype(device)), "encoder_device": device,
                         "libraries": [diffusers.__version__, transformers.__version__,
                                       importlib.util.find_spec("ftfy") is not None]},
                        sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_latents(assigned: list[tuple[MediaItem, Bucket]], layout: Layout, device: str, max_text_tokens: int,
                  cache_root: Path, log) -> LatentSet:
    """The cached set for ``assigned``: read back when present, else encoded on ``device`` and written."""
    key = cache_key(assigned, layout, max_text_tokens, device)
    folder = cache_root / f"wan-{key[:20]}"
    items = [LatentItem(folder / f"item-{i:06d}.safetensors", bucket, str(media.path),
                        _latent_elements(bucket, layout)) for i, (media, bucket) in enumerate(assigned)]
    if _complete(folder, key, len(items)):
        return LatentSet(items, key, True, [f"latent cache hit: {folder}"])
    existed = cache_root.exists()
    tmp = cache_root / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        notes = _encode_all(assigned, layout, device, max_text_tokens, tmp, log)
        sizes = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
        (tmp / INDEX).write_text(json.dumps({"key": key, "items": len(items), "sizes": sizes,
                                             "files": [str(m.path) for m, _ in assigned]}))
        _fsync_folder(tmp)  # a power cut after the rename must not leave truncated items behind a valid index
        if _complete(folder, key, len(items)):  # another run with the same data finished first: keep its copy
            shutil.rmtree(tmp)
        else:
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder of this key (no index) is never read
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not existed:
            shutil.rmtree(cache_root, ignore_errors=True)  # a failed first encode leaves no trace
        raise
    size = sum(f.stat().st_size for f in folder.iterdir())
    return LatentSet(items, key, False, notes + [f"latent cache written: {len(items)} items, "
                                                 f"{size / 2**20:.1f} MiB in {folder}"])


def _encode_all(assigned, layout: Layout, device: str, max_text_tokens: int, out: Path, log) -> list[str]:
    """Captions first (small: kept in memory), then each clip's latents, written as soon as they are encoded: host
    memory stays one clip deep however large the data set. The device is checked against the CPU on the first item
    of each, before the rest is encoded."""
    from safetensors.torch import save_file

    log(f"encoding {len(assigned)} file{'s' if len(assigned) != 1 else ''} once: VAE in fp32, text encoder in "
        f"{'fp32' if _text_dtype(device) == torch.float32 else 'bf16'} on {device}")
    tokenizer, encoder = load_text_encoder(layout.source, _text_dtype(device), device)
    texts, notes = [], []
    for media, _ in assigned:
        with torch.no_grad():
            emb = _encode_text(tokenizer, encoder, media.caption, max_text_tokens)
        _require_sound(emb, "text-encoder output", media, device)
        texts.append(emb)
        if device != "cpu" and len(texts) == 1:
            notes.append(_cross_check_text(tokenizer, encoder, media, emb, max_text_tokens))
            encoder.to(device, _text_dtype(device))  # back from the check's fp32 CPU copy (bf16 round-trips)
    del encoder
    _free(device)
    vae = load_vae(layout.source, device)
    mean, std = _latent_stats(vae)
    for i, ((media, bucket), emb) in enumerate(zip(assigned, texts, strict=True)):
        with torch.no_grad():
            z = _encode_pixels(vae, load_pixels(media, bucket), device, mean, std)
        _require_sound(z, "VAE latents", media, device)
        if device != "cpu" and i == 0:
            notes.append(_cross_check_vae(layout.source, (media, bucket), z, mean, std))
        save_file({"latents": z.contiguous(), "text": emb.contiguous()}, out / f"item-{i:06d}.safetensors")
    del vae
    _free(device)
    return notes


def _encode_pixels(vae, pixels: torch.Tensor, device: str, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1] -> normalised latents [C, F', H', W'] in fp32 on the CPU, as WanPipeline expects them:
    (z - latents_mean) / latents_std, the inverse of what it does before decoding. The distribution's mean is used:
    a deterministic cache, so that two runs over it see the same latents."""
    z = vae.encode(pixels[None].to(device, torch.float32)).latent_dist.mode()[0].float().cpu()
    return (z - mean) / std


def _encode_text(tokenizer, encoder, caption: str, max_tokens: int) -> torch.Tensor:
    """UMT5 last hidden state of the caption's real tokens, fp32 [tokens, dim]: cleaned and tokenised exactly as
    WanPipeline does at inference; training pads it with zeros to ``max_tokens`` as the pipeline does."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    enc = tokenizer([prompt_clean(caption)], padding="max_length", max_length=max_tokens, truncation=True,
                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    device = next(encoder.parameters()).device
    hidden = encoder(enc.input_ids.to(device), enc.attention_mask.to(device)).last_hidden_state
    length = int(enc.attention_mask.sum())
    return hidden[0, :length].float().cpu()


def _latent_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    c = vae.config
    shape = (c.z_dim, 1, 1, 1)
    return torch.tensor(c.latents_mean).view(shape), torch.tensor(c.latents_std).view(shape)


def _latent_elements(bucket: Bucket, layout: Layout) -> int:
    frames = (bucket.frames - 1) // layout.temporal + 1
    return int(layout.vae.get("z_dim", 16)) * frames * (bucket.height // layout.spatial) * \
        (bucket.width // layout.spatial)


def _require_sound(t: torch.Tensor, what: str, media: MediaItem, device: str) -> None:
    if not torch.isfinite(t).all():
        problem = "non-finite values (NaN or inf)"
    elif t.abs().max() == 0:
        problem = "all zeros"
    else:
        return
    raise UserError(f"{media.path}: the {what} came out as {problem} on {device}. A real encode never does: on ROCm "
                    "this is the signature of a broken host-to-device copy or conversion (seed 004). Run `rocktune "
                    "doctor`, and encode on the CPU with diffusion.cache_device=cpu; nothing was cached.")


def _cross_check_vae(source: str, first: tuple[MediaItem, Bucket], device_latents, mean, std) -> str:
    """The first clip's first frames encoded by a CPU copy of the VAE in fp32 (small: hundreds of MB)."""
    media, bucket = first
    frames = min(CHECK_FRAMES, bucket.frames)
    pixels = load_pixels(media, Bucket(bucket.width, bucket.height, frames))
    with torch.no_grad():
        on_cpu = _encode_pixels(load_vae(source, "cpu"), pixels, "cpu", mean, std)
    return _compare("vae", media, device_latents[:, : on_cpu.shape[1]], on_cpu)


def _cross_check_text(tokenizer, encoder, media: MediaItem, device_emb, max_tokens: int) -> str:
    """The first caption through the same encoder moved to the CPU in fp32 (the caller moves it back)."""
    need = sum(p.numel() for p in encoder.parameters()) * 4
    if need * 2 > _host_memory():
        return (f"text-encoder CPU cross-check skipped: an fp32 copy needs {need / 2**30:.0f} GiB, more than half "
                "of this machine's memory (the outputs were still checked finite and non-zero)")
    encoder.to("cpu", torch.float32)
    with torch.no_grad():
        on_cpu = _encode_text(tokenizer, encoder, media.caption, max_tokens)
    return _compare("text", media, device_emb, on_cpu)


def _compare(part: str, media: MediaItem, device_out: torch.Tensor, cpu_out: torch.Tensor) -> str:
    err = float((device_out - cpu_out).norm() / cpu_out.norm().clamp_min(1e-12))
    what = {"vae": "VAE latents", "text": "text-encoder output"}[part]
    if not err <= CROSS_CHECK_TOLERANCE[part]:  # NaN fails too
        raise UserError(f"{media.path}: the device's {what} differ from a CPU fp32 encode of the same input by "
                        f"{err:.3g} (relative; allowed {CROSS_CHECK_TOLERANCE[part]}): the device computes wrong "
                        "numbers. Run `rocktune doctor`, or encode on the CPU with diffusion.cache_device=cpu; "
                        "nothing was cached.")
    return f"{what} match a CPU fp32 encode (relative difference {err:.2g})"


def _complete(folder: Path, key: str, n: int) -> bool:
    """The index names this key and every item file has the size it was written with."""
    try:
        index = json.loads((folder / INDEX).read_text())
        sizes = index.get("sizes", {})
        return index.get("key") == key and index.get("items") == n and len(sizes) == n and \
            all((folder / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError, AttributeError):
        return False


def _fsync_folder(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    if os.name != "nt":  # a directory cannot be opened for fsync on Windows
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _text_dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16  # UMT5-XXL is 23 GB in fp32


def _weight_stamps(source: str) -> dict:
    """Sizes and times of the checkpoint's VAE and text-encoder files, local or in the hub cache's snapshot (whose
    folder name is the commit): a replaced file or a new revision is a new cache key."""
    root = Path(source).expanduser()
    if not root.is_dir():
        try:
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(source, local_files_only=True,
                                          allow_patterns=["vae/*", "text_encoder/*", "tokenizer/*"]))
        except Exception:  # noqa: BLE001 — not in the local cache: the loaders will fetch it or say why not
            return {}
    return {str(p.relative_to(root)): [p.stat().st_size, p.stat().st_mtime_ns]
            for part in ("vae", "text_encoder", "tokenizer") for p in sorted((root / part).glob("*")) if p.is_file()}


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # Windows has no sysconf: assume it does not fit
        return 0


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
