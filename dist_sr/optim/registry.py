"""Optimizers by name, for configs (``grpo.optimizer: adamw``): a new one is one
``register_optimizer`` call. Under FP32 shadows any of them runs on the shadows; the pure-BF16
precision implements AdamW only (``AdamWSR``)."""

from __future__ import annotations

import torch

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {}


def register_optimizer(name: str, cls: type[torch.optim.Optimizer]) -> None:
    OPTIMIZERS[name] = cls


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}") from None


register_optimizer("adamw", torch.optim.AdamW)
register_optimizer("adam", torch.optim.Adam)
register_optimizer("sgd", torch.optim.SGD)
