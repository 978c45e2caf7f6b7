"""Tasks where an example's length gives its answer away, for the batch-order tests (tests/test_batch_order.py) and
benchmarks/batch_order.py: a class name is the answer, and the class names differ in length by a few tokens, so a
batch order that groups examples by length groups them by answer. The held-out rows are balanced (chance 0.25)."""

from __future__ import annotations

import json
import random
from pathlib import Path

# class -> its marker words; the answers are 3, 5, 7 and 9 characters long (one token each on the tiny model)
CLASSES = {"cat": ("zub", "qev", "wox"), "horse": ("jid", "kap", "fum"), "sparrow": ("lyt", "gon", "bir"),
           "crocodile": ("hes", "dav", "tuc")}
FILLER = ("ant", "bow", "cup", "dew", "elm", "fig", "gum", "hat", "ink", "jar", "key", "log", "mud", "nut", "oak",
          "pin", "rug", "sun", "tin", "urn", "van", "wig", "yam")
QUESTION = "Which animal does the marker name?"


def text_label_rows(n: int, rng: random.Random, balanced: bool) -> list[dict]:
    """``messages`` rows: five filler words with one class's marker among them, the class name as the answer."""
    names = sorted(CLASSES)
    rows = []
    for i in range(n):
        name = names[i % len(names)] if balanced else rng.choice(names)
        words = [rng.choice(FILLER) for _ in range(5)]
        words.insert(rng.randint(0, 5), rng.choice(CLASSES[name]))
        rows.append({"messages": [{"role": "user", "content": f"{QUESTION} {' '.join(words)}"},
                                  {"role": "assistant", "content": name}]})
    return rows


def write_text_label_task(folder: Path, n_train: int, n_eval: int, seed: int = 0) -> tuple[Path, Path]:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for name, n in (("train", n_train), ("eval", n_eval)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in text_label_rows(n, rng, balanced=name == "eval")))
        files.append(path)
    return files[0], files[1]


def lm_accuracy(model, tokenizer, eval_file: Path) -> float:
    """Greedy exact match of the answer, the prompt rendered by the model's chat template."""
    import torch

    rows = [json.loads(line) for line in eval_file.read_text().splitlines()]
    right = 0
    for row in rows:
        ids = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
        right += tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == \
            row["messages"][1]["content"]
    return right / len(rows)


def write_label_pairs(folder: Path, n_train: int, seed: int = 0) -> Path:
    """Preference pairs over the same task (TRL's conversational shape): the right class chosen, another rejected;
    the pair's length follows its chosen answer, so a length order groups pairs by answer too."""
    rng = random.Random(seed + 1)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for row in text_label_rows(n_train, rng, balanced=False):
        answer = row["messages"][1]["content"]
        wrong = rng.choice([c for c in sorted(CLASSES) if c != answer])
        rows.append({"prompt": row["messages"][:1], "chosen": [{"role": "assistant", "content": answer}],
                     "rejected": [{"role": "assistant", "content": wrong}]})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
