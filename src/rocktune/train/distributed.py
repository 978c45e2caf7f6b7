"""Several processes, one loop: everything that differs between one device and N ranks lives here.

torchrun (``torch.distributed.run``) starts the workers and sets RANK / WORLD_SIZE / LOCAL_RANK; a single process
never imports ``torch.distributed`` (AMD's Windows wheels lack it). The strategy is PyTorch's own DDP: the frozen
base is replicated and only the adapter's gradients are all-reduced, in DDP's buckets, once per optimizer step
(``no_sync`` for the micro-batches before the last). Each rank runs a disjoint share of every step's samples; the
loss is normalised by the loss-bearing tokens of the whole global step, which every rank derives from the same
deterministic step plan, so N ranks make the same update as one process with the same global batch.

Hangs are not silent: collectives run under the process group's timeout, and when one fails the rank asks a
separate gloo group which ranks still answer (``monitored_barrier`` names the missing ones) before it stops.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch

from rocktune import exits
from rocktune.errors import UserError, first_line
from rocktune.train import faults
from rocktune.train.prelaunch import refuse_layout


# What gloo and NCCL/RCCL say when a peer is gone or a collective timed out.
_COLLECTIVE_ERROR = re.compile(r"gloo|NCCL|RCCL|Connection (reset|closed)|timed? ?out|ProcessGroup|collective",
                               re.IGNORECASE)


# How gloo's monitored_barrier names the ranks that did not arrive: "Rank 1 failed to pass monitoredBarrier in 30000
# ms" (wait_all_ranks=False) or "Ranks 1, 3 failed to pass ..." (wait_all_ranks=True).
_MISSING_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


class DistributedFailure(RuntimeError):
    """A collective failed or timed out: another rank died or hung. The message names the collective and step;
    ``unanswered`` holds the ranks the liveness check found missing (the hung ones; empty when it could not tell),
    which the incident log names instead of the rank that noticed."""

    def __init__(self, message: str, unanswered: tuple[int, ...] = ()):
        super().__init__(message)
        self.unanswered = tuple(unanswered)


class PreflightFailure(UserError):
    """The process group came up wrong (a collective returned wrong values or never returned)."""


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None
    timeout_s: float = 600.0
    control: Any = None  # a gloo ProcessGroup: barriers that can name a missing rank, object gathers

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def strategy(dist: Dist, parallel: str, quantization: str) -> str:
    """``training.parallel`` resolved (``autofit.choose_parallel``): ddp (the base replicated on every rank) or fsdp
    (decoder layers sharded); "single" for one process."""
    if not dist.enabled:
        return "single"
    if parallel == "fsdp" and not _has_fsdp2():
        raise UserError(f"training.parallel=fsdp needs FSDP2 (torch >= 2.6 with ignored_params; this is torch "
                        f"{torch.__version__}). Use training.parallel=ddp, or a newer torch where your GPU has one.")
    refuse_layout(dist.world, parallel, quantization)  # decided before launch too (train/prelaunch.py)
    return parallel


def _has_fsdp2() -> bool:
    import inspect

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return False
    return "ignored_params" in inspect.signature(fully_shard).parameters


def mean_over_ranks(dist: Dist, total: float, tokens: int) -> float | None:
    """A token-weighted mean from every rank's (sum, count): eval under DDP, each rank on its share."""
    if dist.enabled:
        import torch.distributed as td

        both = torch.tensor([float(total), float(tokens)], dtype=torch.float64)
        td.all_reduce(both, group=dist.control)
        total, tokens = both.tolist()
    return total / tokens if tokens else None


def sum_over_ranks(dist: Dist, values: torch.Tensor) -> torch.Tensor:
    """Host values summed over every rank (a task's per-step statistics), on the control group; as given with one
    process."""
    values = values.detach().cpu()
    if dist.enabled:
        import torch.distributed as td

        values = values.clone()
        td.all_reduce(values, group=dist.control)
    return values


def gather_objects(dist: Dist, obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank: e.g. the scored rollouts each rank sampled."""
    if not dist.enabled:
        return [obj]
    import torch.distributed as td

    out = [None] * dist.world
    td.all_gather_object(out, obj, group=dist.control)
    return out


def from_env() -> Dist:
    """The launch's rank layout (torchrun's variables); one process when they are absent."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return Dist(rank=int(os.environ.get("RANK", "0")), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def device_for(dist: Dist) -> None:
    """Each rank drives the GPU of its local rank; "cuda" then means that one everywhere in the loop."""
    if dist.enabled and torch.cuda.is_available():
        torch.cuda.set_device(dist.local_rank)


def init(dist: Dist, device: str, timeout_s: float, preflight_timeout_s: float) -> None:
    """Bring the process group up: NCCL/RCCL on GPUs, gloo on the CPU; plus the gloo control group."""
    if not dist.enabled:
        return
    import torch.distributed as td

    if not td.is_available():
        raise UserError("this torch build has no torch.distributed (AMD's Windows wheels lack it), so --nproc cannot "
                        "start several processes; train on one GPU, or use Linux or WSL for several.")
    dist.backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.timeout_s = timeout_s
    # torch wants the indexed device; the loop's "cuda" means the current device, set by device_for
    kwargs: dict[str, Any] = {"device_id": torch.device("cuda", dist.local_rank)} if dist.backend == "nccl" else {}
    td.init_process_group(dist.backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    # The control group carries object gathers that wait on rank 0's own work (checkpoint RNG states): the long
    # timeout; its barriers pass their own, short one.
    dist.control = td.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def preflight(dist: Dist, device: str, timeout_s: float) -> list[str]:
    """Every rank arrives and an all-reduce of known values returns the right numbers. A wrong result or a hang is
    reported as such, before anything is written."""
    if not dist.enabled:
        return []
    import torch.distributed as td

    faults.hang_here("preflight", dist.rank)
    _answering(dist, timeout_s, "the start-up barrier")
    values = torch.tensor([dist.rank + 1.0, (dist.rank + 1) * 2.0**-10, 1000.0 * (dist.rank + 1)], device=device)
    if faults.junk_all_reduce(dist.rank):  # tests: a collective that returns junk
        values += 1.0
    try:
        td.all_reduce(values, async_op=True).wait(timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 -- whatever the backend raises, the collective failed: named, then stopped
        failure = _failure(dist, "the preflight's test all-reduce", exc)
        raise DistributedFailure(f"{failure}{_hint(dist)}", failure.unanswered) from None
    n = dist.world * (dist.world + 1) / 2
    expected = torch.tensor([n, n * 2.0**-10, 1000.0 * n])
    got = values.cpu()
    if not torch.allclose(got, expected, rtol=0, atol=1e-6 * 1000 * n):
        raise PreflightFailure(f"preflight: the test all-reduce on {dist.backend} returned {got.tolist()} on rank "
                               f"{dist.rank}, expected {expected.tolist()}: the collective library gives wrong "
                               f"results on this machine, so training would silently diverge{_hint(dist)}")
    notes = [f"distributed: {dist.world} ranks, {dist.backend}; preflight passed (barrier, all-reduce of known "
             "values)"]
    if device.startswith("cuda") and torch.cuda.device_count() > 1:
        other = (dist.local_rank + 1) % torch.cuda.device_count()
        peer = torch.cuda.can_device_access_peer(dist.local_rank, other)
        how = "yes" if peer else "no (copies go through host memory; RCCL/NCCL still work, slower)"
        notes.append(f"GPU {dist.local_rank} -> GPU {other} peer access: {how}")
    return notes


def same_run(dist: Dist, fingerprint: str) -> None:
    """Every rank trains the same run: the fingerprints of config, data and tokenizer agree."""
    if not dist.enabled:
        return
    import torch.distributed as td

    prints: list[Any] = [None] * dist.world  # filled by the gather: every rank's fingerprint
    td.all_gather_object(prints, fingerprint, group=dist.control)
    if len(set(prints)) > 1:
        raise PreflightFailure("preflight: the ranks do not train the same run (config, data or tokenizer differ "
                               f"between ranks: {', '.join(f'rank {r}: {p[:12]}' for r, p in enumerate(prints))}); "
                               "give every node the same files.")


def wrap(model, dist: Dist, device: str, strategy: str = "ddp", notes: list[str] | None = None):
    """DDP around the loss module, so gradients are all-reduced by PyTorch's reducer in its buckets; or FSDP2 on the
    decoder layers (``shard_layers``), the loss module then called as it is. What was done is added to ``notes``."""
    if not dist.enabled:
        return model
    if strategy == "fsdp":
        note = shard_layers(model.model, dist, device)
        if notes is not None:
            notes.append(note)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [dist.local_rank] if device.startswith("cuda") else None
    # LoRA: every adapter weight gets a gradient each step, so no unused-parameter search (its cost is a graph walk
    # per backward); buffers (RoPE tables) are the same everywhere, so not broadcast on every forward.
    import warnings

    with warnings.catch_warnings():  # torch 2.13 renames the switch; the old name keeps working on torch 2.4-2.12
        warnings.simplefilter("ignore", FutureWarning)
        return DDP(model, device_ids=ids, broadcast_buffers=False, find_unused_parameters=False)


def shard_layers(peft_model, dist: Dist, device: str) -> str:
    """FSDP2: ``fully_shard`` each decoder layer's frozen base weights across the ranks (all-gathered for its forward
    and backward, freed after). The adapter's weights are left out (``ignored_params``): they are small, stay whole
    on every rank (so checkpoints and the saved adapter are exactly as with one process) and their gradients are
    all-reduced once per step by ``sync_gradients``. Embeddings, final norm and head stay replicated too: the fused
    loss reads the head's weight directly. The model is loaded on the CPU for this; shards move to the device here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (dist.world,))
    adapter = {p for p in peft_model.parameters() if p.requires_grad}
    layers = peft_model.get_base_model().get_decoder().layers
    for layer in layers:
        # Each layer is its own FSDP root (no root wrap), and a root keeps its weights gathered after forward unless
        # told otherwise: reshard, or every rank would end up holding the whole base.
        fully_shard(layer, mesh=mesh, reshard_after_forward=True,
                    ignored_params={p for p in layer.parameters() if p in adapter})
    sharded = [p for p in peft_model.parameters() if isinstance(p, DTensor)]
    local = sum(p.to_local().numel() * p.element_size() for p in sharded)
    whole = sum(p.numel() * p.element_size() for p in sharded)
    # MoE expert stacks [E, out, in] are layer parameters like the others: dim 0, the experts, is split over the
    # ranks; the grouped expert forward (lora/moe.py) reads the whole stack FSDP gathers for the layer's forward
    stacks = sum(1 for p in sharded if p.dim() == 3)
    among = f" ({stacks} expert stacks among them, split by expert)" if stacks else ""
    if device.startswith("cuda"):  # what FSDP does not manage moves as it is (same Parameter objects)
        for p in peft_model.parameters():
            if not isinstance(p, DTensor):
                p.data = p.data.to(device)
        for module in peft_model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                module.register_buffer(name, buf.to(device), persistent=name not in module._non_persistent_buffers_set)
    return (f"fsdp: {len(layers)} decoder layers sharded over {dist.world} ranks: {local / 2**20:,.1f} of "
            f"{whole / 2**20:,.1f} MiB of their base weights held by this rank{among}")


def sync_gradients(dist: Dist, params: list, strategy: str) -> None:
    """FSDP2 mode: the adapter's gradients, summed over ranks in one flat all-reduce and divided by the number of
    ranks (as DDP averages), after the step's last backward. DDP has done this already inside backward."""
    if not dist.enabled or strategy != "fsdp":
        return
    import torch.distributed as td
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    td.all_reduce(flat)
    flat /= dist.world
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def no_sync(wrapped, last: bool):
    """Accumulate locally for every backward of the step but the last, which all-reduces once."""
    if last or not hasattr(wrapped, "no_sync"):
        return contextlib.nullcontext()
    return wrapped.no_sync()


def reduce_step(dist: Dist, loss_sum: torch.Tensor, stop: bool, step: int) -> torch.Tensor:
    """The step's one collective besides the gradients: the summed loss of all ranks and whether any was asked to
    stop (Ctrl-C reaches rank 0 first; every rank must stop after the same step)."""
    flag = torch.tensor(float(stop), device=loss_sum.device)
    values = torch.stack([loss_sum.float(), flag])
    if not dist.enabled:
        return values
    import torch.distributed as td

    faults.hang_here(f"step:{step}", dist.rank)
    try:
        td.all_reduce(values)
    except Exception as exc:  # noqa: BLE001 -- gloo raises on timeout or a closed peer; NCCL's watchdog aborts the process instead
        raise _failure(dist, f"the all-reduce of step {step}'s loss", exc) from None
    return values


@contextlib.contextmanager
def collective(dist: Dist, what: str):
    """Around work that contains collectives (DDP's gradient all-reduce inside backward): a failure there is a peer
    that died or hung, said as such, not a library traceback."""
    if not dist.enabled:
        yield
        return
    try:
        yield
    except RuntimeError as exc:
        if not _COLLECTIVE_ERROR.search(str(exc)):
            raise
        raise _failure(dist, what, exc) from None


def gather_rng(dist: Dist) -> list[dict] | None:
    """Every rank's torch RNG states (CPU, and its own GPU's: dropout draws from them), for rank 0's checkpoint;
    base64 text for JSON. Ranks are seeded alike, so the adapter starts identical everywhere."""
    if not dist.enabled:
        return None
    import torch.distributed as td

    def b64(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    state = {"cpu": b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = b64(torch.cuda.get_rng_state(dist.local_rank))
    states: list[Any] = [None] * dist.world  # filled by the gather
    td.all_gather_object(states, state, group=dist.control)
    return states


def rng_mismatch(dist: Dist, states: list[dict] | None) -> str | None:
    """Why the saved per-rank RNG states cannot be restored in this launch, or None when they can (or none were
    saved): one state per rank, and a GPU state only where this rank has that GPU."""
    if not states:
        return None
    if len(states) != dist.world:
        return f"RNG states were saved for {len(states)} process(es), this launch has {dist.world}"
    mine = states[dist.rank]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "cuda" in mine and gpus <= dist.local_rank:
        return (f"rank {dist.rank} saved the RNG state of its GPU {dist.local_rank}, but this machine shows "
                f"{gpus} GPU(s)")
    return None


def check_rng(dist: Dist, states: list[dict] | None, force: bool) -> str | None:
    """Before anything is applied: refuse a resume whose RNG states do not fit this launch (fewer GPUs or processes
    than saved); with ``force`` go on without them and return the note that says so."""
    problem = rng_mismatch(dist, states)
    if problem is None:
        return None
    if not force:
        raise UserError(f"--resume: {problem}, so dropout could not continue the same random stream and the run "
                        "would no longer be one exact run. Resume on the same number of GPUs and processes, or pass "
                        "--resume-force to continue with fresh random numbers.")
    return f"resume: {problem}; continuing with fresh random numbers (--resume-force)"


def restore_rng(dist: Dist, states: list[dict] | None) -> None:
    # nothing saved (a one-process checkpoint resumed by several with --resume-force: the seeded streams go on), or
    # checked (or forced) before the resume applied
    if not dist.enabled or not states or rng_mismatch(dist, states) is not None:
        return
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()

    mine = cast("list[dict]", states)[dist.rank]
    torch.set_rng_state(tensor(mine["cpu"]))
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(mine["cuda"]), dist.local_rank)


def main_first(dist: Dist, action, what: str):
    """Rank 0 acts first (e.g. restoring a checkpoint, which may set damaged ones aside), then the other ranks."""
    if dist.main:
        out = action()
    barrier(dist, what)
    if not dist.main:
        out = action()
    return out


def barrier(dist: Dist, what: str) -> None:
    if dist.enabled:
        _answering(dist, dist.timeout_s, what)


def close(dist: Dist) -> None:
    if dist.enabled:
        import torch.distributed as td

        if td.is_initialized():
            td.destroy_process_group()


def _answering(dist: Dist, timeout_s: float, what: str) -> None:
    import torch.distributed as td

    try:
        td.monitored_barrier(group=dist.control, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except Exception as exc:  # noqa: BLE001 -- whatever the backend raises, the collective failed: named, then stopped
        raise DistributedFailure(f"rank {dist.rank}: {what} failed: {first_line(exc)}{_hint(dist)}",
                                 missing_ranks(str(exc))) from None


def missing_ranks(text: str) -> tuple[int, ...]:
    """The ranks a monitored_barrier error names as not arriving; () when it names none."""
    found = _MISSING_RANKS.search(text)
    return tuple(int(r) for r in found.group(1).replace(",", " ").split()) if found else ()


def _failure(dist: Dist, what: str, exc: BaseException) -> DistributedFailure:
    """Name the collective and the step, and ask the control group which ranks still answer."""
    missing, unanswered = "", cast("tuple[int, ...]", ())
    try:
        _answering(dist, min(30.0, dist.timeout_s), "the liveness check")
    except DistributedFailure as probe:
        missing = f"; liveness check: {str(probe).split(' failed: ', 1)[-1]}"
        unanswered = probe.unanswered
    return DistributedFailure(f"rank {dist.rank}: {what} did not complete ({first_line(exc)}){missing}. Another "
                              "rank died or hung; the supervisor restarts the group from the last checkpoint",
                              unanswered)


def _hint(dist: Dist) -> str:
    if dist.backend == "nccl":
        return (". On ROCm multi-GPU machines see `rocktune doctor` (NCCL_P2P_DISABLE=1 on some RX 7900 systems, "
                "iommu=pt, HSA_ENABLE_SDMA=0); run `rocktune doctor --nproc N` to repeat this check alone")
    return ""


def _preflight_alone() -> int:
    """``python -m rocktune.train.distributed`` under torchrun (``rocktune doctor --nproc N``)."""
    from rocktune.errors import print_error

    dist = from_env()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_for(dist)
    timeout = float(os.environ.get("ROCKTUNE_PREFLIGHT_TIMEOUT", "60"))
    try:
        init(dist, device, timeout, timeout)
        notes = preflight(dist, device, timeout)
    except (UserError, DistributedFailure) as exc:
        print_error(str(exc))
        return exits.USER_ERROR
    finally:
        close(dist)
    if dist.main:
        print("\n".join(notes))
    return exits.OK


if __name__ == "__main__":
    raise SystemExit(_preflight_alone())
