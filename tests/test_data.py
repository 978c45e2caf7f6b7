import json
from pathlib import Path

import pytest

from rocktune.data import records
from rocktune.data.batching import BatchStream, collate, count_loss_tokens, epoch_batches
from rocktune.config import DataConfig
from rocktune.data.dataset import prepare_data, tokenize_file
from rocktune.data.encode import IGNORE, encode
from rocktune.errors import UserError
from tests.conftest import write_jsonl

EXAMPLE_DATA = Path(__file__).parent.parent / "examples" / "data"


def loss_text(tokenizer, enc) -> str:
    return tokenizer.decode([t for t, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE])


@pytest.mark.parametrize("name,shape", [("alpaca", "alpaca"), ("chat", "messages"), ("text", "text"),
                                        ("prompt_completion", "prompt_completion"), ("sharegpt_tools", "messages")])
def test_shipped_files_detected(name, shape):
    recs = records.read_records(EXAMPLE_DATA / f"{name}.jsonl")
    assert records.detect_shape(recs, "auto") == shape
    records.validate(recs, shape)


def test_prompt_completion_masks_prompt(tokenizer):
    enc = encode({"prompt": "reverse abc =", "completion": " cba"}, "prompt_completion", tokenizer, 64, False, "x")
    assert loss_text(tokenizer, enc) == " cba<|endoftext|>"
    assert tokenizer.decode(enc.input_ids) == "reverse abc = cba<|endoftext|>"
    assert enc.labels[: len("reverse abc =")] == [IGNORE] * len("reverse abc =")
    enc_all = encode({"prompt": "p", "completion": "c"}, "prompt_completion", tokenizer, 64, True, "x")
    assert IGNORE not in enc_all.labels


def test_alpaca_masks_template_and_instruction(tokenizer):
    rec = {"instruction": "Add.", "input": "1 and 2", "output": "3"}
    enc = encode(rec, "alpaca", tokenizer, 512, False, "x")
    assert loss_text(tokenizer, enc) == "3<|endoftext|>"
    assert "### Input:\n1 and 2" in tokenizer.decode(enc.input_ids)
    no_input = encode({"instruction": "Say hi.", "output": "hi"}, "alpaca", tokenizer, 512, False, "x")
    assert "### Input" not in tokenizer.decode(no_input.input_ids)


def test_text_is_all_loss(tokenizer):
    enc = encode({"text": "hello"}, "text", tokenizer, 64, False, "x")
    assert enc.labels == enc.input_ids and tokenizer.decode(enc.input_ids) == "hello<|endoftext|>"


def test_messages_loss_on_each_assistant_turn_only(tokenizer):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"}]
    enc = encode({"messages": msgs}, "messages", tokenizer, 512, False, "x")
    assert tokenizer.decode(enc.input_ids) == tokenizer.apply_chat_template(msgs, tokenize=False)
    assert loss_text(tokenizer, enc) == "A1<|im_end|>\nA2<|im_end|>\n"


def test_truncation_counted_and_empty_completions_dropped(tmp_path, tokenizer):
    rows = [{"prompt": "x" * 50, "completion": "y"}, {"prompt": "p", "completion": "long" * 20},
            {"prompt": "p", "completion": "ok"}]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    ex, stats = tokenize_file(str(f), DataConfig(max_length=20, truncation="end"), tokenizer, tmp_path / "cache")
    assert stats.n_truncated == 2 and stats.n_dropped == 1 and len(ex) == 2
    assert max(ex.lengths()) == 20


def test_cache_written_once_then_hit(tmp_path, tokenizer):
    f = EXAMPLE_DATA / "alpaca.jsonl"
    a, s1 = tokenize_file(str(f), DataConfig(max_length=512), tokenizer, tmp_path)
    b, s2 = tokenize_file(str(f), DataConfig(max_length=512), tokenizer, tmp_path)
    c, s3 = tokenize_file(str(f), DataConfig(max_length=400), tokenizer, tmp_path)
    assert (s1.cache_hit, s2.cache_hit, s3.cache_hit) == (False, True, False)
    assert a.input_ids == b.input_ids and a.labels == b.labels
    assert len([p for p in tmp_path.iterdir() if p.name != "sources"]) == 2  # sources: datasets' Arrow copy


def test_eval_fraction_split_is_seeded(tmp_path, tokenizer):
    f = EXAMPLE_DATA / "prompt_completion.jsonl"
    tr, ev, _ = prepare_data(DataConfig(train_file=str(f), eval_fraction=0.25, max_length=64), tokenizer, tmp_path, 3)
    tr2, ev2, _ = prepare_data(DataConfig(train_file=str(f), eval_fraction=0.25, max_length=64), tokenizer, tmp_path, 3)
    assert len(ev) == 10 and len(tr) == 30 and ev.input_ids == ev2.input_ids


BAD = [
    ("", "is empty"),
    ('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": \n', r"d\.jsonl:2: malformed JSON"),
    ('{"question": "a", "answer": "b"}\n', "unknown record shape"),
    ('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n', r"d\.jsonl:2: record is missing 'completion'"),
    ('{"prompt": "a", "completion": 3}\n', "'completion' must be a string"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}\n', "role tag 'wizard'"),
    ('{"messages": [{"role": "user", "content": "x"}]}\n', "no assistant turn"),
    ('{"messages": []}\n', "non-empty list"),
    ('[1, 2]', "must be a JSON object"),
]


@pytest.mark.parametrize("text,pattern", BAD)
def test_bad_data_is_explained(tmp_path, text, pattern):
    f = tmp_path / "d.jsonl"
    f.write_text(text)
    with pytest.raises(UserError, match=pattern):
        recs = records.read_records(f)
        records.validate(recs, records.detect_shape(recs, "auto"))


def test_missing_file():
    with pytest.raises(UserError, match="does not exist"):
        records.read_records("/nonexistent/train.jsonl")


def test_json_array_file(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"text": "a"}, {"text": 5}]))
    recs = records.read_records(f)
    with pytest.raises(UserError, match=r"d\.json\[1\]"):
        records.validate(recs, "text")


def test_length_order_covers_all_and_cuts_padding():
    """data.batch_order: length (the default is mixed: tests/test_batch_order.py)."""
    import random

    rng = random.Random(0)
    lengths = [rng.randint(5, 500) for _ in range(1000)]
    batches = epoch_batches(lengths, 8, seed=0, epoch=0, order="length")
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert batches == epoch_batches(lengths, 8, seed=0, epoch=0, order="length")
    assert batches != epoch_batches(lengths, 8, seed=0, epoch=1, order="length")
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    naive = sum(len(lengths[i:i + 8]) * max(lengths[i:i + 8]) for i in range(0, 1000, 8))
    assert padded / sum(lengths) < 1.1 < naive / sum(lengths)


def test_stream_position_resumes_same_batches():
    lengths = list(range(1, 51))
    def make(epoch):
        return epoch_batches(lengths, 4, 1, epoch)
    a = BatchStream(make)
    seq = [a.next() for _ in range(30)]  # crosses an epoch boundary (13 batches per epoch)
    b = BatchStream(make, epoch=1, index=4)
    assert [b.next() for _ in range(13)] == seq[17:30]


def test_collate_and_token_count():
    batch = collate([[1, 2, 3], [4]], [[IGNORE, 2, 3], [4]], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 2, 3], [4, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert count_loss_tokens(batch["labels"]) == 2
