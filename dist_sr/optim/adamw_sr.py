"""Pure-BF16 AdamW with stochastic rounding (BF16-AdamW-SR, arXiv 2502.20566).

No FP32 master: each step computes the AdamW update in FP32 from the BF16 parameter and writes
``round(p + update)`` back with the parameter's rounding key. Data-parallel replicas draw the
same key, so they stay bit-identical without exchanging weights.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..numerics import RoundingJob, round_jobs
from ..numerics.key import check_mode
from .params import ParamsLike, named_param_groups

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class AdamWSR(torch.optim.Optimizer):
    """AdamW on BF16 parameters with keyed stochastic rounding of the result.

    ``moment_dtype="bf16"`` stores both moments in BF16, stochastically rounded with the keys
    ``"<param name>#exp_avg"`` and ``"<param name>#exp_avg_sq"`` (so they are replica-identical too).
    The key's step is the optimizer step (1 for the first), as in ``ShadowOptimizer``.
    """

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
        self.step_count = 0
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_count += 1
        jobs: list[RoundingJob] = []
        moment_jobs: list[RoundingJob] = []
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for name, p in zip(group["param_names"], group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype)
                state["step"] += 1
                t = state["step"]
                # a sharded (DTensor) parameter updates its local shard, keyed by global indices
                local, offset, rows = _local_shard(p)
                if not local.numel():
                    continue
                shape, row_stride = ((-1, rows[0]), rows[1]) if rows else (local.shape, None)
                local = local.view(shape)
                g = _local_shard(p.grad)[0].view(shape).to(torch.float32)
                exp_avg, exp_avg_sq = (_local_shard(state[k])[0].view(shape) for k in ("exp_avg", "exp_avg_sq"))
                m = exp_avg.to(torch.float32).lerp_(g, 1 - beta1)  # in place for FP32 moments
                v = exp_avg_sq.to(torch.float32).mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)  # torch.optim.AdamW's order
                new = local.to(torch.float32).mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - beta1**t))
                jobs.append(RoundingJob(name, new, local, offset, row_stride))
                if self.moment_dtype != torch.float32:
                    moment_jobs.append(RoundingJob(f"{name}#exp_avg", m, exp_avg, offset, row_stride))
                    moment_jobs.append(RoundingJob(f"{name}#exp_avg_sq", v, exp_avg_sq, offset, row_stride))
        round_jobs(jobs + moment_jobs, seed=self.seed, step=self.step_count, mode=self.mode, backend=self.backend)
        return loss

    def dist_sr_meta(self) -> dict[str, Any]:
        """The rounding key's state, saved beside the moments."""
        return {"seed": self.seed, "mode": self.mode, "step": self.step_count}

    def state_dict(self) -> dict[str, Any]:
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
        for field in ("seed", "mode"):
            if meta[field] != getattr(self, field):
                raise ValueError(
                    f"checkpoint was written with {field}={meta[field]!r} but this optimizer has "
                    f"{field}={getattr(self, field)!r}; construct it with {field}={meta[field]!r} to resume"
                )
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


def _local_shard(t: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, int] | None]:
    """The tensor to update in place and its global offset: ``fsdp2.local_shard`` (a DTensor's
    local shard; a plain tensor is its own, at offset 0), on a detached view of the storage."""
    from ..integrations.fsdp2 import local_shard

    return local_shard(t.detach())
