"""The precision switch: one config value picks how a model's working weights are kept.

    fp32          FP32 weights, plain optimizer
    fp16          FP16 working weights, FP32 shadows, round-to-nearest, dynamic loss scaling
    bf16          BF16 working weights, FP32 shadows, round-to-nearest (the usual mixed precision)
    bf16-sr       BF16 working weights, FP32 shadows, keyed stochastic rounding (fresh bits/step)
    bf16-dither   as bf16-sr with one frozen threshold per element
    bf16-pure-sr  BF16 weights, no FP32 master, AdamW update stochastically rounded (AdamWSR)

Each is one ``Precision`` entry in ``PRECISION_REGISTRY``: what its working weights are, how they
are rounded, whether FP32 shadows exist. Training engines read those properties, never the
names. ``PrecisionConfig.from_dict`` / ``from_yaml`` validate at load time; ``apply_precision``
turns a model and an optimizer class into a ``TrainingPrecision`` that runs backward and step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import yaml
from torch import nn

from .config import Refusal, check_fields
from .numerics import backends
from .optim import AdamWSR, DynamicLossScaler, ShadowOptimizer, StickingMeter
from .registry import Registry
from .replica import combined_digest, weight_digests


@dataclass(frozen=True)
class Precision:
    """How one precision keeps the working weights the forward pass uses.

    ``rounding``: how they are derived from the FP32 values (None: they are the FP32 values);
    ``shadows``: FP32 master copies live beside them; ``pure``: BF16 weights updated in place,
    no master (AdamW-SR); ``loss_scaling``: FP16-style dynamic loss scaling applies."""

    name: str
    working_dtype: torch.dtype
    rounding: str | None
    shadows: bool
    pure: bool = False
    loss_scaling: bool = False

    @property
    def keyed(self) -> bool:
        """The rounding draws keyed random bits (SR or dither), so its bits need the key's state."""
        return self.rounding in ("stochastic", "dither")


PRECISION_REGISTRY: Registry[Precision] = Registry("precision")


def register_precision(precision: Precision) -> None:
    PRECISION_REGISTRY.register(precision.name, precision)


for _p in (
    Precision("fp32", torch.float32, None, shadows=False),
    Precision("fp16", torch.float16, "nearest", shadows=True, loss_scaling=True),
    Precision("bf16", torch.bfloat16, "nearest", shadows=True),
    Precision("bf16-sr", torch.bfloat16, "stochastic", shadows=True),
    Precision("bf16-dither", torch.bfloat16, "dither", shadows=True),
    Precision("bf16-pure-sr", torch.bfloat16, "stochastic", shadows=False, pure=True),
):
    register_precision(_p)

PRECISIONS = tuple(PRECISION_REGISTRY)
# fields that only mean something for some precisions
_ONLY_FOR = {
    "loss_scale": lambda p: p.loss_scaling,
    "initial_loss_scale": lambda p: p.loss_scaling,
    "loss_scale_window": lambda p: p.loss_scaling,
    "moment_dtype": lambda p: p.pure,
}


class PrecisionConfigError(Refusal, ValueError):
    """A precision setting is wrong (the config loader prefixes the field's path)."""

    what = "config error"


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@dataclass(frozen=True)
class PrecisionConfig:
    precision: str = "bf16-sr"
    seed: int = 0
    loss_scale: str | float = "dynamic"  # fp16: "dynamic" or a static scale
    initial_loss_scale: float = 2.0**16  # fp16, dynamic
    loss_scale_window: int = 1000  # fp16, dynamic: clean steps before the scale doubles
    moment_dtype: str = "fp32"  # bf16-pure-sr: "fp32" or "bf16"
    backend: str = "auto"  # rounding backend

    def __post_init__(self):
        if self.precision not in PRECISION_REGISTRY:
            raise PrecisionConfigError(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISION_REGISTRY)}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**64:
            raise PrecisionConfigError(f"precision.seed must be an int in [0, 2^64), got {self.seed!r}")
        if not (self.loss_scale == "dynamic" or _positive_finite(self.loss_scale)):
            raise PrecisionConfigError(
                f"precision.loss_scale must be 'dynamic' or a finite number > 0, got {self.loss_scale!r}"
            )
        if not _positive_finite(self.initial_loss_scale) or self.initial_loss_scale > 2.0**64:
            raise PrecisionConfigError(
                f"precision.initial_loss_scale must be a finite number in (0, 2^64], got "
                f"{self.initial_loss_scale!r} (a NaN or zero scale skips every step); the "
                "usual start is 65536"
            )
        if self.moment_dtype not in ("fp32", "bf16"):
            raise PrecisionConfigError(f"precision.moment_dtype must be 'fp32' or 'bf16', got {self.moment_dtype!r}")
        if self.backend not in backends.names():
            raise PrecisionConfigError(
                f"precision.backend must be one of {', '.join(backends.names())}, got {self.backend!r}"
            )
        if not isinstance(self.loss_scale_window, int) or self.loss_scale_window < 1:
            raise PrecisionConfigError(
                f"precision.loss_scale_window must be an int >= 1, got {self.loss_scale_window!r}"
            )

    @property
    def spec(self) -> Precision:
        """This precision's registry entry."""
        return PRECISION_REGISTRY[self.precision]

    @property
    def rounding(self) -> str | None:
        """The rounding mode of the working weights (None for fp32)."""
        return self.spec.rounding

    @property
    def working_dtype(self) -> torch.dtype:
        return self.spec.working_dtype

    @classmethod
    def from_config(cls, data, where: str = "") -> "PrecisionConfig":
        """The config loader's hook (``dist_sr.config``): the string shorthand and aliases."""
        return cls.from_dict(data)

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
        try:
            check_fields(cls, data, kind="precision")
        except ValueError as exc:
            raise PrecisionConfigError(str(exc)) from None
        config = cls(**data)
        for name, applies in _ONLY_FOR.items():
            if name in data and not applies(config.spec):
                allowed = [p.name for p in PRECISION_REGISTRY.values() if applies(p)]
                raise PrecisionConfigError(
                    f"precision.{name} applies only to precision {' or '.join(allowed)}, "
                    f"but precision is {config.precision!r}; remove {name} or change the precision"
                )
        return config

    def to_dict(self) -> dict[str, Any]:
        """The fields that apply to this precision; ``from_dict`` of the result is ``self``."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _ONLY_FOR or _ONLY_FOR[f.name](self.spec)
        }

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
        """Combined digest of the working weights as they are (what forward passes and rollouts use)."""
        return combined_digest(weight_digests(self.model))

    def expected_digest(self) -> str:
        """The same digest of the working weights re-derived from the FP32 shadows with the rounding
        key: an independent path to the bits ``digest`` reads (equal unless the working weights went
        wrong). Without shadows (fp32, pure BF16) the weights are the state: ``digest``."""
        if not isinstance(self.optimizer, ShadowOptimizer):
            return self.digest()
        return combined_digest(weight_digests(self.optimizer.derived_working()))

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
    spec, p_ = config.spec, config.precision
    if not spec.shadows and not spec.pure:  # FP32 weights: the optimizer as it is
        for _, p in named:
            p.data = p.data.float()
        optimizer = optimizer_cls([p for _, p in named], **optimizer_kwargs)
    elif spec.pure:
        if optimizer_cls not in (torch.optim.AdamW, torch.optim.Adam, AdamWSR):
            raise PrecisionConfigError(
                f"precision {p_} implements AdamW with stochastic rounding; optimizer "
                f"{getattr(optimizer_cls, '__name__', optimizer_cls)} is not supported there (use torch.optim.AdamW, "
                "or precision bf16-sr to run any optimizer on FP32 shadows)"
            )
        if optimizer_cls is torch.optim.Adam:
            optimizer_kwargs.setdefault("weight_decay", 0.0)
        for _, p in named:
            p.data = p.data.to(torch.bfloat16)  # round-to-nearest, as a BF16 checkpoint would be
        optimizer = AdamWSR(
            named, seed=config.seed, moment_dtype=config.moment_dtype, backend=config.backend, **optimizer_kwargs
        )
    else:
        scaler = None
        if spec.loss_scaling:
            dynamic = config.loss_scale == "dynamic"
            scaler = DynamicLossScaler(
                init_scale=config.initial_loss_scale if dynamic else float(config.loss_scale),
                growth_interval=config.loss_scale_window,
                dynamic=dynamic,
            )
        working = config.working_dtype
        for name, p in named:
            if p.dtype not in (torch.float32, working):
                raise PrecisionConfigError(
                    f"parameter {name!r} is {p.dtype}; precision {p_} needs FP32 or {working} parameters"
                )
        optimizer = ShadowOptimizer(
            named,
            optimizer_cls,
            seed=config.seed,
            mode=config.rounding,
            working_dtype=working,
            loss_scaler=scaler,
            backend=config.backend,
            **optimizer_kwargs,
        )
    return TrainingPrecision(model, optimizer, config)
