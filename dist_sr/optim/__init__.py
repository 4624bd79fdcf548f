"""Optimizers that keep low-precision working weights: FP32 shadows, or pure BF16 with SR."""

from .adamw_sr import AdamWSR
from .loss_scale import DynamicLossScaler
from .metrics import StickingMeter
from .params import named_param_groups
from .registry import OPTIMIZERS, optimizer_class, register_optimizer
from .shadow import ShadowAdamW, ShadowOptimizer

__all__ = [
    "OPTIMIZERS",
    "AdamWSR",
    "DynamicLossScaler",
    "ShadowAdamW",
    "ShadowOptimizer",
    "StickingMeter",
    "named_param_groups",
    "optimizer_class",
    "register_optimizer",
]
