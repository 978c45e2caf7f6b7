"""Variants of the family matrix's tiny models for the GGUF tests: a family's fixture with config changes (the shapes
released checkpoints have and the matrix's fixture does not), and Gemma's own kind of tokenizer (BPE with byte
fallback over text whose spaces are "\u2581", as Gemma 4's tokenizer.json is), which llama.cpp reads as a tokenizer
of its own."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tests.family_fixtures import BY_NAME, TEMPLATES, build_tokenizer, family_config

GEMMA_BASE = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # GemmaTokenizer's first ids
# Gemma 4's tokens llama.cpp's chat parser reads as text (written USER_DEFINED by the converter and by rocktune)
GEMMA4_VISIBLE = ("<|channel>", "<channel|>")


def gemma_tokenizer(template: str = "gemma4", vocab_size: int = 400):
    """A tokenizer shaped like Gemma 4's: its special tokens first, the 256 byte tokens, then BPE merges trained here
    on the export tests' corpus with spaces as "\u2581" and no pre-splitting (newlines apart); BOS added."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                            trainers)
    from transformers import PreTrainedTokenizerFast

    from tests.export_fixtures import corpus

    t = TEMPLATES[template]
    specials = list(dict.fromkeys(GEMMA_BASE + t.specials + GEMMA4_VISIBLE))
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    # no token joins a newline to anything else (true of Gemma's vocabulary; llama.cpp's gemma4 tokenizer splits the
    # text at newlines before merging)
    trainer_tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    trained = vocab_size - len(specials) - 256
    trainer_tok.train_from_iterator(corpus(), trainer=trainers.BpeTrainer(vocab_size=trained, show_progress=False))
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token=t.eos, pad_token="<pad>",
                                   unk_token="<unk>", chat_template=t.text)


def build_variant(name: str, out: Path, changes: dict, tokenizer=None, seed: int = 0) -> Path:
    """The family ``name``'s tiny model with ``changes`` to its config (and ``tokenizer`` instead of its own; the
    vocabulary is then the tokenizer's size unless ``changes`` says otherwise)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rocktune.models.load import quiet_transformers

    quiet_transformers()
    fam = BY_NAME[name]
    tok = tokenizer or build_tokenizer(TEMPLATES[fam.template])
    extra = {**fam.extra, **({"vocab_size": len(tok)} if tokenizer is not None else {}), **changes}
    if name == "gemma4" and "vocab_size_per_layer_input" not in changes:  # the per-layer embedding: a row per token
        extra["vocab_size_per_layer_input"] = extra["vocab_size"]
    torch.manual_seed(seed)
    cfg = family_config(dataclasses.replace(fam, extra=extra), tok)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
