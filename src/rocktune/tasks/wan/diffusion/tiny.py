"""Tiny random Wan components built offline and saved as an ordinary diffusers pipeline directory.

The directory loads by subfolder (``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``) with
the same code as ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``, so tests and the example config exercise the real loaders.
Shapes follow diffusers' own Wan tests: a 2-block transformer with 2 heads of 12 channels, a VAE with base_dim 3 and
z_dim 16, and a 2-layer UMT5 encoder over a character-level tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path

TEXT_DIM = 32


def build_tokenizer():
    """One token per printable ASCII character, T5's specials (pad 0, eos 1, unk 2): enough to tell captions apart."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_components(seed: int = 0, layers: int = 2, heads: int = 2, head_dim: int = 12, ffn_dim: int = 32) -> dict:
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                        in_channels=16, out_channels=16, text_dim=TEXT_DIM, freq_dim=256,
                                        ffn_dim=ffn_dim, num_layers=layers, cross_attn_norm=True,
                                        qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "scheduler": scheduler,
            "transformer": transformer}


def build_tiny_wan(out: Path, seed: int = 0, boundary_ratio: float | None = None, **shape) -> Path:
    """Write the tiny pipeline to ``out`` (a diffusers directory with model_index.json); returns ``out``.
    ``boundary_ratio``: two experts as in Wan 2.2 A14B (a second transformer, transformer_2/, below the boundary)."""
    from diffusers import WanPipeline

    out = Path(out)
    parts = build_components(seed, **shape)
    if boundary_ratio is not None:
        parts.update(transformer_2=build_components(seed + 1, **shape)["transformer"], boundary_ratio=boundary_ratio)
    WanPipeline(**parts).save_pretrained(out)  # type: ignore[attr-defined]  # diffusers adds it at runtime
    return out


def write_clips(folder: Path, captions: list[str], size: tuple[int, int] = (32, 32), frames: int = 9,
                fps: int = 8, seed: int = 0) -> list[Path]:
    """Short generated clips, one per caption (a coloured square moving across a gradient), each with its caption
    in a ``.txt`` beside it: a folder in the layout ``data.train_file`` reads."""
    import av
    import numpy as np

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    width, height = size
    paths = []
    for i, caption in enumerate(captions):
        path = folder / f"clip_{i:03d}.mp4"
        colour = rng.integers(40, 255, size=3)
        with av.open(str(path), "w") as container:
            stream = container.add_stream("mpeg4", rate=fps)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for f in range(frames):
                img = np.zeros((height, width, 3), np.uint8)
                img[..., i % 3] = np.linspace(0, 200, width, dtype=np.uint8)[None, :]
                x = (f * 3 + i * 5) % max(width - 8, 1)
                img[height // 3: height // 3 + 8, x: x + 8] = colour
                for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
        paths.append(path)
    return paths


CAPTIONS = ["a red square slides right across a blue gradient", "a small bright square on a green gradient",
            "a square drifting over a red gradient", "a pale square crossing a blue gradient",
            "a square moving left to right over green", "a bright square on a red gradient at dusk",
            "a square gliding across a blue field", "a coloured square passing over a green gradient"]


def main(argv: list[str] | None = None) -> int:
    """``python -m rocktune.tasks.wan.diffusion.tiny [DIR]``: the tiny components and clips
    examples/wan-tiny-video-lora.yaml trains on (default DIR: runs/wan-tiny)."""
    import argparse

    from rocktune.tasks.wan.diffusion.components import quiet
    from rocktune.errors import quiet_libraries

    parser = argparse.ArgumentParser(prog="python -m rocktune.tasks.wan.diffusion.tiny",
                                     description="Write the tiny Wan pipeline and captioned clips that "
                                                 "examples/wan-tiny-video-lora.yaml trains on (offline, seconds).")
    parser.add_argument("dir", nargs="?", default="runs/wan-tiny", help="output directory (default runs/wan-tiny)")
    out = Path(parser.parse_args(argv).dir)  # --help prints and exits: it is never a directory name
    quiet_libraries()
    quiet()
    build_tiny_wan(out / "tiny-wan")
    write_clips(out / "clips", CAPTIONS, size=(48, 32), frames=9)
    print(f"wrote {out / 'tiny-wan'} (a diffusers Wan pipeline) and {len(CAPTIONS)} captioned clips in {out / 'clips'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
