"""Rollouts on rocktune's own generation path: G sampled completions per prompt, batched, with the adapter on.

One batch of left-padded prompts, one prefill, then one token per forward from the KV cache (transformers'
``DynamicCache``; or, with ``grpo.compile_rollout``, a compiled step over a ``StaticCache``), the head applied to the
last position only. Each row samples with uniforms of its own (``draws``: one per token, inverse-CDF sampling), which
the task derives from the seed, the step and the row's prompt and generation number: what a row samples does not
depend on which rows share its batch, its OOM piece or its rank, so a resumed run and a run over several ranks sample
the very completions one uninterrupted process would. A completion ends at its first stop token (EOS, the end-of-turn
tokens) included, at a stop string, or at ``max_new_tokens``. vLLM is never needed.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, cast

import torch

from rocktune.tasks.grpo.prefix import cache_argument, eligible


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy (the held-out evaluation)
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


def pick(logits: torch.Tensor, s: Sampling, draws: torch.Tensor | None) -> torch.Tensor:
    """The next token of each row from its last-position logits; ``draws``: one uniform in [0, 1) per row, the point
    of the row's cumulative distribution whose token it takes (float64, so the sum over a large vocabulary keeps
    every token's share)."""
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
    probs = logits.softmax(-1).double()
    cdf = probs.cumsum(-1)
    at = torch.searchsorted(cdf, (cast(torch.Tensor, draws).to(cdf) * cdf[:, -1])[:, None], right=True).squeeze(-1)
    # a draw rounded onto the total would land past the last token that can be picked: it takes that one
    width = probs.shape[-1]
    last = width - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(at, last)


def row_draws(keys: list[int], max_new_tokens: int) -> torch.Tensor:
    """The uniforms each row samples with [rows, max_new_tokens], each row's from a CPU generator seeded by its own
    key: the same numbers on every device and in every batch."""
    return torch.stack([torch.rand(max_new_tokens, dtype=torch.float64,
                                   generator=torch.Generator().manual_seed(k)) for k in keys]) if keys else \
        torch.zeros(0, max_new_tokens, dtype=torch.float64)


@torch.no_grad()
def sample(model, prompts: list[tuple[int, ...]], s: Sampling, pad_id: int, draws, decode=None,
           static: StaticDecode | None = None) -> list[list[int]]:
    """Completion token ids for each prompt (one row each: repeat a prompt G times for G completions). ``draws``:
    each row's uniforms [rows, max_new_tokens] (``row_draws``), a ``torch.Generator`` to draw them from, or None
    (greedy only). ``decode`` (ids -> text) is needed only with stop strings; ``static``: decode from its compiled
    step and static cache (where the rows fit it) instead of eagerly from a growing cache."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    fits = static is not None and width + s.max_new_tokens <= static.max_len
    steps = cast(StaticDecode, static).begin(mask, positions) if fits else _Eager(model, mask, positions)
    rows = len(prompts)
    if isinstance(draws, torch.Generator):
        draws = torch.rand((rows, s.max_new_tokens), dtype=torch.float64, generator=draws, device=draws.device)
    if draws is not None:
        draws = draws.to(device)
    stops = torch.tensor(s.stop_ids or [-1], device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    out = torch.full((rows, s.max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    logits = steps.first(ids)
    for t in range(s.max_new_tokens):
        token = torch.where(done, pad_id, pick(logits, s, draws[:, t] if draws is not None else None))
        out[:, t] = token
        lengths += (~done).long()
        done = done | torch.isin(token, stops)
        if s.stop_strings:
            done = done | _stopped(out[:, : t + 1], lengths, s.stop_strings, decode, done)
        if t + 1 == s.max_new_tokens or bool(done.all()):  # one host sync per token: generation cannot run ahead
            break                                           # of its own stop test
        logits = steps.next(token)
    return [row[:n] for row, n in zip(out.tolist(), lengths.tolist())]


class _Eager:
    """Decoding from transformers' ``DynamicCache``, which grows by a position per token, as does the mask."""

    def __init__(self, model, mask: torch.Tensor, positions: torch.Tensor):
        from transformers import DynamicCache

        self.model, self.mask, self.positions = model, mask, positions
        self.cache, self.key = DynamicCache(), cache_argument(model)

    def first(self, ids: torch.Tensor) -> torch.Tensor:
        shared = shared_prefill(self.model, ids, self.mask, self.positions)
        if shared is None:
            return self._run(ids)
        logits, self.cache = shared
        return logits

    def next(self, token: torch.Tensor) -> torch.Tensor:
        self.positions = self.positions[:, -1:] + 1
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], -1)
        return self._run(token[:, None])

    def _run(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=self.mask, position_ids=self.positions,
                          **{self.key: self.cache}, use_cache=True, logits_to_keep=1).logits[:, -1]


class StaticDecode:
    """The rollout's decode step (one token per row) under ``torch.compile`` with static shapes, over transformers'
    ``StaticCache`` of ``max_len`` positions (the longest prompt plus max_new_tokens): the step's tensors never
    change shape, so it compiles once per batch size and then runs as a few generated kernels instead of hundreds
    of eager ops and module calls. The prompt's prefill runs eagerly (its width changes from step to step). The
    mask covers all ``max_len`` positions from the start; the causal mask hides those not yet written. A compile
    that fails falls back to the same step run eagerly, with a note (``fallback``)."""

    def __init__(self, model, max_len: int):
        self.model, self.max_len, self.key = model, max_len, cache_argument(model)
        self.caches: dict[int, Any] = {}
        self.compiled = torch.compile(self._step, dynamic=False, options=compile_options(model))
        self.fallback: str | None = None

    def _step(self, ids, mask, positions, where, cache) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache_position=where,
                          **{self.key: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]

    def _cache(self, rows: int):
        from transformers import StaticCache

        cache = self.caches.get(rows)
        if cache is None:
            cache = self.caches[rows] = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        else:
            cache.reset()
        return cache

    def begin(self, mask: torch.Tensor, positions: torch.Tensor) -> _Static:
        full = torch.cat([mask, mask.new_ones(mask.shape[0], self.max_len - mask.shape[1])], -1)
        return _Static(self, full, positions, self._cache(mask.shape[0]))

    def run(self, *args) -> torch.Tensor:
        if self.fallback is None:
            try:
                return self.compiled(*args)
            except Exception as exc:  # noqa: BLE001 -- any compiler failure: the eager step computes the same
                from rocktune.train.oom import is_out_of_memory

                if is_out_of_memory(exc):
                    raise
                self.fallback = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return self._step(*args)


class _Static:
    """One ``sample`` call's decoding through a ``StaticDecode``."""

    def __init__(self, owner: StaticDecode, mask: torch.Tensor, positions: torch.Tensor, cache):
        self.owner, self.mask, self.cache = owner, mask, cache
        self.positions, self.at = positions, positions.shape[1]

    def first(self, ids: torch.Tensor) -> torch.Tensor:
        """The prompts' prefill, eager: its width is the step's longest prompt. Each distinct prompt once where a
        group repeats it (``shared_prefill``), its keys and values then written to every row's place in the static
        cache."""
        where = torch.arange(self.at, device=ids.device)
        shared = shared_prefill(self.owner.model, ids, self.mask[:, : self.at], self.positions)
        if shared is None:
            logits = self.owner._step(ids, self.mask, self.positions, where, self.cache)
        else:
            logits, rows = shared
            for i, layer in enumerate(rows.layers):
                self.cache.update(layer.keys, layer.values, i, {"cache_position": where})
        self.positions = self.positions[:, -1:]
        return logits

    def next(self, token: torch.Tensor) -> torch.Tensor:
        self.positions = self.positions + 1
        where = torch.tensor([self.at], device=token.device)
        self.at += 1
        return self.owner.run(token[:, None], self.mask, self.positions, where, self.cache)


def compile_options(model) -> dict | None:
    """On a CPU, Inductor's C++ wrapper (``cpp_wrapper``): the compiled step calls its kernels and matmuls from
    generated C++ rather than from a generated Python function, which on a model this small is much of a token's
    time (docs/rl.md, Speed: the rollout about a sixth shorter, the same completions; the compile takes longer).
    Elsewhere Inductor's defaults: not measured there."""
    return {"cpp_wrapper": True} if next(model.parameters()).device.type == "cpu" else None


def shared_prefill(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
    """The prompts' prefill with each distinct prompt computed once (a step repeats each prompt for its G
    completions): (every row's last-position logits, a ``DynamicCache`` indexed out to every row); None where no
    row repeats another or the model's cache is not plain full attention (tasks/grpo/prefix.py's test), for the
    caller's own prefill. A row's keys, values and logits are its prompt's, as the full batch computes them."""
    from transformers import DynamicCache

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    rows, index = torch.unique(torch.cat([ids, mask], 1), dim=0, return_inverse=True)  # the mask tells pads apart
    if rows.shape[0] == ids.shape[0] or not eligible(base):
        return None
    every = torch.arange(ids.shape[0], device=ids.device)
    first = torch.full((rows.shape[0],), ids.shape[0], device=ids.device).scatter_reduce(0, index, every, "amin")
    cache = DynamicCache()
    logits = model(input_ids=ids[first], attention_mask=mask[first], position_ids=positions[first],
                   **{cache_argument(model): cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
    if any(type(x).__name__ != "DynamicLayer" for x in cache.layers):
        return None
    cache.reorder_cache(index)
    return logits.index_select(0, index), cache


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
