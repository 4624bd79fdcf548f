"""Pure-BF16 AdamW with stochastic rounding (BF16-AdamW-SR, arXiv 2502.20566).

No FP32 master: each step computes the AdamW update in FP32 from the BF16 parameter and writes
``round(p + update)`` back with the parameter's rounding key. Data-parallel replicas draw the
same key, so they stay bit-identical without exchanging weights.
"""

from __future__ import annotations

from operator import attrgetter, is_, itemgetter
from typing import Any

import numpy as np
import torch

from ..numerics import backends
from ..numerics.fused import AdamWPiece, AdamWPlan
from ..numerics.key import check_key_state, check_mode
from ..numerics.shards import is_dtensor, local_shard
from .counter import CountsSteps, StepCounter
from .fused_step import FusedAdamWSteps
from .params import ParamsLike, named_param_groups

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_GRAD = attrgetter("grad")
_EXP_AVG, _EXP_AVG_SQ = itemgetter("exp_avg"), itemgetter("exp_avg_sq")


class AdamWSR(FusedAdamWSteps, CountsSteps, torch.optim.Optimizer):
    """AdamW on BF16 parameters with keyed stochastic rounding of the result.

    ``moment_dtype="bf16"`` stores both moments in BF16, stochastically rounded with the keys
    ``"<param name>#exp_avg"`` and ``"<param name>#exp_avg_sq"`` (so they are replica-identical too).
    The key's step is the optimizer step (1 for the first), as in ``ShadowOptimizer``.
    """

    # what the plan was built on (checked by identity on the usual step)
    _states: list[dict]
    _tensors: list[torch.Tensor]
    _plan_exp_avgs: list[torch.Tensor]
    _plan_exp_avg_sqs: list[torch.Tensor]
    _plan_addresses: list[int]

    def __init__(
        self,
        params: ParamsLike,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        seed: int = 0,
        mode: str = "stochastic",
        moment_dtype: str = "fp32",
        backend: str = "auto",
        capturable: bool = False,
    ):
        if moment_dtype not in MOMENT_DTYPES:
            raise ValueError(f"moment_dtype must be one of {', '.join(MOMENT_DTYPES)}, got {moment_dtype!r}")
        if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr}, betas={betas}, eps={eps}")
        groups = named_param_groups(params)
        for group in groups:
            for name, p in zip(group["param_names"], group["params"]):
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"AdamWSR updates BF16 parameters in place; {name!r} is {p.dtype}")
        self.seed, self.mode, self.backend = seed, check_mode(mode), backend
        self.moment_dtype = MOMENT_DTYPES[moment_dtype]
        self._counter = StepCounter()
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._plan: AdamWPlan | None = None
        self._sharded = any(is_dtensor(p) for group in self.param_groups for p in group["params"])
        if capturable:
            devices = {p.device for group in self.param_groups for p in group["params"]}
            if (
                self._sharded
                or len(devices) != 1
                or mode == "nearest"
                or not backends.choose(backend, "capturable", next(iter(devices))).device_keys
            ):
                raise ValueError(
                    "AdamWSR(capturable=True) needs plain (unsharded) parameters on one CUDA device with "
                    "the Triton backend (keys derived on the device) and a keyed mode"
                )
            self._counter = StepCounter(0, next(iter(devices)))

    @property
    def _fused_groups(self) -> list[dict]:
        return self.param_groups

    def _grads(self) -> list:
        if self._sharded:
            return [None if p.grad is None else _local_shard(p.grad)[0] for p in self._tensors]
        return list(map(_GRAD, self._tensors))  # checked (and made contiguous where needed) by the plan

    def _advance_adam_steps(self, live) -> np.ndarray:
        steps = self._adam_steps  # mirrors each state's "step", read when the plan is (re)built
        if live is None:
            steps += 1
            for st, step in zip(self._states, steps.tolist()):
                st["step"] = step
        else:
            steps[live] += 1
            for i in live.tolist():
                self._states[i]["step"] = int(steps[i])
        return steps

    def _ensure_plan(self) -> AdamWPlan:
        """The fused plan over every parameter's local piece and its moments, built on the first
        step and again whenever a parameter or a moment tensor was replaced (a loaded state)."""
        if self._plan is None or not self._plan_is_current():
            self._plan = self._build_plan()
        return self._plan

    def _plan_is_current(self) -> bool:
        """The usual step: the same parameters, moments and storage (C-level passes)."""
        states = self._states
        same = all(map(is_, map(_EXP_AVG, states), self._plan_exp_avgs)) and all(
            map(is_, map(_EXP_AVG_SQ, states), self._plan_exp_avg_sqs)
        )
        return same and (self._sharded or list(map(torch.Tensor.data_ptr, self._tensors)) == self._plan_addresses)

    def _build_plan(self) -> AdamWPlan:
        """The moments where missing, what the usual step checks the plan against, Adam's
        per-parameter steps, and the plan over each parameter's local piece."""
        self._params = [(gi, p) for gi, group in enumerate(self.param_groups) for p in group["params"]]
        self._tensors = [p for _, p in self._params]
        for _, p in self._params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype)
        self._states = [self.state[p] for _, p in self._params]
        self._group_of = np.asarray([gi for gi, _ in self._params], dtype=np.int64)
        self._plan_exp_avgs = list(map(_EXP_AVG, self._states))
        self._plan_exp_avg_sqs = list(map(_EXP_AVG_SQ, self._states))
        self._plan_addresses = [] if self._sharded else [p.data_ptr() for _, p in self._params]
        if self._counter.capturable:
            self._check_capturable_steps(rebuilt=self._plan is not None)
        self._adam_steps = np.asarray([int(st["step"]) for st in self._states], dtype=np.int64)
        names = {id(p): n for group in self.param_groups for n, p in zip(group["param_names"], group["params"])}
        pieces = []
        for _, p in self._params:
            local, offset, rows = _local_shard(p)
            m, v = (_local_shard(self.state[p][k])[0] for k in ("exp_avg", "exp_avg_sq"))
            pieces.append(AdamWPiece(names[id(p)], local.detach(), m, v, None, offset, rows))
        return AdamWPlan(pieces, backend=self.backend)

    def _check_capturable_steps(self, rebuilt: bool) -> None:
        """Capturable, every parameter steps with the key: no plan is built inside a CUDA graph's
        capture, and Adam's steps equal the key's (a replaced tensor takes the key's step: the
        host steps did not follow the device's)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "AdamWSR(capturable=True): run one step before capturing it in a CUDA graph "
                "(the first step builds the fused plan and the moments)"
            )
        if rebuilt:
            for _, p in self._params:
                self.state[p]["step"] = self.step_count
        steps = {self.state[p]["step"] for _, p in self._params}
        if steps - {self.step_count}:
            raise ValueError(
                f"AdamWSR(capturable=True) steps every parameter together: Adam steps "
                f"{sorted(steps)} differ from the key's step {self.step_count}"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._plan = None

    def dist_sr_meta(self) -> dict[str, Any]:
        """The rounding key's state, saved beside the moments."""
        return {"seed": self.seed, "mode": self.mode, "step": self.step_count}

    def state_dict(self) -> dict[str, Any]:
        if self._counter.capturable:  # Adam's steps advanced on the device with the key's step
            step = self.step_count
            for group in self.param_groups:
                for p in group["params"]:
                    if self.state[p]:
                        self.state[p]["step"] = step
        sd = super().state_dict()
        sd["dist_sr"] = self.dist_sr_meta()
        # a copy in the first group survives torch.distributed.checkpoint's optimizer state dicts,
        # which keep only "state" and "param_groups"
        sd["param_groups"][0]["dist_sr"] = self.dist_sr_meta()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict.get("param_groups") or [{}]
        meta = state_dict.get("dist_sr", groups[0].get("dist_sr"))
        if meta is None:
            raise ValueError("state dict has no 'dist_sr' entry: it was not written by AdamWSR")
        check_key_state(meta, seed=self.seed, mode=self.mode)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "dist_sr"})
        self.step_count = int(meta["step"])
        for group in self.param_groups:
            group.pop("dist_sr", None)
        # torch casts loaded floating state to the parameter's dtype (BF16): put the saved moments
        # back as they were, so FP32 moments survive a reload bit for bit
        # (keys are whatever the saved groups list: indices, or FQNs from torch.distributed.checkpoint)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = dict(zip(saved_ids, (p for group in self.param_groups for p in group["params"])))
        for index, saved in state_dict["state"].items():
            p = params[index]
            for key in ("exp_avg", "exp_avg_sq"):
                self.state[p][key] = saved[key].to(device=p.device, dtype=self.moment_dtype, copy=True)
        self._plan = None


def _local_shard(t: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, int] | None]:
    """The tensor to update in place and its global offset (a DTensor's local shard; a plain
    tensor is its own, at offset 0), on a detached view of the storage."""
    return local_shard(t.detach())
