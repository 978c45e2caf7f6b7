"""The loss's chunk body under torch.compile (tasks/causal/loss.py: ``fused_chunk``/``compiled_chunk``) against the
eager one: the same loss and d/dh, a bounded number of graphs over ragged chunks, no fp32 chunk x vocab tensor in
half precision, and the compile fallback turning the loss back to eager. Inductor compiles C++ on the CPU (seconds
per graph), so all but the first test are marked slow."""

from __future__ import annotations

import re

import pytest
import torch

from rocktune.tasks.causal.loss import LinearCrossEntropy, LossModule, compiled_chunk, eager_chunk, fused_chunk

pytest.importorskip("torch._inductor")

VOCAB, HIDDEN, CHUNK = 1000, 64, 256


@pytest.fixture
def fresh_dynamo():
    """Graphs and automatic-dynamic memory start empty, so a test counts only its own compilations."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def head(dtype: torch.dtype, bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.2).to(dtype)
    return w, (torch.randn(VOCAB, generator=g) * 0.5).to(dtype) if bias else None


def rows(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HIDDEN, generator=g).to(dtype), torch.randint(0, VOCAB, (n,), generator=g)


def loss_and_grad(body, hidden, w, b, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole autograd Function, chunked at CHUNK rows (so the last chunk is ragged): loss and d/dh."""
    hidden = hidden.clone().requires_grad_()
    loss = LinearCrossEntropy.apply(hidden, w, b, targets, CHUNK, body)
    loss.backward()
    return loss.detach(), hidden.grad


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_fp32_matches_eager_on_ragged_chunks_in_at_most_two_graphs(fresh_dynamo):
    """fp32: the two bodies differ only in how logsumexp and exp are evaluated (Inductor's fused reduction against
    ATen's), a few fp32 ulps per entry. Five steps whose last chunk has a different row count each: the first full
    chunk compiles one static graph, the first ragged one a graph with a symbolic row count, and nothing after."""
    w, b = head(torch.float32, bias=False)
    before = graphs()
    for step, n in enumerate((700, 600, 300, 515, 258)):
        hidden, targets = rows(n, torch.float32, seed=step)
        eager_loss, eager_grad = loss_and_grad(eager_chunk, hidden, w, b, targets)
        loss, grad = loss_and_grad(compiled_chunk(), hidden, w, b, targets)
        torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-6 * eager_grad.abs().max().item())
    assert graphs() - before <= 2


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_body_matches_eager_per_chunk(dtype, bias, fresh_dynamo):
    """Loss, d/dh and their dtypes per chunk, ragged sizes included, with and without a head bias. Both bodies
    round the same fp32 d/dlogits to the compute dtype; where fp32 rounding differences put an entry on the other
    side of a rounding boundary it moves by one ulp of that dtype (2^-8 relative in bf16, 2^-11 in fp16), and the
    head matmul's own half-precision output rounds likewise: so d/dh agrees to the dtype's eps relative to its
    largest entry. The loss is an fp32 sum in both: 1e-6 relative."""
    w, b = head(dtype, bias)
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    for n in (CHUNK, 37, 200, 2):
        hidden, targets = rows(n, dtype, seed=n)
        eager_loss, eager_grad = eager_chunk(hidden, w, b, targets, True)
        loss, grad = compiled_chunk()(hidden, w, b, targets, True)
        assert loss.dtype == torch.float32 and grad.dtype == eager_grad.dtype
        assert grad.dtype == (torch.float32 if dtype == torch.float16 else dtype)
        torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
        scale = eager_grad.abs().max().item()
        torch.testing.assert_close(grad, eager_grad, rtol=eps, atol=eps * scale)
        no_grad_loss, none = compiled_chunk()(hidden, w, b, targets, False)
        assert none is None
        torch.testing.assert_close(no_grad_loss, eager_loss, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_fp16_keeps_the_small_gradients_of_confident_rows(fresh_dynamo):
    """The FP16_SCALE handling survives the rewrite: each hidden row points at its target's head row, so softmax is
    confident (1 - p_target down to 7e-5) and d/dh is small in every row, its off-target terms near fp16's
    subnormals. Compared row by row, relative to each row's largest entry: measured 3.5e-4 between the bodies (the
    fp32 rounding of p_target - 1, about 6e-8 / 7e-5, is the same in both but not bit for bit) and 5.7e-3 with the
    scale removed, against fp16's eps of 9.8e-4. Sharper rows would be dominated by that fp32 cancellation."""
    w, _ = head(torch.float16, bias=False)
    targets = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(3))
    hidden = (w[targets].float() * 5).half()
    _, eager_grad = eager_chunk(hidden, w, None, targets, True)
    _, grad = compiled_chunk()(hidden, w, None, targets, True)
    row_max = eager_grad.abs().amax(1, keepdim=True)
    assert grad.dtype == torch.float32 and (row_max > 0).all()
    assert ((grad - eager_grad).abs() / row_max).max() <= torch.finfo(torch.float16).eps


def vocab_buffers(code: str) -> list[str]:
    """The dtypes of the chunk x vocab buffers that Inductor's generated wrapper allocates."""
    return re.findall(rf"empty_strided_cpu\(\(\w+, {VOCAB}\), \({VOCAB}, 1\), torch\.(\w+)\)", code)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_body_holds_no_more_chunk_x_vocab_memory_than_eager(dtype, fresh_dynamo):
    """Peak memory by structure (CPU allocations are not tracked the way CUDA's are): eager holds one fp32 chunk x
    vocab buffer, plus in bf16/fp16 the half logits it was cast from and the half copy of the gradient (6 bytes an
    entry); the compiled wrapper allocates no fp32 chunk x vocab buffer in half precision (two half ones: the logits
    and the gradient, 4 bytes an entry) and in fp32 one, the gradient written over the logits."""
    from torch._inductor.utils import run_and_get_code

    w, b = head(dtype, bias=True)
    hidden, targets = rows(CHUNK, dtype, seed=0)
    _, code = run_and_get_code(torch.compile(fused_chunk), hidden, w, b, targets, True)
    found = vocab_buffers("\n".join(code))
    half = dtype != torch.float32
    assert found == ([str(dtype).removeprefix("torch.")] * 2 if half else ["float32"]), found
    compiled_bytes = sum(getattr(torch, d).itemsize for d in found)
    eager_bytes = 4 + 2 * dtype.itemsize if half else 4
    assert compiled_bytes <= eager_bytes


def test_vocab_buffer_check_can_fail():
    code = ("buf0 = empty_strided_cpu((s0, 1000), (1000, 1), torch.bfloat16)\n"
            "buf6 = empty_strided_cpu((256, 1000), (1000, 1), torch.float32)")
    assert vocab_buffers(code) == ["bfloat16", "float32"]


@pytest.mark.slow
def test_a_compiler_failure_in_the_loss_is_caught_by_the_compile_fallback(lm_task, fresh_dynamo):
    """With the C++ compiler Inductor calls made to fail, the loss's own compilation raises a compiler error; the
    step's recovery hands it to the fallback, which turns the loss eager, and the step is run again eagerly."""
    import torch._inductor.config as inductor

    from rocktune.train.step import is_compile_error, run_with_oom_recovery

    task, batch = lm_task
    expected = LossModule(task.run.model, 5, True)(batch).item()
    caught = []

    def fall_back(exc):
        caught.append(exc)
        task.uncompile()

    optimizer = torch.optim.SGD([p for p in task.run.model.parameters() if p.requires_grad], lr=0.0)
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):  # undone on exit (monkeypatch's undo deletes it)
        loss, _ = run_with_oom_recovery(lambda pieces: task.run.loss(batch), optimizer, 1, 1, print, fall_back)
    assert len(caught) == 1 and is_compile_error(caught[0])
    assert task.run.loss.compiled is False and loss.item() == pytest.approx(expected, rel=1e-6)


def test_uncompile_turns_the_loss_eager(lm_task):
    task, _ = lm_task
    decoder = task.run.model.get_base_model().get_decoder()
    decoder.compile()  # only wrapped: nothing is compiled until a forward
    assert decoder._compiled_call_impl is not None and task.run.loss.compiled
    task.uncompile()
    assert decoder._compiled_call_impl is None and task.run.loss.compiled is False


@pytest.fixture
def lm_task(tiny_model_dir):
    """An LMTask holding what ``prepare`` would give ``uncompile``: the model and a loss module with compile on."""
    from rocktune.models.load import apply_lora, load_model
    from rocktune.tasks.lm.task import LMTask
    from tests.test_loss import make_batch

    model = apply_lora(load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu"), 4, 8, 0.0, "all-linear", False)
    from types import SimpleNamespace

    task = LMTask.__new__(LMTask)
    task.run = SimpleNamespace(model=model, loss=LossModule(model, 5, True, compiled=True))  # LMRun's two fields
    return task, make_batch(0)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loss_module_compiled_matches_eager_through_the_model(tiny_model_dir, precision, fresh_dynamo):
    """The wiring, as training calls it: LossModule(compiled=True) on a LoRA model under the precision's autocast
    gives eager's loss and LoRA gradients, for a training step and a no-grad evaluation. fp32: the tolerance
    test_loss allows the fused path against full logits (d/dh differs in fp32 rounding, carried back through the
    layers); bf16: the gradients' relative difference within about one bf16 eps (2^-7), since only bf16 roundings
    of d/dh entries can differ (a gradient 0.1 off at each target gives 0.1)."""
    from rocktune.models.load import apply_lora, load_model
    from tests.test_loss import grads, make_batch

    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_model_dir), precision, "sdpa", False, "cpu"), 4, 8, 0.0, "all-linear",
                       False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    batch, dtype = make_batch(7, rows=4), torch.bfloat16 if precision == "bf16" else torch.float32
    results = []
    for compiled in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=precision == "bf16"):
            loss = LossModule(model, 5, True, compiled)(batch)
        loss.backward()
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=precision == "bf16"):
            evaluated = LossModule(model, 5, True, compiled).sum_and_count(batch)[0]
        results.append((loss.item(), evaluated.item(), grads(model)))
    (loss, evaluated, g_eager), (c_loss, c_evaluated, g_compiled) = results
    rtol = 1e-6 if precision == "fp32" else 1e-3
    assert c_loss == pytest.approx(loss, rel=rtol) and c_evaluated == pytest.approx(evaluated, rel=rtol)
    for name, g in g_eager.items():
        if precision == "fp32":
            torch.testing.assert_close(g_compiled[name], g, rtol=1e-4, atol=1e-6)  # test_loss's fast vs full
        else:
            assert (g_compiled[name] - g).norm() <= 1e-2 * g.norm(), name  # measured 0.0
