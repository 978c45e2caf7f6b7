"""Tokenizer -> GGUF metadata, so that llama.cpp tokenises exactly like transformers.

Byte-level BPE tokenizers (Qwen2/2.5/3, Llama 3, SmolLM, GPT-2) are written as llama.cpp's ``gpt2`` model with
the pre-tokenizer named from its splitting regex; SentencePiece tokenizers (Llama 2, Mistral) as ``llama`` from
``tokenizer.model``; Gemma 4's SentencePiece-style BPE tokenizer.json as llama.cpp's ``gemma4``. gguf-py's
``SpecialVocab`` supplies merges, special ids and the chat template; whether BOS/EOS are added is read off the
tokenizer by encoding a word, not guessed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rocktune.errors import UserError

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# A merge llama.cpp can never apply (BPE symbols start as single characters, never as a whole special token):
# its loader needs the merges key, and tokenizers with no merges at all (rocktune's demo) have none to write.
NEVER_FIRING_MERGE = "<|never|> <|merge|>"
SHIPPED_TOKENIZER = "tokenizer.shipped.json"  # the base's own tokenizer.json, when the export copied it
# llama.cpp architectures whose SentencePiece-style BPE tokenizer.json it reads as a tokenizer of its own (named like
# the architecture), with the tokens its chat parser must see as text
SPM_BPE = {"gemma4": {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                      "<tool_response|>", '<|"|>'}}
# (role, token) where a llama.cpp architecture expects other special tokens than the tokenizer names: GLM's turns
# start with [gMASK] and one ends where the next <|user|> (or a tool's <|observation|>) begins
ROLES = {"glm4moe": (("bos", "[gMASK]"), ("eot", "<|user|>"), ("unk", "<|endoftext|>"), ("eom", "<|observation|>"))}


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's name for the pre-tokenizer, recognised from the regex it splits with."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    steps = _flatten(tokenizer_json.get("pre_tokenizer") or {})
    regexes = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    digits = [s for s in steps if s.get("type") == "Digits" and s.get("individual_digits")]
    if regexes == [PRETOKENIZE_REGEX]:
        return "qwen2"
    if regexes == [LLAMA3_REGEX]:
        return "llama-bpe"
    if not regexes and byte_level and byte_level[0].get("use_regex", True):
        return "smollm" if digits else "gpt-2"
    described = ", ".join(f"{s.get('type')}{'(' + str(s['pattern']) + ')' if 'pattern' in s else ''}" for s in steps)
    raise UserError(f"GGUF export does not recognise this tokenizer's pre-tokenizer yet ({described or 'none'}); "
                    "supported: the Qwen2, Llama 3, SmolLM and GPT-2 splitting rules. Use --to merged, or a "
                    "llama.cpp converter that knows this tokenizer.")


def _flatten(node: dict) -> list[dict]:
    if node.get("type") == "Sequence":
        return [s for child in node.get("pretokenizers", []) for s in _flatten(child)]
    return [node] if node else []


def add_vocab(writer, tokenizer_dir: Path, vocab_size: int) -> None:
    """Write the tokenizer of ``tokenizer_dir`` (a saved HF tokenizer) padded to the model's ``vocab_size``."""
    tj_path = tokenizer_dir / "tokenizer.json"
    if not tj_path.is_file():
        raise UserError(f"{tokenizer_dir} has no tokenizer.json (a fast tokenizer); GGUF export reads the "
                        "vocabulary and merges from it.")
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    model = tj.get("model", {})
    byte_bpe = model.get("type") == "BPE" and not model.get("byte_fallback")
    merged = byte_bpe
    if byte_bpe:
        _add_byte_bpe(writer, tokenizer_dir, tj, vocab_size)
    elif writer.arch in SPM_BPE and model.get("type") == "BPE":
        _add_spm_bpe(writer, tokenizer_dir, vocab_size)
        merged = True
    elif (tokenizer_dir / "tokenizer.model").is_file():
        _add_sentencepiece(writer, tokenizer_dir, vocab_size)
    else:
        raise UserError(f"{tj_path}: GGUF export supports byte-level BPE tokenizers and SentencePiece ones with "
                        f"tokenizer.model; this one is {model.get('type')} "
                        f"{'with byte fallback ' if model.get('byte_fallback') else ''}without tokenizer.model.")
    _add_specials(writer, tokenizer_dir, vocab_size, merged, ROLES.get(writer.arch, ()))


def _add_byte_bpe(writer, tokenizer_dir: Path, tj: dict, vocab_size: int) -> None:
    import gguf

    shipped = tokenizer_dir / SHIPPED_TOKENIZER
    pre = pre_tokenizer_name(json.loads(shipped.read_text(encoding="utf-8")) if shipped.is_file() else tj)
    tok = _hf_tokenizer(tokenizer_dir)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = {i: a for i, a in tok.added_tokens_decoder.items()}
    if max(by_id) >= vocab_size:
        raise UserError(f"the tokenizer in {tokenizer_dir} has ids up to {max(by_id)} but the model only "
                        f"{vocab_size} embedding rows; the tokenizer does not belong to this model.")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:  # embedding rows no token uses (vocabularies are padded to a round size)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def _add_spm_bpe(writer, tokenizer_dir: Path, vocab_size: int) -> None:
    """Gemma 4's tokenizer.json (BPE with byte fallback over text whose spaces became "▁", no splitting): llama.cpp's
    ``gemma4`` tokenizer, read by gguf-py's ``LlamaHfVocab`` (token types by the tokenizer's special tokens, byte
    tokens as bytes), with no space before the text."""
    import gguf

    tokens, scores, types = [], [], []
    for text, score, ttype in gguf.LlamaHfVocab(tokenizer_dir).all_tokens():
        tokens.append(text)
        scores.append(score)
        # llama.cpp's chat parser for the family reads these in the output: rendered as text, never as controls
        types.append(gguf.TokenType.USER_DEFINED if text.decode() in SPM_BPE[writer.arch] else ttype)
    for i in range(len(tokens), vocab_size):  # embedding rows past the tokenizer
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model(writer.arch)
    writer.add_token_list(tokens[:vocab_size])
    writer.add_token_scores(scores[:vocab_size])
    writer.add_token_types(types[:vocab_size])
    writer.add_add_space_prefix(False)


def _add_sentencepiece(writer, tokenizer_dir: Path, vocab_size: int) -> None:
    import gguf
    from gguf.vocab import SentencePieceVocab

    try:
        vocab = SentencePieceVocab(tokenizer_dir)
    except ImportError:
        raise UserError("this model's tokenizer is SentencePiece (tokenizer.model); reading it needs the "
                        "sentencepiece package: pip install 'rocktune[gguf]'.") from None
    tokens, scores, types = [], [], []
    for text, score, ttype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(ttype)
    added = _hf_tokenizer(tokenizer_dir).added_tokens_decoder  # tokens added on top of tokenizer.model
    for i in range(len(tokens), vocab_size):
        if i in added:
            tokens.append(added[i].content.encode())
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(f"[PAD{i}]".encode())
            types.append(gguf.TokenType.UNUSED)
        scores.append(-1000.0)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens[:vocab_size])
    writer.add_token_scores(scores[:vocab_size])
    writer.add_token_types(types[:vocab_size])
    if not _adds_space_prefix(tokenizer_dir / "tokenizer.model"):
        writer.add_add_space_prefix(False)  # llama.cpp prepends one unless told (Gemma's vocabularies do not)


def _adds_space_prefix(model_file: Path) -> bool:
    """Whether this SentencePiece model puts a space before the text (Llama 2, Mistral) or not (Gemma), measured."""
    from sentencepiece import SentencePieceProcessor

    pieces = SentencePieceProcessor(model_file=str(model_file)).encode("a", out_type=str)
    return bool(pieces) and pieces[0].startswith("\u2581")


def _add_specials(writer, tokenizer_dir: Path, vocab_size: int, merged: bool, roles) -> None:
    import gguf

    # gguf-py logs guesses about post-processor templates it half-parses; the add_* flags are measured below instead
    logging.getLogger("gguf.vocab").setLevel(logging.ERROR)
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=vocab_size)
    tok = _hf_tokenizer(tokenizer_dir)
    if not special.merges and merged:  # a BPE loader that needs the key
        special.merges = [NEVER_FIRING_MERGE]
    ids = tok("a", add_special_tokens=True)["input_ids"]
    special.add_special_token["bos"] = tok.bos_token_id is not None and ids[:1] == [tok.bos_token_id]
    special.add_special_token["eos"] = tok.eos_token_id is not None and ids[-1:] == [tok.eos_token_id]
    added = tok.get_added_vocab()
    for role, text in roles:
        if text in added:
            special.special_token_ids[role] = added[text]
    special.add_to_gguf(writer, quiet=True)


# llama.cpp picks Phi-3's per-token attributes by the model's name and then looks these tokens up unconditionally
PHI3_NAME_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def loader_safe_name(name: str, tokenizer_dir: Path) -> str:
    """``name`` for general.name, unless it would make llama.cpp's loader fail: a name containing "phi3" or "phi-3"
    selects its Phi-3 token attributes, which look up the SentencePiece-era tokens of PHI3_NAME_TOKENS and abort
    the load when the vocabulary lacks one (byte-level BPE ones do). Such a name is written with "phi 3" instead."""
    import re

    if not re.search(r"phi-?3", name, re.IGNORECASE):
        return name
    vocab = _hf_tokenizer(tokenizer_dir).get_vocab()
    if all(t in vocab for t in PHI3_NAME_TOKENS):
        return name
    return re.sub(r"(phi)-?3", r"\1 3", name, flags=re.IGNORECASE)


def _hf_tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)
