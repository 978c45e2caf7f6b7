"""Token ids of many texts straight from the Rust tokenizer: the ids ``tokenizer(texts)["input_ids"]`` gives, without
the per-text Python objects transformers builds around them.

transformers' call turns each ``Encoding`` into a dict of lists (ids, attention mask, type ids) in Python: 2.2 s of
a 24 s profile of 20,000 Alpaca records, on top of the tokenizer's own offsets bookkeeping, which
``encode_batch_fast`` skips. The backend is called directly only in the state transformers' call would leave it in
(no truncation, no padding, special tokens split as the tokenizer says); any other tokenizer goes through the
ordinary call. ``tests/test_data_fast.py`` compares every record against ``encode.encode``, which uses that call.
"""

from __future__ import annotations


def token_ids(tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    backend = _plain_backend(tokenizer)
    if backend is None:
        return tokenizer(texts, add_special_tokens=special, return_attention_mask=False,
                         return_token_type_ids=False)["input_ids"]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=special)]


def _plain_backend(tokenizer):
    """The tokenizer's Rust backend where calling it gives what transformers' call would; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens != split:
        return None
    return backend
