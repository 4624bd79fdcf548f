"""Optimizers by name, for configs (``grpo.optimizer: adamw``): a new one is one
``register_optimizer`` call. Under FP32 shadows any of them runs on the shadows; the pure-BF16
precision implements AdamW only (``AdamWSR``)."""

from __future__ import annotations

import torch

from ..registry import Registry

OPTIMIZERS: Registry[type[torch.optim.Optimizer]] = Registry("optimizer")


def register_optimizer(name: str, cls: type[torch.optim.Optimizer] | str) -> None:
    """``cls``: a ``torch.optim.Optimizer`` subclass, or ``"module:Class"`` imported on first use."""
    OPTIMIZERS.register(name, cls)


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    return OPTIMIZERS[name]


register_optimizer("adamw", torch.optim.AdamW)
register_optimizer("adam", torch.optim.Adam)
register_optimizer("sgd", torch.optim.SGD)
