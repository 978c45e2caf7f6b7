"""The model families users fine-tune most, each as a tiny random model of its real transformers architecture with a
tokenizer that carries that family's chat-template shape (written here; the structure of each family's turns, not a
copy of a hub file). Built offline: transformers' own config classes, a byte-level tokenizer like demo/tiny.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tests.family_templates import GEMMA4, GLM45, HARMONY, LLAMA4, QWEN35

# Chat-template shapes, one per family convention. Gemma and Mistral have no system role (their templates refuse
# or fold it); the others accept one. Each turn ends in the family's end-of-turn special token.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# SmolLM3-style: ChatML whose assistant replies sit in {% generation %} markers (for return_assistant_tokens_mask)
CHATML_GENERATION = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
                     "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>"
                     "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
           "{{ raise_exception('this template has no system role') }}{% elif m['role'] == 'user' %}"
           "[INST] {{ m['content'] }}[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
         "{{ raise_exception('this template has no system role') }}{% endif %}"
         "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
         "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PHI3 = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
OLMO2 = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
         "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GRANITE = ("{% for m in messages %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}<|end_of_text|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}")


@dataclass(frozen=True)
class Template:
    text: str
    specials: tuple[str, ...]  # added special tokens, in id order after the 256 byte tokens
    eos: str
    end_of_turn: str | None    # the token that ends each assistant reply: the one that must be trained
    bos: str | None = None
    system: bool = True        # does the template take a system turn
    reply_head: str = ""       # what the template writes before the reply's text inside the trained reply
    trims: bool = False        # the template strips the reply's surrounding whitespace
    # the model's other stop tokens (its generation config's eos_token_id): GLM-4.5's template writes no end of turn,
    # the model ends a reply with the next turn's role token (<|user|>, <|observation|>), which it stops on
    stops: tuple[str, ...] = ()


TEMPLATES = {
    "chatml": Template(CHATML, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", "<|im_end|>"),
    "chatml-generation": Template(CHATML_GENERATION, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>",
                                  "<|im_end|>"),
    "llama3": Template(LLAMA3, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|eot_id|>"), "<|eot_id|>", "<|eot_id|>", bos="<|begin_of_text|>"),
    "mistral": Template(MISTRAL, ("<s>", "</s>", "[INST]", "[/INST]"), "</s>", "</s>", bos="<s>", system=False),
    "gemma": Template(GEMMA, ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<end_of_turn>",
                      "<end_of_turn>", bos="<bos>", system=False),
    "phi3": Template(PHI3, ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<|end|>",
                     "<|end|>"),
    "olmo2": Template(OLMO2, ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"), "<|endoftext|>",
                      "<|endoftext|>", bos="<|endoftext|>"),
    "granite": Template(GRANITE, ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"), "<|end_of_text|>",
                        "<|end_of_text|>"),
    "qwen3.5": Template(QWEN35, ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"),
                        "<|im_end|>", "<|im_end|>", reply_head="\n</think>\n\n", trims=True),
    "harmony": Template(HARMONY, ("<|endoftext|>", "<|startoftext|>", "<|start|>", "<|message|>", "<|channel|>",
                                  "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"), "<|return|>", "<|return|>",
                        reply_head="<|channel|>final<|message|>", stops=("<|endoftext|>", "<|call|>")),
    "llama4": Template(LLAMA4, ("<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>",
                                "<|eot|>"), "<|eot|>", "<|eot|>", bos="<|begin_of_text|>", trims=True),
    "gemma4": Template(GEMMA4, ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>",
                                "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>"), "<turn|>", "<turn|>",
                       bos="<bos>",
                       trims=True),
    "glm4.5": Template(GLM45, ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                               "<|observation|>"), "<|endoftext|>", "<|user|>", reply_head="\n<think></think>\n",
                       trims=True, stops=("<|user|>", "<|observation|>")),
}

DIMS = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "initializer_range": 0.1, "rms_norm_eps": 1e-6}


@dataclass(frozen=True)
class Family:
    name: str            # the id in the matrix (and in test ids)
    config_class: str    # transformers' config class of the real architecture
    template: str        # key of TEMPLATES
    extra: dict = field(default_factory=dict)  # the family's own traits on top of DIMS
    # What LoRA on "all-linear" adapts (module names, in every layer and outside them; the MoE experts' stacks
    # apart): every family states it, test_every_family_states_its_targets fails on one that does not.
    trained: tuple[str, ...] = ()
    moe: bool = False


MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
ATTN_ONLY = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE = ATTN_ONLY + ("gate_proj", "up_proj", "down_proj")
FAMILIES = [
    Family("llama3", "LlamaConfig", "llama3", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                                   "factor": 8.0, "low_freq_factor": 1.0,
                                                                   "high_freq_factor": 4.0,
                                                                   "original_max_position_embeddings": 128}}, DENSE),
    Family("qwen2.5", "Qwen2Config", "chatml", {"tie_word_embeddings": True}, DENSE),
    Family("qwen3", "Qwen3Config", "chatml", {"head_dim": 32, "tie_word_embeddings": True}, DENSE),
    # norm_topk_prob as in the released Qwen3 MoE checkpoints (transformers' default is off)
    Family("qwen3-moe", "Qwen3MoeConfig", "chatml", {"num_experts": 4, "head_dim": 16, "norm_topk_prob": True, **MOE},
           ATTN_ONLY, True),
    Family("mistral", "MistralConfig", "mistral", {"sliding_window": None}, DENSE),
    Family("mixtral", "MixtralConfig", "mistral", {"num_local_experts": 4, "num_experts_per_tok": 2}, ATTN_ONLY,
           True),
    Family("gemma2", "Gemma2Config", "gemma", {"head_dim": 16, "tie_word_embeddings": True,
                                               "query_pre_attn_scalar": 16, "sliding_window": 16,
                                               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}, DENSE),
    Family("gemma3", "Gemma3TextConfig", "gemma", {"head_dim": 16, "tie_word_embeddings": True,
                                                   "query_pre_attn_scalar": 16, "sliding_window": 16,
                                                   "final_logit_softcapping": 30.0}, DENSE),
    Family("phi3", "Phi3Config", "phi3", {"pad_token_id": None}, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    Family("smollm2", "LlamaConfig", "chatml", {"tie_word_embeddings": True}, DENSE),
    Family("smollm3", "SmolLM3Config", "chatml-generation", {"tie_word_embeddings": True, "pad_token_id": None},
           DENSE),
    Family("olmo2", "Olmo2Config", "olmo2", {"pad_token_id": None}, DENSE),
    Family("granite3", "GraniteConfig", "granite", {"embedding_multiplier": 12.0, "logits_scaling": 8.0,
                                                    "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
                                                    "tie_word_embeddings": True}, DENSE),
]
# The 2025-26 families (issue 53): two layers each, so the hybrids have one layer of each kind (linear attention or
# Mamba2 first, full attention second) and GLM-4.5 / Llama 4 one dense-MLP layer before an MoE one.
GATED_DELTANET = {"head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
                  "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                  "layer_types": ["linear_attention", "full_attention"]}
# Qwen3.5's interleaved multimodal rope, its sections scaled to the tiny head's 2 rotary pairs (llama.cpp asserts
# that the sections fit; the released [11, 11, 10] fit 256-wide heads)
QWEN35 = {**GATED_DELTANET, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                                "mrope_interleaved": True}}
# expert widths of 64: bitsandbytes' CPU nf4 kernel is wrong on rows of 32, and the QLoRA gate refuses such a model
SHARED = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
          "shared_expert_intermediate_size": 64}
LINEAR_ATTN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
FAMILIES += [
    Family("qwen3.5", "Qwen3_5TextConfig", "qwen3.5", QWEN35, LINEAR_ATTN + DENSE),
    # shared_expert_gate (hidden -> 1) is left out: a 1-wide gate, like the router
    Family("qwen3.5-moe", "Qwen3_5MoeTextConfig", "qwen3.5", {**QWEN35, **SHARED}, LINEAR_ATTN + DENSE, True),
    Family("qwen3-next", "Qwen3NextConfig", "chatml", {**GATED_DELTANET, **SHARED},
           ("in_proj_qkvz", "in_proj_ba", "out_proj") + DENSE, True),
    Family("gpt-oss", "GptOssConfig", "harmony", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                                 "sliding_window": 16,
                                                 "layer_types": ["sliding_attention", "full_attention"]},
           ATTN_ONLY, True),
    Family("glm4.5", "Glm4MoeConfig", "glm4.5", {"n_routed_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                                 "moe_intermediate_size": 64, "n_shared_experts": 1,
                                                 "first_k_dense_replace": 1, "partial_rotary_factor": 0.5},
           DENSE, True),
    Family("olmo3", "Olmo3Config", "chatml", {"pad_token_id": None, "sliding_window": 16,
                                              "layer_types": ["sliding_attention", "full_attention"]}, DENSE),
    # Llama 4's own chunk size and NoPE interval (llama.cpp's llama4 graph fixes both; export refuses others), and
    # 4 layers so that one is a NoPE layer (llama.cpp's graph fails on a model without one)
    Family("llama4", "Llama4TextConfig", "llama4", {"num_local_experts": 4, "num_experts_per_tok": 1, "head_dim": 16,
                                                    "intermediate_size": 64, "intermediate_size_mlp": 128,
                                                    "interleave_moe_layer_step": 2, "attention_chunk_size": 8192,
                                                    "no_rope_layer_interval": 4, "pad_token_id": None,
                                                    "num_hidden_layers": 4},
           DENSE, True),
    Family("granite4", "GraniteMoeHybridConfig", "granite",
           {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 64,
            "layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_state": 16, "mamba_d_head": 32,
            "mamba_chunk_size": 16, "position_embedding_type": "rope", "embedding_multiplier": 12.0,
            "logits_scaling": 8.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
            "tie_word_embeddings": True},
           ("in_proj", "out_proj", "input_linear", "output_linear") + ATTN_ONLY, True),
    # per-layer embeddings kept tiny: 300 x (2 layers x 8)
    Family("gemma4", "Gemma4TextConfig", "gemma4", {"head_dim": 16, "global_head_dim": 32, "sliding_window": 16,
                                                    "vocab_size_per_layer_input": 300,
                                                    "hidden_size_per_layer_input": 8,
                                                    "layer_types": ["sliding_attention", "full_attention"],
                                                    "rope_parameters": None, "tie_word_embeddings": True,
                                                    "final_logit_softcapping": 30.0},
           DENSE + ("per_layer_input_gate", "per_layer_projection", "per_layer_model_projection")),
]
BY_NAME = {f.name: f for f in FAMILIES}


def build_tokenizer(t: Template):
    """Byte-level BPE without merges (one token per byte, as demo/tiny.py) plus the family's special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from rocktune.demo.tiny import _byte_of

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in t.specials])
    if t.bos:  # families whose tokenizer adds BOS (Llama 3, Mistral, Gemma, OLMo 2)
        tok.post_processor = processors.TemplateProcessing(single=f"{t.bos} $A", pair=f"{t.bos} $A {t.bos} $B",
                                                           special_tokens=[(t.bos, tok.token_to_id(t.bos))])
    pad = t.specials[0] if t.specials[0] not in (t.bos, t.eos) else t.eos
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=t.eos, bos_token=t.bos, pad_token=pad,
                                   chat_template=t.text)


def family_config(fam: Family, tok):
    import transformers

    t = TEMPLATES[fam.template]
    eos = tok.convert_tokens_to_ids(t.eos)
    ids = {"eos_token_id": [eos, *tok.convert_tokens_to_ids(list(t.stops))] if t.stops else eos,
           "bos_token_id": tok.convert_tokens_to_ids(t.bos) if t.bos else None}
    kwargs = {**DIMS, "tie_word_embeddings": False, **ids, **fam.extra}
    if "rope_parameters" not in kwargs:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    return getattr(transformers, fam.config_class)(**kwargs)


def build_family(fam: Family, out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from rocktune.models.load import quiet_transformers

    quiet_transformers()
    tok = build_tokenizer(TEMPLATES[fam.template])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(fam, tok), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def chat_records(n: int, system: bool, seed: int = 0) -> list[dict]:
    """Conversations with a learnable reply (the demo task's), with a system turn where the template takes one."""
    from rocktune.demo.task import make_task

    rows, _ = make_task(n_train=n, n_eval=0, seed=seed)
    out = []
    for r in rows:
        msgs = [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
        out.append({"messages": ([{"role": "system", "content": "Be brief."}] if system else []) + msgs})
    return out


def trained_spans(tok, enc) -> list[str]:
    """The text of each run of loss-bearing tokens of an encoded example, in order."""
    from rocktune.data.encode import IGNORE

    spans, run = [], []
    for i, label in zip(enc.input_ids, enc.labels, strict=True):
        if label != IGNORE:
            run.append(i)
        elif run:
            spans, run = spans + [tok.decode(run)], []
    return spans + ([tok.decode(run)] if run else [])
