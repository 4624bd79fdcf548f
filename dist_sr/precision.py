"""The precision switch: one config value picks how a model's working weights are kept.

    fp32          FP32 weights, plain optimizer
    fp16          FP16 working weights, FP32 shadows, round-to-nearest, dynamic loss scaling
    bf16          BF16 working weights, FP32 shadows, round-to-nearest (the usual mixed precision)
    bf16-sr       BF16 working weights, FP32 shadows, keyed stochastic rounding (fresh bits/step)
    bf16-dither   as bf16-sr with one frozen threshold per element
    bf16-pure-sr  BF16 weights, no FP32 master, AdamW update stochastically rounded (AdamWSR)

``PrecisionConfig.from_dict`` / ``from_yaml`` validate at load time; ``apply_precision`` turns a
model and an optimizer class into a ``TrainingPrecision`` that runs backward and step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import yaml
from torch import nn

from .numerics import BACKENDS
from .optim import AdamWSR, DynamicLossScaler, ShadowOptimizer, StickingMeter
from .replica import combined_digest, weight_digests

PRECISIONS = ("fp32", "fp16", "bf16", "bf16-sr", "bf16-dither", "bf16-pure-sr")
_ROUNDING = {"fp16": "nearest", "bf16": "nearest", "bf16-sr": "stochastic", "bf16-dither": "dither"}
_WORKING_DTYPE = {"fp32": torch.float32, "fp16": torch.float16}
# fields that only mean something for some precisions
_ONLY_FOR = {
    "loss_scale": ("fp16",),
    "initial_loss_scale": ("fp16",),
    "loss_scale_window": ("fp16",),
    "moment_dtype": ("bf16-pure-sr",),
}


class PrecisionConfigError(ValueError):
    pass


@dataclass(frozen=True)
class PrecisionConfig:
    precision: str = "bf16-sr"
    seed: int = 0
    loss_scale: str | float = "dynamic"   # fp16: "dynamic" or a static scale
    initial_loss_scale: float = 2.0**16   # fp16, dynamic
    loss_scale_window: int = 1000         # fp16, dynamic: clean steps before the scale doubles
    moment_dtype: str = "fp32"            # bf16-pure-sr: "fp32" or "bf16"
    backend: str = "auto"                 # rounding backend

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise PrecisionConfigError(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**64:
            raise PrecisionConfigError(f"precision.seed must be an int in [0, 2^64), got {self.seed!r}")
        if not (self.loss_scale == "dynamic" or (isinstance(self.loss_scale, (int, float)) and self.loss_scale > 0)):
            raise PrecisionConfigError(f"precision.loss_scale must be 'dynamic' or a number > 0, got {self.loss_scale!r}")
        if self.moment_dtype not in ("fp32", "bf16"):
            raise PrecisionConfigError(f"precision.moment_dtype must be 'fp32' or 'bf16', got {self.moment_dtype!r}")
        if self.backend not in BACKENDS:
            raise PrecisionConfigError(f"precision.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.loss_scale_window, int) or self.loss_scale_window < 1:
            raise PrecisionConfigError(f"precision.loss_scale_window must be an int >= 1, got {self.loss_scale_window!r}")

    @property
    def rounding(self) -> str | None:
        """The rounding mode of the working weights (None for fp32)."""
        return "stochastic" if self.precision == "bf16-pure-sr" else _ROUNDING.get(self.precision)

    @property
    def working_dtype(self) -> torch.dtype:
        return _WORKING_DTYPE.get(self.precision, torch.bfloat16)

    @classmethod
    def from_dict(cls, data: str | Mapping[str, Any]) -> "PrecisionConfig":
        """From ``"bf16-sr"`` or ``{"precision": "bf16-sr", "seed": 1, ...}`` (``mode`` is an
        alias of ``precision``). Unknown fields and fields that do not apply to the chosen
        precision are errors."""
        if isinstance(data, str):
            return cls(precision=data)
        if not isinstance(data, Mapping):
            raise PrecisionConfigError(f"precision config must be a string or a mapping, got {type(data).__name__}")
        data = dict(data)
        if "mode" in data:
            if "precision" in data:
                raise PrecisionConfigError("give either precision.precision or precision.mode, not both")
            data["precision"] = data.pop("mode")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise PrecisionConfigError(f"unknown precision field(s) {unknown}; valid fields: {', '.join(sorted(fields))}")
        config = cls(**data)
        for name, allowed in _ONLY_FOR.items():
            if name in data and config.precision not in allowed:
                raise PrecisionConfigError(
                    f"precision.{name} applies only to precision {' or '.join(allowed)}, "
                    f"but precision is {config.precision!r}; remove {name} or change the precision"
                )
        return config

    def to_dict(self) -> dict[str, Any]:
        """The fields that apply to this precision; ``from_dict`` of the result is ``self``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in _ONLY_FOR or self.precision in _ONLY_FOR[f.name]}

    @classmethod
    def from_yaml(cls, source: str | Path) -> "PrecisionConfig":
        """From a YAML file (or YAML text) with a top-level ``precision:`` entry."""
        text = Path(source).read_text() if Path(str(source)).suffix in (".yaml", ".yml") else str(source)
        doc = yaml.safe_load(text)
        if not isinstance(doc, Mapping) or "precision" not in doc:
            raise PrecisionConfigError("YAML has no top-level 'precision:' entry")
        return cls.from_dict(doc["precision"])


class TrainingPrecision:
    """A model and its optimizer under one precision: ``backward``, ``step``, ``zero_grad``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: PrecisionConfig):
        self.model, self.optimizer, self.config = model, optimizer, config

    def backward(self, loss: torch.Tensor) -> None:
        scaled = self.optimizer.scale_loss(loss) if isinstance(self.optimizer, ShadowOptimizer) else loss
        scaled.backward()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if isinstance(self.optimizer, ShadowOptimizer):
            return self.optimizer.clip_grad_norm_(max_norm)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self) -> bool:
        """One optimizer step; False if it was skipped (FP16 overflow)."""
        before = getattr(self.optimizer, "step_count", None)
        self.optimizer.step()
        return before is None or self.optimizer.step_count != before

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def sticking_meter(self) -> StickingMeter:
        if isinstance(self.optimizer, (ShadowOptimizer, AdamWSR)):
            return StickingMeter.for_optimizer(self.optimizer)
        return StickingMeter([(n, p) for n, p in self.model.named_parameters() if p.requires_grad])

    def digest(self) -> str:
        """Combined digest of the working weights (what forward passes and rollouts use)."""
        return combined_digest(weight_digests(self.model))

    def state_dict(self) -> dict[str, Any]:
        return {"precision": dataclasses.asdict(self.config), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["precision"]["precision"] != self.config.precision:
            raise ValueError(f"checkpoint precision {state['precision']['precision']!r} != {self.config.precision!r}")
        self.optimizer.load_state_dict(state["optimizer"])


def apply_precision(
    model: nn.Module,
    config: PrecisionConfig | str | Mapping[str, Any],
    optimizer_cls: type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
    **optimizer_kwargs: Any,
) -> TrainingPrecision:
    """Convert ``model``'s parameters for ``config`` and build its optimizer; one call.

    ``model`` may come in FP32 (its values become the FP32 shadows) or already in BF16/FP16.
    Buffers are left as they are. Returns a ``TrainingPrecision``.
    """
    if not isinstance(config, PrecisionConfig):
        config = PrecisionConfig.from_dict(config)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    p_ = config.precision
    if p_ == "fp32":
        for _, p in named:
            p.data = p.data.float()
        optimizer = optimizer_cls([p for _, p in named], **optimizer_kwargs)
    elif p_ == "bf16-pure-sr":
        if optimizer_cls not in (torch.optim.AdamW, torch.optim.Adam, AdamWSR):
            raise PrecisionConfigError(
                f"precision bf16-pure-sr implements AdamW with stochastic rounding; optimizer "
                f"{getattr(optimizer_cls, '__name__', optimizer_cls)} is not supported there (use torch.optim.AdamW, "
                "or precision bf16-sr to run any optimizer on FP32 shadows)"
            )
        if optimizer_cls is torch.optim.Adam:
            optimizer_kwargs.setdefault("weight_decay", 0.0)
        for _, p in named:
            p.data = p.data.to(torch.bfloat16)  # round-to-nearest, as a BF16 checkpoint would be
        optimizer = AdamWSR(named, seed=config.seed, moment_dtype=config.moment_dtype,
                            backend=config.backend, **optimizer_kwargs)
    else:
        scaler = None
        if p_ == "fp16":
            dynamic = config.loss_scale == "dynamic"
            scaler = DynamicLossScaler(
                init_scale=config.initial_loss_scale if dynamic else float(config.loss_scale),
                growth_interval=config.loss_scale_window, dynamic=dynamic,
            )
        working = config.working_dtype
        for name, p in named:
            if p.dtype not in (torch.float32, working):
                raise PrecisionConfigError(
                    f"parameter {name!r} is {p.dtype}; precision {p_} needs FP32 or {working} parameters"
                )
        optimizer = ShadowOptimizer(named, optimizer_cls, seed=config.seed, mode=config.rounding,
                                    working_dtype=working, loss_scaler=scaler, backend=config.backend,
                                    **optimizer_kwargs)
    return TrainingPrecision(model, optimizer, config)
