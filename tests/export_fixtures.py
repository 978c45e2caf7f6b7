"""Tiny models for the export tests: Qwen2 / Qwen3 / Llama shapes with a byte-level BPE tokenizer that has real
merges (trained here, offline), so llama.cpp's tokeniser and pre-tokeniser are exercised, not only byte lookups."""

from __future__ import annotations

from pathlib import Path

import yaml

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
                   "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def corpus() -> list[str]:
    from rocktune.demo.task import make_task

    rows, _ = make_task(n_train=300, n_eval=0, seed=3)
    text = [r["prompt"] + r["completion"] for r in rows]
    text += ["The quick brown fox jumps over the lazy dog. It's 2024, isn't it?",
             "Hello world!\n\nNumbers: 12345 678 9; symbols: (a+b)*c = d/e.",
             "  indented line\n\ttabbed line\r\nwindows line", "naïve café — déjà vu, 東京 and emoji 🙂"] * 20
    return text


def train_tokenizer(style: str, vocab_size: int = 420):
    """A byte-level BPE trained on a small corpus: Qwen2's pre-tokeniser (style qwen2) or Llama 3's (llama3)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    specials = QWEN_SPECIALS if style == "qwen2" else LLAMA_SPECIALS
    regex = PRETOKENIZE_REGEX if style == "qwen2" else LLAMA3_REGEX
    tok = Tokenizer(models.BPE())
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens(specials)
    if style == "llama3":
        tok.model.ignore_merges = True  # as in Llama 3's tokenizer.json (llama.cpp's llama-bpe does the same)
        bos = specials[0]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>",
                                       chat_template=LLAMA3_TEMPLATE)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML)


def model_config(arch: str, vocab_size: int, tied: bool, eos: int, bos: int | None, hidden: int = 64,
                 rope: dict | None = None):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = {"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": hidden * 2,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "tie_word_embeddings": tied, "initializer_range": 0.1,
              "eos_token_id": eos, "bos_token_id": bos, "rms_norm_eps": 1e-6}
    if arch == "qwen2":
        return Qwen2Config(rope_theta=10000.0, **common)
    if arch == "qwen3":
        return Qwen3Config(rope_theta=10000.0, head_dim=32, **common)  # head_dim * heads != hidden on purpose
    if rope:  # e.g. Llama 3.1's scaling: {"rope_type": "llama3", "factor": 8.0, ...}
        return LlamaConfig(rope_parameters={"rope_theta": 500000.0, **rope}, **common)
    return LlamaConfig(rope_theta=500000.0, **common)


def build_model(out: Path, arch: str = "qwen2", tied: bool = True, seed: int = 0, hidden: int = 64,
                rope: dict | None = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    tok = train_tokenizer("llama3" if arch == "llama" else "qwen2")
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    bos = tok.convert_tokens_to_ids(tok.bos_token) if tok.bos_token else None
    torch.manual_seed(seed)
    cfg = model_config(arch, len(tok) + 12, tied, eos, bos, hidden, rope)  # + unused rows, as real vocabularies have
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def make_run(run_dir: Path, base: Path, targets, modules_to_save=None, seed: int = 1, r: int = 4,
             data_format: str = "prompt_completion", **lora):
    """A run directory as training leaves it, with random (non-zero) LoRA weights; returns the PeftModel."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, modules_to_save=modules_to_save,
                     init_lora_weights=False, task_type="CAUSAL_LM", **lora)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # init_lora_weights=False leaves B random but small; make the change visible
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, 0.2)
            elif "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.1)
    peft_model.save_pretrained(run_dir / "adapter", safe_serialization=True)
    run_cfg = {"model": {"name_or_path": str(base)}, "data": {"format": data_format}}
    (run_dir / "adapter" / "rocktune_config.yaml").write_text(yaml.safe_dump(run_cfg))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(run_cfg))
    return peft_model.eval()


def build_spm_llama(out: Path, seed: int = 0, added: tuple[str, ...] = (), space_prefix: bool = True) -> Path:
    """A Llama 2-style model: SentencePiece BPE with byte fallback (tokenizer.model beside tokenizer.json);
    ``space_prefix=False``: a vocabulary that puts no space before the text, as Gemma's."""
    import io
    import json

    import sentencepiece as spm
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    out.mkdir(parents=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_writer=buf, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, split_digits=True, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity", add_dummy_prefix=space_prefix,
                                   minloglevel=2)
    (out / "tokenizer.model").write_bytes(buf.getvalue())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True}))
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": list(added)})  # chat fine-tunes add markers on top
    tok.save_pretrained(out)  # adds tokenizer.json, as hub checkpoints have
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=400 + len(added) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2, initializer_range=0.1, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


# task=vlm: LoRA on the language model and, opt-in, on a vision block and the projector (the mmproj carries them)
VLM_LM_TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.(q|v)_proj|mlp\.down_proj)"
VLM_TARGETS = rf"({VLM_LM_TARGETS}|.*visual\.blocks\.0\.attn\.qkv|.*visual\.merger\.mlp\.0)"
# Gemma 3 and SmolVLM/Idefics3 (language model text_model.* there): a SigLIP block's query and SmolVLM's connector
# (Gemma 3's projection is a bare parameter, no LoRA target)
SIGLIP_LM_TARGETS = r".*(language_model|text_model)\.layers\.\d+\.(self_attn\.(q|v)_proj|mlp\.down_proj)"
SIGLIP_TARGETS = (rf"({SIGLIP_LM_TARGETS}|.*(vision_tower|vision_model)\.encoder\.layers\.0\.self_attn\.q_proj"
                  r"|.*connector\.modality_projection\.proj)")


def make_vlm_run(run: Path, base: Path, targets: str = VLM_TARGETS):
    """A vlm run directory as training leaves it (random non-zero LoRA); returns the merged fp32 model."""
    import torch
    from peft import LoraConfig, get_peft_model

    from transformers import AutoConfig

    from rocktune.tasks.vlm.vision.model import model_class

    model = model_class(AutoConfig.from_pretrained(base)).from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(run / "adapter", safe_serialization=True)
    cfg = {"task": "vlm", "model": {"name_or_path": str(base)}}
    for where in (run / "adapter" / "rocktune_config.yaml", run / "config.yaml"):
        where.write_text(yaml.safe_dump(cfg))
    return peft_model.merge_and_unload().eval()
