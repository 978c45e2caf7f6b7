"""The device out-of-memory error's type, in one place below both the step that catches it and the fault hooks
that raise it in tests."""

import torch

# torch.OutOfMemoryError appeared in torch 2.5; gfx906 users run 2.4.1, where only the cuda alias exists.
DEVICE_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
