"""The training-correctness matrix: every optimizer the config accepts, every LoRA side path, eager and compiled,
fp32 and bf16 autocast, gradient checkpointing on and off — three optimizer steps of each against the reference
(PEFT's own forward, eager, torch's single-tensor AdamW) on the same model, batch and seed: losses and adapter
movement within rocktune.lora.check.TOLERANCE, every adapter tensor with a gradient at the first step.

It exists because a fast path once trained nothing on the GPUs' defaults while the suite stayed green: torch's
fused AdamW does not bump the version counters a cast cache trusted, and torch 2.11's compiled graph gave the
adapter zero gradients (an in-place add inside the fused node). The mutants at the end prove that each of those
failures would fail this matrix.
"""

from __future__ import annotations

import itertools
import typing

import pytest
import torch

from rocktune.lora import lean as lean_lora
from rocktune.lora import moe as moe_lora
from rocktune.lora import check as lora_check
from rocktune.config import TrainingConfig
from rocktune.models.load import apply_lora, load_model
from rocktune.platform.stack import compile_refusal
from rocktune.train import build

OPTIMIZERS = ("adamw_fused", "adamw_foreach", "adamw_torch")
SIDE_PATHS = ("peft", "lean", "fused")
PRECISIONS = ("fp32", "bf16")
STEPS, LR = 3, 1e-2

pytestmark = pytest.mark.torches  # on every torch users run too (make test-torches)


def test_the_matrix_covers_every_optimizer_and_side_path():
    """Adding an optimizer to the config or a side path to lean_lora without entering it here fails."""
    accepted = set(typing.get_args(TrainingConfig.model_fields["optimizer"].annotation)) - {"auto"}
    assert accepted == set(OPTIMIZERS)
    assert set(lean_lora.SIDE_PATHS) == set(SIDE_PATHS)
    assert set(moe_lora.EXPERT_PATHS) == {"peft", *EXPERT_PATHS}  # the MoE rows below
    for device in ("cpu", "cuda"):  # what "auto" resolves to is one of them (the GPU's default: fused)
        opt = build.optimizer([torch.nn.Parameter(torch.zeros(1))], "auto", 1e-3, 0.0, device)
        assert opt.defaults.get("fused") or opt.defaults.get("foreach")


def _batch() -> torch.Tensor:
    return torch.randint(5, 60, (2, 32), generator=torch.Generator().manual_seed(3))


def _loss(model):
    ids = _batch()
    return model(input_ids=ids, labels=ids).loss


def build_model(model_dir, precision: str, checkpointing: bool, path: str, backend: str | None = None,
                experts: str = "grouped"):
    """The tiny model as a run builds it (rocktune's loader and LoRA), with lora_B non-zero so that A gets a
    gradient at the first step too, then the side path and the compiled decoder under test. ``experts``: the MoE
    expert path (an MoE model's reference is built with PEFT's, ``peft``; a dense model has none)."""
    torch.manual_seed(0)
    model = apply_lora(load_model(str(model_dir), precision, "sdpa", False, "cpu"), 8, 16, 0.0, "all-linear",
                       checkpointing, experts=experts)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    lean_lora.patch(model, path)
    if backend:
        model.get_base_model().get_decoder().compile(backend=backend)
    model.train()
    return model


def _trace(model, optimizer, precision: str) -> lora_check.Trace:
    return lora_check.train_trace(model, _loss, optimizer, STEPS, build.autocast("cpu", precision))


_REFERENCE: dict = {}


def reference(model_dir, precision: str) -> lora_check.Trace:
    key = (str(model_dir), precision)
    if key not in _REFERENCE:
        model = build_model(model_dir, precision, False, "peft", experts="peft")
        opt = lora_check.reference_optimizer(list(lora_check.adapter_params(model).values()), LR)
        _REFERENCE[key] = _trace(model, opt, precision)
        ref = _REFERENCE[key]
        assert ref.losses[-1] < ref.losses[0] - 0.05, ref.losses  # the reference itself learns on this batch
        assert all(g > 0 for g in ref.first_grads.values())
    return _REFERENCE[key]


def run_case(model_dir, optimizer: str, path: str, precision: str, checkpointing: bool,
             backend: str | None = None, experts: str = "grouped") -> list[lora_check.Problem]:
    model = build_model(model_dir, precision, checkpointing, path, backend, experts)
    opt = build.optimizer(list(lora_check.adapter_params(model).values()), optimizer, LR, 0.0, "cpu")
    try:
        got = _trace(model, opt, precision)
    finally:
        if backend:
            torch._dynamo.reset()
    return lora_check.compare(got, reference(model_dir, precision), precision)


EAGER = list(itertools.product(OPTIMIZERS, SIDE_PATHS, PRECISIONS, (False, True)))


@pytest.mark.parametrize("optimizer,path,precision,checkpointing", EAGER,
                         ids=["-".join(map(str, c)).replace("True", "ckpt").replace("False", "nockpt") for c in EAGER])
def test_eager(tiny_model_dir, optimizer, path, precision, checkpointing):
    assert run_case(tiny_model_dir, optimizer, path, precision, checkpointing) == []


# Compiled (Dynamo + AOTAutograd: where a graph may drop an input; ``aot_eager`` keeps the CPU suite in seconds per
# case): every optimizer with every side path once, precision and checkpointing rotating so that each pairs with
# each optimizer and each side path.
COMPILED = [(opt, path, PRECISIONS[(i + j) % 2], bool(j % 2 == i % 2))
            for i, opt in enumerate(OPTIMIZERS) for j, path in enumerate(SIDE_PATHS)]


@pytest.mark.slow  # nine compilations of the 2-layer decoder: about a minute on 2 shared cores
@pytest.mark.parametrize("optimizer,path,precision,checkpointing", COMPILED,
                         ids=["-".join(map(str, c)).replace("True", "ckpt").replace("False", "nockpt")
                              for c in COMPILED])
def test_compiled(tiny_model_dir, optimizer, path, precision, checkpointing):
    refused = compile_refusal(torch.__version__)  # a run on this torch trains eager, saying why
    if refused:
        pytest.skip(f"torch {torch.__version__}: {refused}")
    assert run_case(tiny_model_dir, optimizer, path, precision, checkpointing, "aot_eager") == []


def test_the_compiled_cases_pair_every_value():
    pairs = {(c[0], c[2]) for c in COMPILED} | {(c[1], c[2]) for c in COMPILED}
    pairs |= {(c[0], c[3]) for c in COMPILED} | {(c[1], c[3]) for c in COMPILED}
    for values, others in ((OPTIMIZERS, PRECISIONS), (SIDE_PATHS, PRECISIONS), (OPTIMIZERS, (False, True)),
                           (SIDE_PATHS, (False, True))):
        assert {(a, b) for a in values for b in others} <= pairs


@pytest.mark.long  # Inductor compiles C++ kernels for the decoder: minutes on 2 cores
@pytest.mark.parametrize("precision", PRECISIONS)
def test_inductor_fused_path_with_the_gpu_default_optimizer(tiny_model_dir, precision):
    """The GPU's default run: the fused side path compiled by Inductor, fused AdamW."""
    assert run_case(tiny_model_dir, "adamw_fused", "fused", precision, False, "inductor") == []


# MoE: the expert stacks' LoRA on the routed tokens (rocktune.lora.moe) against PEFT's target_parameters
# parametrization, on a tiny Qwen3-MoE (4 experts, top-2 with weights; the dense linears take the side path too):
# every optimizer, precision and checkpointing eager, and a compiled case per optimizer.
EXPERT_PATHS = ("grouped",)
MOE_EAGER = list(itertools.product(OPTIMIZERS, EXPERT_PATHS, PRECISIONS, (False, True)))


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    import transformers

    from tests.family_fixtures import BY_NAME, build_family

    if int(transformers.__version__.split(".")[0]) < 5:  # an older torch's stack (make test-torches)
        pytest.skip(f"transformers {transformers.__version__} keeps each expert an nn.Linear (the 3-D expert stacks "
                    "came with 5.0): PEFT adapts them as Linears, the grouped expert path has no stack to act on")
    return build_family(BY_NAME["qwen3-moe"], tmp_path_factory.mktemp("moe") / "model")


@pytest.mark.parametrize("optimizer,experts,precision,checkpointing", MOE_EAGER,
                         ids=["-".join(map(str, c)).replace("True", "ckpt").replace("False", "nockpt")
                              for c in MOE_EAGER])
def test_moe_experts_eager(moe_model_dir, optimizer, experts, precision, checkpointing):
    assert run_case(moe_model_dir, optimizer, "fused", precision, checkpointing, experts=experts) == []


MOE_COMPILED = [(opt, "grouped", PRECISIONS[i % 2], bool(i % 2)) for i, opt in enumerate(OPTIMIZERS)]


@pytest.mark.slow  # three compilations of the MoE decoder
@pytest.mark.parametrize("optimizer,experts,precision,checkpointing", MOE_COMPILED,
                         ids=["-".join(map(str, c)).replace("True", "ckpt").replace("False", "nockpt")
                              for c in MOE_COMPILED])
def test_moe_experts_compiled(moe_model_dir, optimizer, experts, precision, checkpointing):
    refused = compile_refusal(torch.__version__)
    if refused:
        pytest.skip(f"torch {torch.__version__}: {refused}")
    assert run_case(moe_model_dir, optimizer, "fused", precision, checkpointing, "aot_eager", experts) == []


# Mutants: the two failures that reached users, put back by hand; the matrix must see each with its cause.

def test_a_stale_adapter_cast_fails_the_matrix(tiny_model_dir, monkeypatch):
    from rocktune.lora import fused as lora_fused

    frozen: dict = {}
    real = lora_fused._adapter_casts

    def stale(plan, a_params, b_params, dtype):  # the first casts, kept: what a never-invalidated cache did
        key = id(a_params[0])
        if key not in frozen:
            frozen[key] = [t.detach().clone() for t in (lambda a, b: (a, *b))(*real(plan, a_params, b_params, dtype))]
        a, *bs = frozen[key]
        return a, bs

    monkeypatch.setattr(lora_fused, "_adapter_casts", stale)
    problems = run_case(tiny_model_dir, "adamw_fused", "fused", "fp32", False)
    assert {p.cause for p in problems} >= {"stale", "mismatch"}, problems


def test_gradients_a_compiler_drops_fail_the_matrix(tiny_model_dir, monkeypatch):
    from rocktune.lora import fused as lora_fused

    real = lora_fused.FusedLoRA.backward

    def dropped(ctx, *dys):  # what the 2.11 graph computed: the input gradient, nothing for A and B
        grads = real(ctx, *dys)
        return (*grads[:2], *[None if g is not None and i % 4 >= 2 else g for i, g in enumerate(grads[2:])])

    monkeypatch.setattr(lora_fused.FusedLoRA, "backward", staticmethod(dropped))
    problems = run_case(tiny_model_dir, "adamw_foreach", "fused", "fp32", False)
    assert "no-gradient" in {p.cause for p in problems}, problems


def test_expert_factors_cut_from_the_graph_fail_the_matrix(moe_model_dir, monkeypatch):
    """The grouped expert path with its LoRA factors detached (the experts' adapters would train nothing): the MoE
    rows see it, so a grouped path that stops learning cannot pass them."""
    from rocktune.lora import moe

    real = moe.factors

    def detached(wrapper, transposed):
        f = real(wrapper, transposed)
        return moe.Factors(f.a.detach(), f.b.detach(), f.scaling)

    monkeypatch.setattr(moe, "factors", detached)
    problems = run_case(moe_model_dir, "adamw_foreach", "fused", "fp32", False, experts="grouped")
    assert {"no-gradient", "mismatch"} <= {p.cause for p in problems}, problems


# GRPO's update with each prompt computed once for its group (grpo.share_prompt, tasks/grpo/prefix.py): every
# optimizer, side path and precision against the same reference (PEFT's own forward, plain AdamW) over full rows.
# The sampling policy's log-probabilities are held fixed, so the ratio moves as the adapter learns and the loss falls
# (until the clip holds it: an unclipped ratio grows exponentially and turns bf16's rounding into percent).
GRPO = list(itertools.product(OPTIMIZERS, SIDE_PATHS, PRECISIONS))
GRPO_OBJECTIVE = {"beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28}  # DAPO's clip-higher, and the KL term


def _grpo_batch() -> dict:
    from rocktune.tasks.grpo.feed import collate

    gen = torch.Generator().manual_seed(4)
    prompts = [tuple(torch.randint(5, 60, (n,), generator=gen).tolist()) for n in (9, 4, 13)]
    rows = [prompts[k % 3] for k in range(12)]
    completions = [torch.randint(5, 60, (2 + (k * 7) % 11,), generator=gen).tolist() for k in range(12)]
    # positive advantages of several sizes: a loss of mixed signs cancels to near zero, where bf16's rounding of the
    # log-probabilities (which a shared or a fused path rounds elsewhere) would be most of its value
    adv = (0.5 + (torch.arange(12) % 4) * 0.25).tolist()
    return collate(rows, completions, adv, [1.0] * 12, 0)


def _grpo_loss_fn(share: bool, old: torch.Tensor):
    from rocktune.tasks.grpo.loss import GRPOLoss, Objective

    batch = {**_grpo_batch(), "old_logps": old}
    tokens = float(batch["completion_mask"].sum())
    modules: dict = {}

    def loss_fn(model):
        module = modules.setdefault(id(model), GRPOLoss(model, Objective(**GRPO_OBJECTIVE), share_prompt=share))
        return module(batch) / tokens
    return loss_fn


_GRPO_REFERENCE: dict = {}


def grpo_reference(model_dir, precision: str) -> tuple[lora_check.Trace, torch.Tensor]:
    from rocktune.tasks.grpo.loss import token_logps

    if precision not in _GRPO_REFERENCE:
        model = build_model(model_dir, precision, False, "peft")
        with torch.no_grad(), build.autocast("cpu", precision)():
            old = token_logps(model, _grpo_batch())
        opt = lora_check.reference_optimizer(list(lora_check.adapter_params(model).values()), LR)
        ref = lora_check.train_trace(model, _grpo_loss_fn(False, old), opt, STEPS, build.autocast("cpu", precision))
        assert ref.losses[-1] < ref.losses[0] - 0.01, ref.losses  # the reference learns on this batch
        assert all(g > 0 for g in ref.first_grads.values())
        _GRPO_REFERENCE[precision] = ref, old
    return _GRPO_REFERENCE[precision]


def run_grpo_case(model_dir, optimizer: str, path: str, precision: str) -> list[lora_check.Problem]:
    from rocktune.tasks.grpo import prefix

    ref, old = grpo_reference(model_dir, precision)
    model = build_model(model_dir, precision, False, path)
    opt = build.optimizer(list(lora_check.adapter_params(model).values()), optimizer, LR, 0.0, "cpu")
    shared = []
    real = prefix.shared_logps
    prefix.shared_logps = lambda *a, **k: shared.append(real(*a, **k)) or shared[-1]
    try:
        got = lora_check.train_trace(model, _grpo_loss_fn(True, old), opt, STEPS, build.autocast("cpu", precision))
    finally:
        prefix.shared_logps = real
    assert shared and all(s is not None for s in shared)  # the shared forward is what was measured
    return lora_check.compare(got, ref, precision)


@pytest.mark.parametrize("optimizer,path,precision", GRPO, ids=["-".join(c) for c in GRPO])
def test_grpo_shared_prompt(tiny_model_dir, optimizer, path, precision):
    assert run_grpo_case(tiny_model_dir, optimizer, path, precision) == []


def test_a_shared_prompt_at_the_wrong_positions_fails_the_matrix(tiny_model_dir, monkeypatch):
    from rocktune.tasks.grpo import prefix

    real = prefix._completion_rows

    def shifted(*args):
        tokens, cols, positions, attention = real(*args)
        return tokens, cols, positions + 1, attention

    monkeypatch.setattr(prefix, "_completion_rows", shifted)
    assert "mismatch" in {p.cause for p in run_grpo_case(tiny_model_dir, "adamw_foreach", "fused", "fp32")}
