"""The flow-matching objective Wan is trained with, as its scheduler defines the noise path.

For a clean latent x0, noise n and a noise level sigma in (0, 1): the model sees x_t = (1 - sigma) * x0 + sigma * n
at timestep t = sigma * 1000 (FlowMatchEulerDiscreteScheduler's num_train_timesteps) and predicts the velocity
n - x0, the direction the Euler sampler steps along. The loss is the squared error of that prediction, summed here
and divided by the step's latent values by the loop, as the LM path divides by loss-bearing tokens.

Noise and sigmas are drawn on the host from generators seeded by (seed, epoch, item): a resumed run draws exactly
what the uninterrupted run drew, and the eval set's draws are fixed once, so eval losses compare across steps.
"""

from __future__ import annotations

import torch

TRAIN_TIMESTEPS = 1000


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The scheduler's time shift: sigma = s*u / (1 + (s-1)*u); s > 1 spends more steps at high noise."""
    return shift * u / (1 + (shift - 1) * u)


def draw_sigma(gen: torch.Generator, mode: str, shift: float, span: tuple[float, float] = (0.0, 1.0)) -> float:
    """One noise level; ``span`` (a Wan 2.2 expert's share) rescales the draw into [lo, hi]."""
    if mode == "uniform":
        u = torch.rand((), generator=gen)
    else:
        u = torch.sigmoid(torch.randn((), generator=gen)) if mode == "logit_normal" else \
            torch.rand((), generator=gen)
        u = shifted(u, shift)
    return _within(float(u), span)


def eval_sigma(i: int, n: int, mode: str, shift: float, span: tuple[float, float] = (0.0, 1.0)) -> float:
    """The (i + 0.5)/n quantile of the training distribution of sigma: the eval set covers the noise levels training
    draws from, evenly, with no sampling noise."""
    q = torch.tensor((i + 0.5) / n, dtype=torch.float64)
    if mode == "uniform":
        return _within(float(q), span)
    u = torch.sigmoid(torch.distributions.Normal(0.0, 1.0).icdf(q)) if mode == "logit_normal" else q
    return _within(float(shifted(u, shift)), span)


def _within(sigma: float, span: tuple[float, float]) -> float:
    lo, hi = span
    return lo + (hi - lo) * sigma


def item_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 1_000_003 + index) % 2**63)


class FlowMatchLoss(torch.nn.Module):
    """The transformer and its loss as one module (as LossModule for LMs): returns the summed squared error."""

    def __init__(self, transformer):
        super().__init__()
        self.model = transformer

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x0, noise = batch["latents"], batch["noise"]
        sigma = batch["sigma"].view(-1, 1, 1, 1, 1)
        noisy = (1 - sigma) * x0 + sigma * noise
        pred = self.model(hidden_states=noisy.to(self._dtype()), timestep=batch["sigma"] * TRAIN_TIMESTEPS,
                          encoder_hidden_states=batch["text"].to(self._dtype()), return_dict=False)[0]
        return (pred.float() - (noise - x0)).pow(2).sum()

    def _dtype(self) -> torch.dtype:
        # autocast decides the matmuls' precision; inputs follow the transformer's stored dtype (fp32 or bf16)
        return self.model.get_base_model().patch_embedding.weight.dtype
