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

import contextlib
import itertools
import typing
from pathlib import Path

import pytest
import torch

from rocktune.kernels import recurrent
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
# how far the reference's loss falls over the steps at least, where not 0.05: Granite 4 divides its logits by
# logits_scaling (8), so its three steps move the loss less (0.034 measured, fp32)
FALLS = {"granite4": 0.02}


def reference(model_dir, precision: str) -> lora_check.Trace:
    key = (str(model_dir), precision)
    if key not in _REFERENCE:
        model = build_model(model_dir, precision, False, "peft", experts="peft")
        opt = lora_check.reference_optimizer(list(lora_check.adapter_params(model).values()), LR)
        with recurrent.reference():  # Gated DeltaNet / Mamba2 layers on transformers' torch kernels
            _REFERENCE[key] = _trace(model, opt, precision)
        ref = _REFERENCE[key]
        # the reference itself learns on this batch
        assert ref.losses[-1] < ref.losses[0] - FALLS.get(Path(model_dir).name, 0.05), ref.losses
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


# Recurrent layers (rocktune.kernels.recurrent): a hybrid (Qwen3.5: Gated DeltaNet, then full attention) and an SSM
# (Granite 4: Mamba2, then attention; MoE) against the same reference, which runs transformers' torch kernels. On
# those kernels: every optimizer and precision eager (checkpointing alternating), a compiled case per optimizer. On
# "fast" kernels through rocktune's choice (settle's stand-ins: transformers' own torch functions, counted, so the
# CPU runs the dispatch a GPU runs, eager and compiled); on the real kernels where a GPU has them.
# Compiled with inductor's decompositions and partitioner, run eagerly: plain aot_eager runs a backward that views
# softplus's gradient with strides the real tensor lacks (torch 2.13: Linear -> softplus -> transpose -> contiguous,
# Gated DeltaNet's decay, fails "view size is not compatible"); inductor, what a run compiles with, does not.
RECURRENT_BACKEND = "aot_eager_decomp_partition"
RECURRENT = ("qwen3.5", "granite4")
RECURRENT_EAGER = [(fam, opt, prec, bool((i + j) % 2)) for fam in RECURRENT for i, opt in enumerate(OPTIMIZERS)
                   for j, prec in enumerate(PRECISIONS)]
RECURRENT_COMPILED = [(fam, opt, PRECISIONS[i % 2], bool(i % 2)) for fam in RECURRENT
                      for i, opt in enumerate(OPTIMIZERS)]


def _ids(cases):
    return ["-".join(map(str, c)).replace("True", "ckpt").replace("False", "nockpt") for c in cases]


@pytest.fixture(scope="module")
def recurrent_dirs(tmp_path_factory):
    import transformers

    from tests.family_fixtures import BY_NAME, build_family

    if not hasattr(transformers, "Qwen3_5TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5; rocktune chooses the recurrent kernels "
                    "transformers 5 resolves per modeling module")
    root = tmp_path_factory.mktemp("recurrent")
    return {fam: build_family(BY_NAME[fam], root / fam) for fam in RECURRENT}


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """Every model loaded in the test runs its recurrent kernels through rocktune's choice, on stand-ins that pass
    their self-test (transformers' torch functions); returns the calls by kernel name."""
    calls: dict = {}

    def counted(name, fn):
        def kernel(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return kernel

    def apply(model, device):
        recurrent.settle(model, device, {k.name: counted(k.name, k.torch_fn) for k in recurrent.layer_kernels(model)})
    monkeypatch.setattr(recurrent, "apply", apply)
    yield calls
    recurrent.restore()


@pytest.mark.parametrize("family,optimizer,precision,checkpointing", RECURRENT_EAGER, ids=_ids(RECURRENT_EAGER))
def test_recurrent_eager(recurrent_dirs, family, optimizer, precision, checkpointing):
    assert run_case(recurrent_dirs[family], optimizer, "fused", precision, checkpointing) == []


@pytest.mark.long  # six compilations of a hybrid decoder, 12-25 s each on 2 shared cores
@pytest.mark.parametrize("family,optimizer,precision,checkpointing", RECURRENT_COMPILED,
                         ids=_ids(RECURRENT_COMPILED))
def test_recurrent_compiled(recurrent_dirs, family, optimizer, precision, checkpointing):
    refused = compile_refusal(torch.__version__)
    if refused:
        pytest.skip(f"torch {torch.__version__}: {refused}")
    assert run_case(recurrent_dirs[family], optimizer, "fused", precision, checkpointing, RECURRENT_BACKEND) == []


# eager for both; compiled, Qwen3.5 in `make test` (Dynamo through rocktune's choice) and Granite 4's MoE decoder long
FAST = [("qwen3.5", None), ("granite4", None), pytest.param("qwen3.5", RECURRENT_BACKEND, marks=pytest.mark.slow),
        pytest.param("granite4", RECURRENT_BACKEND, marks=pytest.mark.long)]


@pytest.mark.parametrize("family,backend", FAST)
def test_recurrent_on_fast_kernels(recurrent_dirs, stand_in_kernels, family, backend):
    """The fast-kernel path's dispatch, eager and compiled: the stand-ins are what the layers called."""
    if backend and compile_refusal(torch.__version__):
        pytest.skip(f"torch {torch.__version__}: {compile_refusal(torch.__version__)}")
    assert run_case(recurrent_dirs[family], "adamw_foreach", "fused", "fp32", False, backend) == []
    scan = "chunk_gated_delta_rule" if family == "qwen3.5" else "mamba_chunk_scan_combined"
    assert stand_in_kernels.get(scan, 0) > 1 and stand_in_kernels.get("causal_conv1d_fn", 0) > 1


def test_the_recurrent_rows_cover_every_kernel_rocktune_chooses(recurrent_dirs):
    """A kernel given a self-test (or refused outright) without a model row that calls it fails here."""
    from rocktune.kernels.recurrent_cases import CASES

    called = {k.name for fam in RECURRENT
              for k in recurrent.layer_kernels(load_model(str(recurrent_dirs[fam]), "fp32", "sdpa", False, "cpu"))}
    assert called == set(CASES) | set(recurrent.NEVER)


def _gpu_kernels(family: str) -> str | None:
    """The package of the family's main fast kernel (Gated DeltaNet: fla; Mamba2: mamba-ssm); causal-conv1d's
    convolution is used where it is installed too."""
    import importlib.util

    if not torch.cuda.is_available():
        return "needs a CUDA or ROCm device"
    package = "mamba_ssm" if "granite" in family else "fla"
    return None if importlib.util.find_spec(package) else f"needs {package} installed (its fast kernels)"


@pytest.mark.gpu
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.skipif(_gpu_kernels(f) is not None,
                                                                           reason=str(_gpu_kernels(f))))
                                    for f in RECURRENT])
def test_recurrent_on_the_real_kernels_on_the_gpu(recurrent_dirs, family):
    """The real kernels, where they passed their self-test on the device, against the torch kernels' trace there:
    bf16 autocast, fused AdamW, the GPU's defaults."""
    def trace(kernels_off: bool) -> lora_check.Trace:
        torch.manual_seed(0)
        model = apply_lora(load_model(str(recurrent_dirs[family]), "bf16", "sdpa", False, "cuda"), 8, 16, 0.0,
                           "all-linear", False)
        lean_lora.patch(model, "fused" if not kernels_off else "peft")
        assert kernels_off or recurrent.fast_kernels(model), "no kernel passed its self-test on this GPU"
        params = list(lora_check.adapter_params(model).values())
        opt = build.optimizer(params, "adamw_fused", LR, 0.0, "cuda") if not kernels_off else \
            lora_check.reference_optimizer(params, LR)
        ids = _batch().cuda()
        with recurrent.reference() if kernels_off else contextlib.nullcontext():
            return lora_check.train_trace(model.train(), lambda m: m(input_ids=ids, labels=ids).loss, opt, STEPS,
                                          build.autocast("cuda", "bf16"))

    assert lora_check.compare(trace(False), trace(True), "bf16") == []


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


def _forced(monkeypatch, stand_ins):
    """Every model loaded in the test runs ``stand_ins(kernels by name) -> {name: kernel}`` through rocktune's choice
    whatever their self-tests say: what training would do had a wrong kernel got past them."""
    monkeypatch.setattr(recurrent, "choose", lambda kernel, fast, *_: recurrent.Outcome(kernel, True, "forced"))
    monkeypatch.setattr(recurrent, "apply", lambda model, device: recurrent.settle(
        model, device, stand_ins({k.name: k.torch_fn for k in recurrent.layer_kernels(model)})))


@pytest.mark.parametrize("family,causes", [("qwen3.5", {"no-gradient", "mismatch"}), ("granite4", {"mismatch"})])
def test_a_recurrent_kernel_that_loses_its_gradient_fails_the_matrix(recurrent_dirs, monkeypatch, family, causes):
    """The scan's inputs cut from the graph (a backward that loses them): Qwen3.5's in_proj_qkv adapter gets no
    gradient, Granite 4's in_proj adapter (whose gate and dt still reach the loss) moves otherwise."""
    def detached(kernels):
        chunk, scan = kernels.get("chunk_gated_delta_rule"), kernels.get("mamba_chunk_scan_combined")
        if chunk is not None:
            return {"chunk_gated_delta_rule": lambda q, k, v, **kw: chunk(q.detach(), k.detach(), v.detach(), **kw)}
        return {"mamba_chunk_scan_combined": lambda x, dt, a, b, c, **kw: scan(x.detach(), dt, a, b.detach(),
                                                                                 c.detach(), **kw)}

    _forced(monkeypatch, detached)
    try:
        problems = run_case(recurrent_dirs[family], "adamw_foreach", "fused", "fp32", False)
    finally:
        recurrent.restore()
    assert causes <= {p.cause for p in problems}, problems


def _fused_like_mamba_ssm(kernels):
    """mamba_ssm's mamba_split_conv1d_scan_combined as Granite 4's training forward calls it, in torch: the
    projection split, the convolution, the scan, the gated norm, and out_proj from the weight it is handed."""
    conv, scan = kernels["causal_conv1d_fn"], kernels["mamba_chunk_scan_combined"]

    def fused(zxbcdt, conv_weight, conv_bias, dt_bias, a, *, D, chunk_size, activation, rmsnorm_weight, rmsnorm_eps,
              outproj_weight, outproj_bias, headdim, ngroups, dt_limit=(0.0, float("inf")), **_):
        (rows, n, _), heads = zxbcdt.shape, dt_bias.shape[0]
        inner = heads * headdim
        z, xbc, dt = zxbcdt.split([inner, zxbcdt.shape[-1] - inner - heads, heads], dim=-1)
        xbc = conv(xbc.transpose(1, 2), conv_weight, conv_bias, activation=activation).transpose(1, 2)
        state = (xbc.shape[-1] - inner) // (2 * ngroups)
        x, b, c = xbc.split([inner, ngroups * state, ngroups * state], dim=-1)
        y = scan(x.reshape(rows, n, heads, headdim), dt, a, b.reshape(rows, n, ngroups, state),
                 c.reshape(rows, n, ngroups, state), chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True,
                 dt_limit=dt_limit).reshape(rows, n, inner)
        y = (y.float() * torch.nn.functional.silu(z.float())).view(rows, n, ngroups, -1)
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + rmsnorm_eps)).view(rows, n, inner)
        return torch.nn.functional.linear(rmsnorm_weight * y.to(zxbcdt.dtype), outproj_weight, outproj_bias)
    return {"mamba_split_conv1d_scan_combined": fused}


def test_the_fused_mamba_kernel_would_leave_out_proj_untrained(recurrent_dirs, monkeypatch):
    """Why rocktune never lets Mamba2's fused training kernel run (recurrent.NEVER): it computes the base model's
    layer exactly, but reads out_proj's frozen base weight, so the adapter on out_proj gets no gradient."""
    calls = []

    def counted(kernels):
        fused = _fused_like_mamba_ssm(kernels)["mamba_split_conv1d_scan_combined"]
        return {"mamba_split_conv1d_scan_combined": lambda *a, **k: calls.append(1) or fused(*a, **k)}

    _forced(monkeypatch, counted)
    try:
        model = load_model(str(recurrent_dirs["granite4"]), "fp32", "sdpa", False, "cpu").train()
        ids = _batch()
        got = model(input_ids=ids).logits
        with recurrent.reference():
            want = model(input_ids=ids).logits
        assert calls == [1] and torch.allclose(got, want, atol=1e-5)  # the fused path ran, and right
        problems = run_case(recurrent_dirs["granite4"], "adamw_foreach", "fused", "fp32", False)
    finally:
        recurrent.restore()
    dead = [p for p in problems if p.cause == "no-gradient"]
    assert dead and "out_proj" in dead[0].detail, problems


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
