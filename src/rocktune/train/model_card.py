"""The adapter's own description: ``adapter/README.md`` (PEFT writes an empty model-card template there) and an
absolute base model path in ``adapter_config.json``, so the adapter loads from any directory.

Everything comes from the run's ``config.yaml`` and ``metrics.jsonl``, already written when the adapter is saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rocktune import task_registry
from rocktune.train.summary import read_figures


def describe_adapter(adapter_dir: Path, run_dir: Path) -> None:
    """Rewrite ``adapter_dir``'s README.md; a relative local base model (``runs/demo/base_model``) means this working
    directory, so the adapter's two records of it (``adapter_config.json``, ``rocktune_config.yaml``) are made
    absolute: ``generate`` or ``export`` run from elsewhere would otherwise look for it there, or on the hub."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    base = str(config.get("model", {}).get("name_or_path", ""))
    if base and not Path(base).is_absolute() and Path(base).expanduser().is_dir():
        base = str(Path(base).expanduser().resolve())
        _set_base(adapter_dir, base)
    (adapter_dir / "README.md").write_text(card(config, base, run_dir.resolve()), encoding="utf-8")


def _set_base(adapter_dir: Path, base: str) -> None:
    meta = adapter_dir / "adapter_config.json"
    if meta.is_file():
        data = json.loads(meta.read_text(encoding="utf-8"))
        data["base_model_name_or_path"] = base
        meta.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
    copy = adapter_dir / "rocktune_config.yaml"
    if copy.is_file():
        config = yaml.safe_load(copy.read_text(encoding="utf-8")) or {}
        config.setdefault("model", {})["name_or_path"] = base
        copy.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def _task(name: str) -> str:
    """The task and what it trains, from the registry (a run of a task since removed is named as it is)."""
    tasks = task_registry.TASKS
    return f"{name}: {tasks[name].summary}" if name in tasks else name


def card(config: dict, base: str, run_dir: Path) -> str:
    fig = read_figures(run_dir / "metrics.jsonl")
    lora, data, t = config.get("lora", {}), config.get("data", {}), config.get("training", {})
    evals = (f"{fig.eval_before:.4f} → {fig.eval_after:.4f}" if fig.eval_before is not None
             and fig.eval_after is not None else "not measured (no eval data)")
    length = f"{t.get('max_steps')} steps" if t.get("max_steps") else f"{t.get('epochs')} epochs"
    rows = [("base model", f"`{base}`"), ("task", _task(config.get("task", "lm"))),
            ("train data", f"`{data.get('train_file')}`"),
            ("eval data", f"`{data.get('eval_file')}`" if data.get("eval_file") else
             f"{data.get('eval_fraction', 0):g} of the train data held out" if data.get("eval_fraction") else "none"),
            ("LoRA", f"r={lora.get('r')}, alpha={lora.get('alpha')}, dropout={lora.get('dropout')}, "
                     f"target modules {lora.get('target_modules')}"),
            ("training", f"{length} (trained {fig.steps}), lr {t.get('lr')}, {t.get('micro_batch_size')} examples "
                         f"per micro-batch x {t.get('grad_accum')} accumulated, precision {t.get('precision')}"),
            ("eval loss before → after", evals)]
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    return (f"# LoRA adapter for {base}\n\nTrained by rocktune; the whole resolved config is `rocktune_config.yaml` "
            f"beside this file, the run's metrics are in `{run_dir / 'metrics.jsonl'}`.\n\n{table}\n"
            + _use_it(config, base, run_dir, data))


def _use_it(config: dict, base: str, run_dir: Path, data: dict) -> str:
    """How to load the adapter: the task's own lines (its registry row's ``card`` hook); a causal LM's for a task
    this version does not know."""
    row = task_registry.TASKS.get(config.get("task", "lm"))
    return task_registry.load(row.card)(base, run_dir, data) if row else load_lm(base, run_dir)


def load_lm(base: str, run_dir: Path) -> str:
    return (f"## Use it\n\n```bash\nrocktune generate {run_dir} --chat\nrocktune export {run_dir} --to gguf\n```\n\n"
            f"In Python (PEFT):\n\n```python\nfrom peft import PeftModel\n"
            f"from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"base = AutoModelForCausalLM.from_pretrained({base!r})\n"
            f"model = PeftModel.from_pretrained(base, {str(run_dir / 'adapter')!r})\n"
            f"tokenizer = AutoTokenizer.from_pretrained({base!r})\n```\n")
