"""The routers of a mixture-of-experts model: which modules they are, and what one call of each decided.

transformers 5 gives every MoE family a router module of its own class (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``,
``GptOssTopKRouter``, ``Glm4MoeTopkRouter``, ``Qwen3_5MoeTopKRouter``, ``Llama4Router``, ...): the class name ends in
``Router``, and its output holds the router logits (tokens x experts) and, for all but Llama 4, the chosen experts'
indices (tokens x top-k). Llama 4's returns (scores, logits) and picks the top-k of the logits itself.
"""

from __future__ import annotations

import torch

from rocktune.errors import UserError


def is_router(module) -> bool:
    return type(module).__name__.endswith("Router")


def router_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every router, in layer order. A router PEFT wraps to train it
    (``modules_to_save``) appears as its trained copy, the one that runs."""
    return [(name, m) for name, m in model.named_modules() if is_router(m) and ".original_module" not in name]


def router_names(model) -> list[str]:
    """The routers' names as PEFT's ``modules_to_save`` matches them (the last two parts, e.g. ``mlp.gate``,
    ``feed_forward.router``): a name ending in ``gate`` alone would also catch Qwen3.5's ``shared_expert_gate``."""
    return sorted({".".join(name.split(".")[-2:]) for name, _ in router_modules(model)})


def refuse_train_router(model) -> None:
    if not router_modules(model):
        raise UserError(f"lora.train_router: true, but {type(model).__name__} has no mixture-of-experts router; "
                        "set lora.train_router: false (it applies to MoE models only).")


def routing(module, output, args: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, chosen experts) of one router call, detached: logits (tokens x experts), indices (tokens x top-k).
    ``args``: the call's inputs, for a router that returns no logits (transformers 4's GLM-4.5 returns the top-k
    indices and weights only): its logits are recomputed from its input and weight, as it computed them."""
    tensors = [t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)]
    experts = num_experts(module)
    floats = [t for t in tensors if t.is_floating_point() and t.shape[-1] == experts]
    if floats:
        logits = (floats[-1] if type(module).__name__ == "Llama4Router" else floats[0]).detach().reshape(-1, experts)
    else:
        hidden = args[0].detach()
        logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(), module.weight.float(),
                                            None if getattr(module, "bias", None) is None else module.bias.float())
    chosen = [t for t in tensors if not t.is_floating_point()]
    indices = chosen[0].detach().reshape(logits.shape[0], -1) if chosen else logits.topk(top_k(module), -1).indices
    return logits, indices


def num_experts(module) -> int:
    return int(getattr(module, "num_experts", 0) or module.weight.shape[0])


def top_k(module) -> int:
    return int(module.top_k)
