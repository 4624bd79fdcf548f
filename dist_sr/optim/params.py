"""Named parameter groups: every rounding key needs the parameter's name."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..numerics.key import normalize_param_name

ParamsLike = nn.Module | Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]]


def named_param_groups(params: ParamsLike) -> list[dict[str, Any]]:
    """Normalise ``params`` into groups ``{"params": [...], "param_names": [...], **options}``.

    Accepts a module (its trainable parameters), ``module.named_parameters()``, or a list of
    groups whose ``"params"`` are ``(name, tensor)`` pairs. Bare tensors are refused: without a
    name a parameter has no rounding key.
    """
    if isinstance(params, nn.Module):
        params = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    out: list[dict] = []
    seen: set[int] = set()
    keys: dict = {}
    for group in groups:
        if not isinstance(group, dict):
            raise TypeError("mix of parameter groups (dicts) and named parameters; pass one kind")
        pairs = list(group["params"])
        names, tensors = [], []
        for item in pairs:
            if not (
                isinstance(item, tuple)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)
            ):
                raise TypeError(
                    "parameters must be given with their names, e.g. model.named_parameters() or "
                    f"[('layer.weight', p)], got {type(item).__name__}: the name is the rounding key"
                )
            name, tensor = item
            if id(tensor) in seen:
                raise ValueError(f"parameter {name!r} appears twice")
            seen.add(id(tensor))
            key = normalize_param_name(name)  # refuses empty or malformed names
            if key in keys:
                raise ValueError(
                    f"parameters {keys[key]!r} and {name!r} normalise to the same key {key!r}: they would "
                    "get identical random bits; give each parameter its own state-dict name"
                )
            keys[key] = name
            names.append(name)
            tensors.append(tensor)
        options = {k: v for k, v in group.items() if k != "params"}
        out.append({"params": tensors, "param_names": names, **options})
    return out
