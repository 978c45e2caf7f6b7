"""Build a tiny model and a character-level tokenizer offline, saved as an ordinary HF model directory.

The directory loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` like any hub model, so the demo and the tests
exercise the same loading code as a real run. ``vocab_size`` may exceed the tokenizer's vocabulary (rows that are
never used), which lets benchmarks give the output head the weight it has in real models (32k-152k entries).
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 256  # the first special, right after the 256 byte tokens


def build_tokenizer():
    """Byte-level BPE with no merges: one token per byte, Qwen2's pre-tokenizer and ChatML specials.

    It is built the way ``Qwen2Tokenizer`` rebuilds a tokenizer from ``tokenizer.json``, so the saved directory
    round-trips through ``AutoTokenizer`` unchanged; one token per character keeps the synthetic tasks learnable.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix=""))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0],
                                   additional_special_tokens=SPECIALS[1:], chat_template=CHAT_TEMPLATE)


def _byte_of(ch: str) -> int:
    """GPT-2's byte-to-unicode map: printable bytes map to themselves, the rest to U+0100 upwards."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {v: k for k, v in bytes_to_unicode().items()}[ch]


def tiny_config(vocab_size: int = 320, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                intermediate: int | None = None, max_positions: int = 1024,
                init_std: float = 0.1, arch: str = "qwen2"):
    """``arch``: ``qwen2`` (the demo's model) or ``qwen3_5`` (Qwen3.5's hybrid text stack: three Gated DeltaNet
    layers to one full-attention layer, as released, with linear-attention heads scaled to ``hidden`` in the
    released ratios: twice as many value heads as key heads, heads as wide as the attention's)."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or hidden * 3,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, tie_word_embeddings=True, initializer_range=init_std,
                  bos_token_id=None, eos_token_id=EOS_ID,
                  pad_token_id=None)  # a pad id would make nn.Embedding zero that row: EOS could never win
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(rope_theta=10000.0, **common)
    if arch == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        head = hidden // heads
        return Qwen3_5TextConfig(head_dim=head, linear_key_head_dim=head, linear_value_head_dim=head,
                                 linear_num_key_heads=kv_heads, linear_num_value_heads=2 * kv_heads,
                                 layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                              for i in range(layers)], **common)
    raise ValueError(f"tiny_config: unknown arch {arch!r} (qwen2 or qwen3_5)")


def build_tiny_model(out_dir: str | Path, seed: int = 0, **shape) -> Path:
    """Write a random-init tiny model and its tokenizer to ``out_dir`` and return the path."""
    import torch
    from transformers import AutoModelForCausalLM

    from rocktune.models.load import quiet_transformers

    quiet_transformers()
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    shape.setdefault("vocab_size", 320)
    if shape["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {shape['vocab_size']} is smaller than the tokenizer ({len(tokenizer)})")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(**shape), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_bpe_tokenizer(vocab_size: int = 8000, per_set: int = 2000, seed: int = 7):
    """A byte-level BPE with real merges, trained offline on the synthetic sets (data/synthetic.py), with the demo's
    specials and chat template: tokens span characters as a real tokenizer's do (the one-token-per-byte tokenizer
    above cannot show a moved segment boundary, nor a real tokenizer's speed)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rocktune.data import synthetic

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.dumps(r) for make in synthetic.SETS.values() for r in make(per_set, seed=seed)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0],
                                   additional_special_tokens=SPECIALS[1:], chat_template=CHAT_TEMPLATE)
