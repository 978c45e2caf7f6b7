"""The update's forward with each prompt computed once for its group of completions (``grpo.share_prompt``).

A GRPO step scores G completions of every prompt. Under causal attention a prompt's hidden states and keys/values do
not depend on what follows it, so the G rows' prompt positions are G copies of one computation. Here each distinct
prompt of a forward (less its last token) runs once, with a KV cache; the cache is indexed out to every row of its
group (an ``index_select``, whose backward sums the rows' gradients into the one prompt computation, as the G copies'
gradients would have been summed through the shared weights); then every row runs from its prompt's last token over
its completion, at its own positions, attending to its prompt's keys through transformers' own cache and mask.

The log-probabilities are the full rows' (tests/test_grpo_prefix.py: each row's against the plain forward, the
adapter's gradients, the correctness matrix against PEFT's own forward over full rows); only rounding differs, as
matmuls of other shapes sum in another order. On the bench's steps (4 prompts of about 12 tokens, 8 completions of
up to 32 each) the decoder runs about 1,100 positions instead of 1,400.

What keeps it exact, and when it is not used (the plain forward instead):

- the model must be a decoder with a separate output head (``lm.loss.decoder_and_head``) whose every layer attends
  to every earlier position: a sliding window could drop prompt keys a completion needs, and a cache of another
  kind (sliding, hybrid, recurrent) is not indexed the same way; checked per model from its config, and the cache
  the prompt pass returns must be plain layers holding exactly the prompt positions, else that pass is dropped and
  the model takes the plain forward for the rest of the run;
- gradient checkpointing: transformers turns the cache off in training under it (and a recomputed layer would
  append to the cache again);
- LoRA dropout in training (``lora.dropout`` above 0): the full rows draw independent masks at a prompt's G copies,
  the prompt pass one mask for all of them, which is other noise;
- a forward where no prompt is shared (every row its own) or every prompt is one token long: nothing to save.
"""

from __future__ import annotations

import torch

from rocktune.tasks.causal.loss import decoder_and_head, target_logps

_ELIGIBLE = "_rocktune_prompt_sharing"  # per base model: whether its config allows the shared forward


def eligible(base) -> bool:
    """Whether ``base`` (the PEFT model's base) can run the shared forward now: every layer full causal attention and
    a decoder/head split (from the config, decided once and cached on the model), no gradient checkpointing, no LoRA
    dropout while training."""
    name = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # transformers 5.x's name; 4.x's only
    if getattr(base, name, False):
        return False
    known = getattr(base, _ELIGIBLE, None)
    if known is None:
        known = {"model": _full_attention(getattr(base, "config", None)) and decoder_and_head(base) is not None,
                 "dropout": _dropout(base)}
        setattr(base, _ELIGIBLE, known)
    return known["model"] and not (base.training and known["dropout"])


def _dropout(base) -> bool:
    """LoRA dropout draws a mask per row and position: the prompt pass would draw one for the whole group, a
    different (correlated) noise from the full rows' independent ones."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in base.modules())


def _full_attention(config) -> bool:
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(text, "layer_types", None)
    if kinds is not None:
        return all(k == "full_attention" for k in kinds)
    window = getattr(text, "sliding_window", None)
    return window is None or getattr(text, "use_sliding_window", True) is False


def cache_argument(model) -> str:
    """transformers 5.x names the KV cache ``cache`` (``past_key_values`` warns, and goes in 5.40); 4.x knows only
    ``past_key_values``."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def shared_logps(model, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor | None:
    """``token_logps`` of ``batch`` with each prompt computed once (module docstring); None when sharing saves
    nothing or does not apply (the caller runs the plain forward). ``batch`` carries ``prompt_length`` and
    ``prompt_group`` (feed.collate: one label per prompt; a forward cut by rows keeps the labels)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "prompt_group" not in batch or not eligible(base):
        return None
    ids, cmask, plen = batch["input_ids"], batch["completion_mask"], batch["prompt_length"]
    labels, inverse = torch.unique(batch["prompt_group"], return_inverse=True)
    prefix = int(plen.max()) - 1  # every prompt less its last token, right-padded to the longest
    if labels.numel() == ids.shape[0] or prefix < 1:
        return None
    rows = torch.arange(ids.shape[0], device=ids.device)
    first = torch.full_like(labels, ids.shape[0]).scatter_reduce(0, inverse, rows, "amin")  # a row of each prompt
    from transformers import DynamicCache

    decoder, head = decoder_and_head(base)
    cache, key = DynamicCache(), cache_argument(decoder)
    decoder(input_ids=ids.index_select(0, first)[:, :prefix], use_cache=True, **{key: cache})
    layers = getattr(cache, "layers", None)
    if not layers or any(type(x).__name__ != "DynamicLayer" for x in layers) or cache.get_seq_length() != prefix:
        getattr(base, _ELIGIBLE)["model"] = False  # a cache this forward does not know how to index: never again
        return None
    cache.reorder_cache(inverse)  # each row's copy of its prompt's keys and values (the backward sums them)
    lengths = cmask.sum(1)
    tokens, cols, positions, attention = _completion_rows(ids, plen, int(lengths.max()) + 1, prefix)
    hidden = decoder(input_ids=tokens, attention_mask=attention, position_ids=positions, use_cache=True,
                     **{key: cache}).last_hidden_state
    steps = torch.arange(cols.shape[1] - 1, device=ids.device)
    rows, at = (steps[None] < lengths[:, None]).nonzero(as_tuple=True)  # position j predicts completion token j + 1
    picked = target_logps(head, hidden[:, :-1][rows, at], tokens[:, 1:][rows, at], temperature)
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.float32, device=ids.device)
    return out.index_put((rows, cols[rows, at]), picked)


def _completion_rows(ids: torch.Tensor, plen: torch.Tensor, width: int, prefix: int):
    """The second pass's inputs: each row from its prompt's last token on (``width`` tokens), the row's columns in
    ``ids``, its positions (the same numbers: a row's positions are 0.. from its first prompt token) and the
    attention mask over [the prompt pass's ``prefix`` positions; these]: a row sees its own prompt, not the padding
    after a shorter one."""
    cols = (plen - 1)[:, None] + torch.arange(width, device=ids.device)[None]
    tokens = ids.gather(1, cols.clamp(max=ids.shape[1] - 1))  # past a row's end: its own pads or last token, unscored
    seen = torch.arange(prefix, device=ids.device)[None] < (plen - 1)[:, None]
    return tokens, cols, cols, torch.cat([seen.long(), torch.ones_like(tokens)], 1)
