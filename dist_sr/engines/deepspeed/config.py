"""DeepSpeed JSON configs and the precision switch: the ``"stochastic_rounding"`` block, and
the mapping between a DeepSpeed config and a ``PrecisionConfig``."""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ...config import from_dict as load_section
from ...numerics.key import check_mode
from ...precision import PRECISION_REGISTRY, PrecisionConfig, PrecisionConfigError

CONFIG_KEY = "stochastic_rounding"


@dataclass(frozen=True)
class SRConfig:
    enabled: bool = True
    seed: int = 0
    mode: str = "stochastic"

    def __post_init__(self):
        try:
            check_mode(self.mode)
        except ValueError as exc:
            raise ValueError(f"mode: {exc}") from None
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")

    @classmethod
    def from_dict(cls, data: dict) -> "SRConfig":
        return load_section(cls, data, CONFIG_KEY)


SEED_ENV, MODE_ENV = "DIST_SR_SEED", "DIST_SR_MODE"


def env_config(env=None) -> SRConfig | None:
    """The SR block a job turns on from its environment (``DIST_SR_SEED``, and ``DIST_SR_MODE``,
    default ``stochastic``) for frameworks that build the DeepSpeed config themselves and offer
    no way to add a key (OpenRLHF); None when ``DIST_SR_SEED`` is unset or empty."""
    env = os.environ if env is None else env
    raw = env.get(SEED_ENV, "").strip()
    if not raw:
        return None
    try:
        seed = int(raw)
    except ValueError:
        raise ValueError(
            f"{SEED_ENV}={raw!r} is not an integer; set it to the rounding key's seed (e.g. 1234), or unset it"
        ) from None
    try:
        return SRConfig(seed=seed, mode=env.get(MODE_ENV, "stochastic") or "stochastic")
    except ValueError as exc:
        raise ValueError(f"{SEED_ENV}/{MODE_ENV}: {exc}") from None


def agree_with_env(sr: SRConfig | None, block_present: bool, env=None) -> SRConfig | None:
    """The SR setting of one ``deepspeed.initialize`` call: the config's block (``sr``, None if
    absent or disabled) or, without a block, the environment's. A block and an environment that
    say different things is an error naming both (which one was meant cannot be known)."""
    from_env = env_config(env)
    if from_env is None:
        return sr
    if not block_present:
        return from_env
    if sr is None or (sr.seed, sr.mode) != (from_env.seed, from_env.mode):
        said = "disables SR" if sr is None else f"says seed {sr.seed}, mode {sr.mode}"
        raise ValueError(
            f'the DeepSpeed config\'s "{CONFIG_KEY}" block {said}, but {SEED_ENV}={from_env.seed} '
            f"({MODE_ENV}={from_env.mode}) is set: make them agree, or drop one of the two"
        )
    return sr


def split_config(config: dict | str | Path) -> tuple[dict, SRConfig | None]:
    """DeepSpeed config without our block, and the block (None if absent or disabled)."""
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    config = copy.deepcopy(config)
    block = config.pop(CONFIG_KEY, None)
    if block is None:
        return config, None
    sr = SRConfig.from_dict(block)
    return config, (sr if sr.enabled else None)


def precision_of_config(config: dict | str | Path) -> dict:
    """The precision switch a DeepSpeed config expresses: ``{"precision": ..., "seed": ...}``.

    ``fp16.enabled`` -> fp16; ``bf16.enabled`` -> bf16, or bf16-sr / bf16-dither with an enabled
    ``stochastic_rounding`` block (its seed included); neither -> fp32. An SR block without bf16
    is refused: SR rounds to BF16 working weights.
    """
    config, sr = split_config(config)
    fp16 = bool(config.get("fp16", {}).get("enabled", False))
    bf16 = bool(config.get("bf16", config.get("bfloat16", {})).get("enabled", False))
    if fp16 and bf16:
        raise ValueError("the DeepSpeed config enables both fp16 and bf16; enable one")
    if sr is not None and not bf16:
        raise ValueError(
            f'the DeepSpeed config has an enabled "{CONFIG_KEY}" block but not "bf16": '
            '{"enabled": true}; SR rounds FP32 masters to BF16 working weights (FP16 SR is not '
            "supported), so enable bf16 or drop the block"
        )
    dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
    rounding = None if dtype is torch.float32 else sr.mode if sr is not None else "nearest"
    for p in PRECISION_REGISTRY.values():  # the precision with FP32 shadows this config describes
        if p.working_dtype is dtype and p.rounding == rounding and not p.pure:
            return {"precision": p.name, **({"seed": sr.seed} if p.keyed else {})}
    raise ValueError(f"no registered precision keeps {dtype} working weights with {rounding} rounding")


def config_for_precision(precision, base: dict | str | Path) -> dict:
    """A DeepSpeed config whose ``bf16``/``fp16`` sections and SR block follow the precision switch.

    ``precision`` is a ``PrecisionConfig`` (or its string / mapping form); ``base`` is the rest of
    the DeepSpeed config (dict or JSON path). fp32 -> neither; fp16 -> ``fp16`` with dynamic loss
    scaling; bf16 -> ``bf16`` with round-to-nearest; bf16-sr / bf16-dither -> ``bf16`` plus the SR
    block. bf16-pure-sr has no FP32 master, which DeepSpeed always keeps: refused.
    """
    if not isinstance(precision, PrecisionConfig):
        precision = PrecisionConfig.from_dict(precision)
    config, _ = split_config(base)
    config.pop("bf16", None)
    config.pop("fp16", None)
    spec = precision.spec
    if spec.pure:
        raise PrecisionConfigError(
            f"precision {spec.name} keeps no FP32 master, but DeepSpeed ZeRO always does; "
            "use bf16-sr with DeepSpeed (or the single-process AdamWSR)"
        )
    if spec.loss_scaling:
        dynamic = precision.loss_scale == "dynamic"
        power = math.log2(precision.initial_loss_scale)
        if dynamic and power != int(power):
            raise PrecisionConfigError(
                f"precision.initial_loss_scale={precision.initial_loss_scale}: DeepSpeed takes "
                "the initial scale as a power of two (initial_scale_power); use one, e.g. "
                f"{2.0 ** round(power):g}"
            )
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0 if dynamic else float(precision.loss_scale),
            "initial_scale_power": int(math.log2(precision.initial_loss_scale)),
            "loss_scale_window": precision.loss_scale_window,
        }
    elif spec.working_dtype is torch.bfloat16:
        config["bf16"] = {"enabled": True}
        if spec.keyed:
            config[CONFIG_KEY] = {"enabled": True, "seed": precision.seed, "mode": precision.rounding}
    return config


def load_ds_config(config) -> dict:
    """A config path (JSON, or HJSON as DeepSpeed accepts) or base64 string, read as DeepSpeed reads it."""
    try:
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    except ImportError:  # pragma: no cover - other DeepSpeed versions are refused before use anyway
        return json.loads(Path(config).read_text())
    return copy.deepcopy(load_ds_config(str(config)))


# The trainer's hyperparameters that a DeepSpeed JSON may also state: field -> where in the JSON.
SHARED_HYPERPARAMETERS = {
    "lr": ("optimizer", "params", "lr"),
    "betas": ("optimizer", "params", "betas"),
    "eps": ("optimizer", "params", "eps"),
    "weight_decay": ("optimizer", "params", "weight_decay"),
    "max_grad_norm": ("gradient_clipping",),
}
ADAMW_TYPES = ("adamw",)


def shared_hyperparameters(ds: dict, optimizer: str) -> dict:
    """What ``ds`` says about the trainer's hyperparameters (``SHARED_HYPERPARAMETERS`` fields it
    sets; HF-style ``"auto"`` counts as unset). Raises ``ValueError`` naming the conflict when the
    JSON configures an optimizer other than the trainer's (``optimizer``) or disables clipping,
    which dist-sr's trainer always does."""
    opt = ds.get("optimizer")
    if opt is not None:
        kind = str(opt.get("type", "")).lower()
        if optimizer != "adamw" or kind not in ADAMW_TYPES:
            raise ValueError(
                f"the DeepSpeed JSON configures optimizer {opt.get('type')!r} but the trainer's is "
                f"grpo.optimizer={optimizer!r}; remove the JSON's optimizer section (the trainer's is "
                "used) or make them the same (AdamW)"
            )
    out = {}
    for field, path in SHARED_HYPERPARAMETERS.items():
        node = ds
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None or node == "auto":
            continue
        if field == "max_grad_norm" and float(node) <= 0:
            raise ValueError(
                f"the DeepSpeed JSON's gradient_clipping={node} turns clipping off; dist-sr's trainer "
                "clips at grpo.max_grad_norm (> 0): set gradient_clipping to that value or remove it"
            )
        out[field] = tuple(float(b) for b in node) if field == "betas" else float(node)
    return out


def hyperparameter_conflicts(ds: dict, values: dict, optimizer: str) -> list[str]:
    """``field: trainer X, JSON Y`` for each hyperparameter both state and disagree on."""
    theirs = shared_hyperparameters(ds, optimizer)
    out = []
    for field, v in theirs.items():
        mine = tuple(float(b) for b in values[field]) if field == "betas" else float(values[field])
        if mine != v:
            out.append(
                f"grpo.{field}={list(mine) if field == 'betas' else mine} vs the JSON's "
                f"{'.'.join(SHARED_HYPERPARAMETERS[field])}={list(v) if field == 'betas' else v}"
            )
    return out
