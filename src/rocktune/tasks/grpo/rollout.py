"""Rollouts on rocktune's own generation path: G sampled completions per prompt, batched, with the adapter on.

One batch of left-padded prompts, one prefill, then one token per forward from the KV cache (transformers'
``DynamicCache``), the head applied to the last position only. Sampling draws from a ``torch.Generator`` of its own,
whose state a checkpoint keeps, so a resumed run samples the very completions an uninterrupted one would. A
completion ends at its first stop token (EOS, the end-of-turn tokens) included, at a stop string, or at
``max_new_tokens``. vLLM is never needed.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy (the held-out evaluation)
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


def pick(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row from its last-position logits."""
    if s.temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        ordered, order = logits.sort(-1, descending=True)
        beyond = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1) >= s.top_p  # keep the first past top_p
        logits = logits.masked_fill(beyond.scatter(-1, order, beyond), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample(model, prompts: list[tuple[int, ...]], s: Sampling, pad_id: int, generator, decode=None) -> list[list[int]]:
    """Completion token ids for each prompt (one row each: repeat a prompt G times for G completions). ``decode``
    (ids -> text) is needed only with stop strings."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, rows, cache_key = DynamicCache(), len(prompts), _cache_argument(model)
    stops = torch.tensor(s.stop_ids or [-1], device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    out = torch.full((rows, s.max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    step_ids = ids
    for t in range(s.max_new_tokens):
        logits = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, **{cache_key: cache},
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        token = torch.where(done, pad_id, pick(logits, s, generator))
        out[:, t] = token
        lengths += (~done).long()
        done = done | torch.isin(token, stops)
        if s.stop_strings:
            done = done | _stopped(out[:, : t + 1], lengths, s.stop_strings, decode, done)
        if bool(done.all()):  # one host sync per token: generation cannot run ahead of its own stop test
            break
        step_ids, positions = token[:, None], positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
    return [row[:n] for row, n in zip(out.tolist(), lengths.tolist())]


def _cache_argument(model) -> str:
    """transformers 5.x names the KV cache ``cache`` (``past_key_values`` warns, and goes in 5.40); 4.x knows only
    ``past_key_values``."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _stopped(out: torch.Tensor, lengths: torch.Tensor, stop_strings: tuple[str, ...], decode, done) -> torch.Tensor:
    """Rows whose text now contains a stop string (the string's last token is the completion's last)."""
    hit = [not d and any(x in decode(row[:n]) for x in stop_strings)
           for row, n, d in zip(out.tolist(), lengths.tolist(), done.tolist())]
    return torch.tensor(hit, device=out.device)


def new_generator(device: str, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def generator_state(gen: torch.Generator) -> str:
    """The sampler's state as base64 text: a checkpoint's JSON keeps it."""
    return base64.b64encode(gen.get_state().numpy().tobytes()).decode()


def set_generator_state(gen: torch.Generator, text: str) -> None:
    gen.set_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone())
