"""One side of ``rocktune bench --suite moe``, in its own process: build an MoE shape at random init, put LoRA on it
(rocktune's way or HF + PEFT's ``target_parameters`` way), run warm-up and measured optimizer steps on one fixed
batch, and write the step times, losses and the peak memory as JSON.

``python -m rocktune.bench.moe_step SPEC.json RESULT.json``; SPEC: ``shape`` (a key of SHAPES), ``side``
(``rocktune`` | ``hf-peft``), ``device``, ``precision``, ``tokens`` (rows x length), ``warmup``, ``steps``, ``seed``.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

# The MoE shapes: the tiny Qwen3-MoE of the tests, and one layer of Qwen3-30B-A3B's real shape (hidden 2048, 128
# experts, top-8, expert width 768, 32 heads of 128, 4 KV heads) with a small vocabulary: the experts are the cost.
SHAPES = {
    "tiny-moe": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "intermediate_size": 128, "vocab_size": 300},
    "qwen3-30b-a3b-layer": {"hidden_size": 2048, "num_hidden_layers": 1, "num_attention_heads": 32,
                            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                            "moe_intermediate_size": 768, "intermediate_size": 6144, "vocab_size": 1024},
}
LORA = {"r": 16, "alpha": 32}


def build(spec: dict):
    """The model with LoRA on every linear but the head and on both expert stacks, the router frozen (rocktune's
    all-linear for MoE), as each side builds it; returns the model and the path note."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from rocktune.models.load import DTYPES, apply_lora, lora_targets

    torch.manual_seed(spec["seed"])
    config = transformers.Qwen3MoeConfig(**SHAPES[spec["shape"]], norm_topk_prob=True, use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPES[spec["precision"]])
    model = model.to(spec["device"])
    if spec["side"] == "rocktune":
        from rocktune.lora import moe
        from rocktune.lora.lean import lean_lora

        model = apply_lora(model, LORA["r"], LORA["alpha"], 0.0, "all-linear", False)
        return model, "; ".join(n for n in (moe.expert_path_note(model), lean_lora(model)) if n)
    targets, experts = lora_targets(model, "all-linear")  # the same modules and stacks, PEFT's forward throughout
    config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=targets, target_parameters=experts,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config), "PEFT target_parameters (ParamWrapper), transformers' default experts"


def _peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> dict:
    """The process's peak: the device's allocator peak on a GPU, the resident set's high-water mark on a CPU."""
    if device.startswith("cuda"):
        return {"peak_bytes": torch.cuda.max_memory_allocated(), "source": "torch.cuda.max_memory_allocated"}
    return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "source": "ru_maxrss"}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run(spec: dict) -> dict:
    model, note = build(spec)
    model.train()
    built = _rss() if not spec["device"].startswith("cuda") else torch.cuda.memory_allocated()
    rows, length = spec["tokens"]
    ids = torch.randint(0, SHAPES[spec["shape"]]["vocab_size"], (rows, length),
                        generator=torch.Generator().manual_seed(spec["seed"] + 1)).to(spec["device"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    autocast = torch.autocast(spec["device"].split(":")[0], dtype=torch.bfloat16,
                              enabled=spec["precision"] == "bf16")
    _peak_reset(spec["device"])
    losses, times = [], []
    for _ in range(spec["warmup"] + spec["steps"]):
        start = time.perf_counter()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if spec["device"].startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    measured = sorted(times[spec["warmup"]:])
    step_s = measured[len(measured) // 2]
    useful = rows * (length - 1)  # every position but the last carries loss
    return {"side": spec["side"], "shape": spec["shape"], "path": note, "losses": losses, "step_s": step_s,
            "tokens_per_s": useful / step_s, "useful_tokens_per_step": useful,
            "step_times_s": times, "adapter_parameters": sum(p.numel() for p in params),
            "model_bytes": built, **_peak(spec["device"])}


def main() -> None:
    spec_file, result_file = sys.argv[1:3]
    with open(spec_file) as f:
        spec = json.load(f)
    try:
        result = {"status": "ok", **run(spec)}
    except Exception as exc:  # noqa: BLE001 -- the driver reports any failure of a side as that side's result
        result = {"status": "error", "side": spec["side"], "reason": f"{type(exc).__name__}: {exc}"}
    with open(result_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
