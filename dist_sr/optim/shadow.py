"""FP32 shadow weights behind low-precision working weights (the arXiv 2611.13545 recipe).

The model holds BF16 (or FP16) parameters: the forward pass, the backward pass and the rollout
engines use them. Any torch optimizer runs on FP32 shadow copies; after each step the working
weights become ``round(shadow)`` under the rounding key (seed, step, parameter name, element).
"""

from __future__ import annotations

from operator import attrgetter, is_, itemgetter
from typing import Any, Callable

import numpy as np
import torch

from ..numerics import RoundingBatch, RoundingJob, backends, stochastic_round
from ..numerics.fused import AdamWPiece, AdamWPlan
from ..numerics.key import check_key_state, check_mode, normalize_param_name
from .counter import CountsSteps, StepCounter
from .fused_step import FusedAdamWSteps
from .loss_scale import DynamicLossScaler
from .params import ParamsLike, named_param_groups

STATE_FORMAT = "dist-sr/shadow-optimizer/v1"
_GRAD = attrgetter("grad")
_EXP_AVG, _EXP_AVG_SQ, _STEP = itemgetter("exp_avg"), itemgetter("exp_avg_sq"), itemgetter("step")
WORKING_DTYPES = (torch.bfloat16, torch.float16)


class ShadowOptimizer(CountsSteps, torch.optim.Optimizer):
    """Runs ``optimizer_cls`` on FP32 shadows and writes ``round(shadow)`` into the working params.

    Args:
        params: a module, ``module.named_parameters()`` or groups of ``(name, param)`` pairs.
            Working params must be BF16 or FP16, unless ``working_dtype`` is given: then FP32
            params are converted to it here and their FP32 values become the shadows.
        optimizer_cls: any ``torch.optim.Optimizer`` class; ``optimizer_kwargs`` go to it.
        seed, mode: the rounding key's seed and mode (``nearest``, ``stochastic``, ``dither``).
            FP16 working weights support ``nearest`` only.
        loss_scaler: a ``DynamicLossScaler`` for FP16 working weights (skips inf/NaN steps).
        skip_nonfinite: without a loss scaler, a step whose gradients hold inf/NaN is skipped too
            (no update, no new key step; counted in ``skipped_steps``), so one bad batch never
            turns the shadows into NaN. It reuses the norm from ``clip_grad_norm_`` when that was
            called, else costs one norm pass; one host sync either way. Not with ``capturable``.
        capturable: keep the key's step on the device and derive each step's keys there, so
            ``step()`` can be captured in a CUDA graph and replayed (CUDA, BF16 weights; give
            the inner optimizer its own capturable option). Run one step before capturing.

    The key's step is ``self.step_count``: 0 for the initial rounding, ``k`` for the result of
    the k-th optimizer step. At all times ``working == round(shadow, step=self.step_count)``.
    """

    _found_inf: Any  # set with _grads_in_shadows (an FP32 flag tensor or bool)

    def __init__(
        self,
        params: ParamsLike,
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        seed: int = 0,
        mode: str = "stochastic",
        working_dtype: torch.dtype | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        backend: str = "auto",
        capturable: bool = False,
        skip_nonfinite: bool | None = None,
        **optimizer_kwargs: Any,
    ):
        self.seed, self.mode, self.backend = seed, check_mode(mode), backend
        self._counter = StepCounter()
        self.loss_scaler = loss_scaler
        if skip_nonfinite and capturable:
            raise ValueError(
                "skip_nonfinite needs a host decision per step, which a captured CUDA graph cannot make; "
                "use capturable=False, or check the gradients before replaying"
            )
        self.skip_nonfinite = (not capturable) if skip_nonfinite is None else skip_nonfinite
        self.skipped_steps = 0  # steps skipped for non-finite gradients without a loss scaler
        self._norm: torch.Tensor | None = None
        groups = named_param_groups(params)
        self._pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, working, shadow)
        inner_groups = []
        for group in groups:
            named_shadows = []
            for name, p in zip(group["param_names"], group["params"]):
                shadow = self._make_shadow(name, p, working_dtype)
                self._pairs.append((name, p, shadow))
                named_shadows.append((name, shadow))
            inner_groups.append(
                {**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": named_shadows}
            )
        self._check_names_unique()
        self.inner = optimizer_cls(inner_groups, **optimizer_kwargs)
        self._constructed = False
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self._constructed = True
        self.param_groups = self.inner.param_groups  # one set of groups: LR schedulers reach inner
        self.state = self.inner.state
        self._grads_in_shadows = False
        self._batch: RoundingBatch | None = None
        if capturable:
            self._make_capturable()
        self.write_working()

    def _make_capturable(self) -> None:
        devices = {p.device for _, p, _ in self._pairs}
        if len(devices) != 1 or not backends.choose(self.backend, "capturable", next(iter(devices))).device_keys:
            raise ValueError(
                f"capturable needs every parameter on one CUDA device with the Triton backend (keys "
                f"derived on the device), got {sorted(map(str, devices))} and backend {self.backend!r}"
            )
        if any(p.dtype != torch.bfloat16 for _, p, _ in self._pairs) or self.loss_scaler is not None:
            raise ValueError(
                "capturable needs BF16 working weights and no loss scaler (an FP16 step that may be "
                "skipped cannot replay from a CUDA graph)"
            )
        if self.mode == "nearest":
            raise ValueError("capturable is for keyed modes; round-to-nearest needs no keys (use capturable=False)")
        self._counter = StepCounter(self._counter.value, next(iter(devices)))

    # -- construction --------------------------------------------------------------------------

    def _make_shadow(self, name: str, p: torch.Tensor, working_dtype: torch.dtype | None) -> torch.Tensor:
        if working_dtype is not None and p.dtype == torch.float32:
            if working_dtype not in WORKING_DTYPES:
                raise ValueError(f"working_dtype must be bfloat16 or float16, got {working_dtype}")
            shadow = p.detach().clone()
            p.data = torch.empty_like(p, dtype=working_dtype)
        elif p.dtype in WORKING_DTYPES:
            shadow = p.detach().to(torch.float32)
        else:
            raise TypeError(
                f"parameter {name!r} is {p.dtype}: ShadowOptimizer keeps FP32 shadows of BF16/FP16 "
                "working weights; pass working_dtype=torch.bfloat16 to convert an FP32 model, or use "
                "a plain torch optimizer for FP32 training"
            )
        if p.dtype == torch.float16 and self.mode != "nearest":
            raise ValueError(
                f"parameter {name!r} is float16: stochastic rounding is defined for BF16 working "
                "weights only; use BF16 weights (precision bf16-sr) or mode='nearest' for FP16"
            )
        return shadow

    def _check_names_unique(self) -> None:
        seen: dict[str, str] = {}
        for name, _, _ in self._pairs:
            key = normalize_param_name(name)
            if key in seen:
                raise ValueError(f"parameters {seen[key]!r} and {name!r} normalise to the same key {key!r}")
            seen[key] = name

    # -- the training step -------------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on (scaled when a loss scaler is set)."""
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler else loss

    def _move_grads(self) -> bool:
        """Copy working grads into FP32 shadow grads (unscaled). True if the step must be skipped."""
        if self._grads_in_shadows:
            return self._found_inf
        dst, src = [], []
        for _, p, s in self._pairs:
            if p.grad is None:
                s.grad = None
            elif s.grad is None or s.grad.shape != s.shape:
                s.grad = p.grad.detach().to(torch.float32)
            else:
                dst.append(s.grad)
                src.append(p.grad)
        if dst:
            torch._foreach_copy_(dst, src)  # one call for all parameters
        found_inf = False
        if self.loss_scaler is not None:
            found_inf = self.loss_scaler.unscale_(s.grad for _, _, s in self._pairs if s.grad is not None)
        self._grads_in_shadows, self._found_inf, self._norm = True, found_inf, None
        return found_inf

    def _nonfinite(self) -> bool:
        """Without a loss scaler: whether this step's FP32 gradients hold inf/NaN."""
        if self._norm is None:
            grads = [s.grad for _, _, s in self._pairs if s.grad is not None]
            if not grads:
                return False
            self._norm = torch.stack([n.to(torch.float32) for n in torch._foreach_norm(grads)]).sum()
        return not bool(torch.isfinite(self._norm))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the FP32 (unscaled) gradients; returns their total norm before clipping."""
        found_inf = self._move_grads()
        shadows = [s for _, _, s in self._pairs if s.grad is not None]
        if found_inf or not shadows:
            return torch.tensor(float("inf") if found_inf else 0.0)
        self._norm = torch.nn.utils.clip_grad_norm_(shadows, max_norm, norm_type=norm_type, foreach=True)
        return self._norm

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step on the shadows, then round them into the working weights.

        A closure is evaluated with grad enabled before the step, as torch optimizers do.
        With a loss scaler, a step whose gradients hold inf/NaN is skipped (no update, no new key
        step) and the scale shrinks.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = self._move_grads()
        if self.loss_scaler is None and self.skip_nonfinite and self._nonfinite():
            self.skipped_steps += 1
            found_inf = True
        self._grads_in_shadows, self._norm = False, None
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        if found_inf:
            return loss
        self.inner.step()
        if self._counter.capturable:
            self._working_batch().run_on_device(self._counter.device_step(self.seed, self.mode))
            self._counter.advance()
        else:
            self.step_count += 1
            self.write_working()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p, s in self._pairs:
            for t in (p, s):
                if t.grad is None:
                    continue
                if set_to_none:
                    t.grad = None
                else:
                    t.grad.zero_()
        self._grads_in_shadows = False

    def write_working(self) -> None:
        """Set every working weight to ``round(shadow, step=self.step_count)`` (one kernel call for
        all BF16 weights; FP16 weights round to nearest)."""
        with torch.no_grad():
            self._working_batch().run(seed=self.seed, step=self.step_count, mode=self.mode)
            fp16 = [(p, s) for _, p, s in self._pairs if p.dtype == torch.float16]
            if fp16:
                torch._foreach_copy_([p for p, _ in fp16], [s for _, s in fp16])

    def _working_batch(self) -> RoundingBatch:
        if self._batch is None:
            with torch.no_grad():
                self._batch = RoundingBatch(
                    [RoundingJob(n, s, p) for n, p, s in self._pairs if p.dtype == torch.bfloat16], backend=self.backend
                )
        return self._batch

    def derived_working(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, round(shadow))`` for every parameter, computed afresh from the shadows with the
        rounding key (not read from the working weights): what they must hold."""
        out = []
        with torch.no_grad():
            for n, p, s in self._pairs:
                if p.dtype == torch.bfloat16:
                    w = stochastic_round(
                        s, seed=self.seed, step=self.step_count, param=n, mode=self.mode, backend=self.backend
                    )
                else:
                    w = s.to(p.dtype)
                out.append((n, w))
        return out

    # -- access ------------------------------------------------------------------------------

    def named_shadows(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, working_param, fp32_shadow)`` for every parameter, in construction order."""
        return list(self._pairs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._constructed:  # Optimizer.__init__ registering the inner optimizer's groups
            return super().add_param_group(param_group)
        raise NotImplementedError("ShadowOptimizer cannot add parameter groups after construction")

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Shadows (by normalised name), the inner optimizer's state, seed, mode and step."""
        return {
            "format": STATE_FORMAT,
            "seed": self.seed,
            "mode": self.mode,
            "step": self.step_count,
            "shadows": {normalize_param_name(n): s for n, _, s in self._pairs},
            "inner": self.inner.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore shadows and optimizer state, then re-derive the working weights bit-identically."""
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a ShadowOptimizer state (format {state_dict.get('format')!r}, expected {STATE_FORMAT!r})"
            )
        check_key_state(state_dict, seed=self.seed, mode=self.mode)
        shadows = state_dict["shadows"]
        ours = {normalize_param_name(n): s for n, _, s in self._pairs}
        if set(shadows) != set(ours):
            missing, extra = sorted(set(ours) - set(shadows)), sorted(set(shadows) - set(ours))
            raise ValueError(
                f"checkpoint shadows do not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for name, s in ours.items():
            src = shadows[name]
            if src.shape != s.shape or src.dtype != torch.float32:
                raise ValueError(
                    f"checkpoint shadow {name!r} is {src.dtype}{tuple(src.shape)}, expected float32{tuple(s.shape)}"
                )
            s.copy_(src)
        self.inner.load_state_dict(state_dict["inner"])
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.step_count = int(state_dict["step"])
        if self.loss_scaler is not None and state_dict.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self._state_loaded()
        self.write_working()

    def _state_loaded(self) -> None:
        """Hook for subclasses that cache views of the optimizer state."""


class ShadowAdamW(FusedAdamWSteps, ShadowOptimizer):
    """FP32-shadow AdamW whose step is one fused pass over all parameters (one C++ call on CPU,
    one Triton launch on CUDA).

    It reads the BF16 working gradients directly (no FP32 gradient copy), updates the FP32 shadow
    and moments, and writes the keyed rounding into the BF16 working weights. State layout and
    checkpoints are those of ``ShadowOptimizer(torch.optim.AdamW)``: a run may switch between them.
    ``clip_grad_norm_`` computes the scale on the device and the fused pass applies it, so a
    step never waits for the GPU.
    """

    _plan_states: list[Any]  # the optimizer states the plan was built on (checked by identity)
    _plan_moments: list[list[Any]]  # their exp_avg, exp_avg_sq and step tensors

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        seed: int = 0,
        mode: str = "stochastic",
        working_dtype=None,
        backend: str = "auto",
        capturable: bool = False,
    ):
        # the fused pass makes no host decision per step: non-finite gradients are the caller's to
        # check (the trainer skips on the norm clip_grad_norm_ returns)
        super().__init__(
            params,
            torch.optim.AdamW,
            seed=seed,
            mode=mode,
            working_dtype=working_dtype,
            backend=backend,
            capturable=capturable,
            skip_nonfinite=False,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            foreach=False,
        )
        for name, p, _ in self._pairs:
            if p.dtype != torch.bfloat16:
                raise TypeError(f"ShadowAdamW needs BF16 working weights; {name!r} is {p.dtype} (use ShadowOptimizer)")
        self._plan: AdamWPlan | None = None
        self._plan_addresses: list[int] = []
        self._adam_steps = np.zeros(0, dtype=np.int64)  # Adam's step per parameter, mirrored from state["step"]
        group_of = {id(s): gi for gi, group in enumerate(self.inner.param_groups) for s in group["params"]}
        self._group_of = np.asarray([group_of[id(s)] for _, _, s in self._pairs], dtype=np.int64)
        self._shadows = [s for _, _, s in self._pairs]
        self._workings = [p for _, p, _ in self._pairs]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The total norm of the working gradients (FP32, on their device); the next ``step``
        scales them by ``min(1, max_norm / (norm + 1e-6))`` inside the fused pass."""
        grads = [p.grad for _, p, _ in self._pairs if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
        norm = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        self._grad_scale = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0).reshape(1)
        return norm

    def _state_loaded(self) -> None:
        self._plan = None

    def _ensure_plan(self) -> AdamWPlan:
        """The fused plan over (shadow, moments, working weight) of every parameter, rebuilt when
        any of those tensors was replaced (a loaded state dict, a moved model)."""
        if self._plan is not None and not self._plan_is_current():
            self._plan = None
        if self._plan is None:
            if self._counter.capturable and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "ShadowAdamW(capturable=True): run one step before capturing it in a CUDA graph "
                    "(the first step builds the fused plan and the optimizer state)"
                )
            self._plan = self._build_plan()
        return self._plan

    def _plan_is_current(self) -> bool:
        """The usual step: same moments, same step tensors, same working storage (C-level passes)."""
        states: list[Any] = list(map(self.inner.state.get, self._shadows))
        return (
            all(map(is_, states, self._plan_states))
            and all(map(is_, map(_EXP_AVG, states), self._plan_moments[0]))
            and all(map(is_, map(_EXP_AVG_SQ, states), self._plan_moments[1]))
            and all(map(is_, map(_STEP, states), self._plan_moments[2]))
            and list(map(torch.Tensor.data_ptr, self._workings)) == self._plan_addresses
        )

    def _build_plan(self) -> AdamWPlan:
        """Adam's state where missing (torch.optim.AdamW's layout, so checkpoints interchange), the
        fused plan over it, and Adam's per-parameter steps where the fused step advances them."""
        state = self.inner.state
        capturable = self._counter.capturable
        for _, _, s in self._pairs:
            if not state.get(s):
                step = torch.zeros((), dtype=torch.float32, device=s.device if capturable else "cpu")
                state[s] = {
                    "step": step,
                    "exp_avg": torch.zeros_like(s, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(s, memory_format=torch.preserve_format),
                }
        plan = AdamWPlan(
            [AdamWPiece(n, s, state[s]["exp_avg"], state[s]["exp_avg_sq"], p.data) for n, p, s in self._pairs],
            backend=self.backend,
        )
        self._plan_addresses = [p.data_ptr() for _, p, _ in self._pairs]
        self._adam_steps = np.asarray([int(state[s]["step"]) for _, _, s in self._pairs], dtype=np.int64)
        if capturable:
            if set(self._adam_steps) - {self.step_count}:
                raise ValueError(
                    "ShadowAdamW(capturable=True) steps every parameter together: the loaded Adam "
                    f"steps {sorted(set(self._adam_steps))} differ from the key's step {self.step_count}"
                )
            for _, _, s in self._pairs:  # capturable: Adam's step lives beside the state, on the device
                state[s]["step"] = state[s]["step"].to(s.device)
            self._device_steps = [state[s]["step"] for _, _, s in self._pairs]
        else:
            # torch.optim.AdamW's per-parameter step tensors, as 0-dim views of one buffer: a step
            # advances them all in one operation (a foreach add over 290 CPU scalars costs ~0.3 ms);
            # state_dict() hands out copies
            self._step_buffer = torch.tensor(self._adam_steps.tolist(), dtype=torch.float32)
            for i, (_, _, s) in enumerate(self._pairs):
                state[s]["step"] = self._step_buffer[i]
        self._plan_states = [state[s] for s in self._shadows]
        self._plan_moments = [list(map(get, self._plan_states)) for get in (_EXP_AVG, _EXP_AVG_SQ, _STEP)]
        return plan

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        inner = sd["inner"]  # each step tensor its own, as torch.optim.AdamW keeps them (here views of one buffer)
        inner["state"] = {
            k: {**st, "step": st["step"].clone()} if isinstance(st.get("step"), torch.Tensor) else st
            for k, st in inner["state"].items()
        }
        return sd

    @property
    def _fused_groups(self) -> list[dict]:
        return self.inner.param_groups

    def _grads(self) -> list:
        return list(map(_GRAD, self._workings))

    def _advance_adam_steps(self, live) -> np.ndarray:
        if live is None:
            self._adam_steps += 1
        else:
            self._adam_steps[live] += 1
        return self._adam_steps  # mirrors state["step"] (advanced in _after_step), read when the plan is built

    def _after_step(self, live) -> None:
        """Advance torch.optim.AdamW's per-parameter step tensors (checkpoints interchange)."""
        if self._counter.capturable:
            torch._foreach_add_(self._device_steps, 1.0)
            return
        if live is None:
            self._step_buffer.add_(1.0)
        elif len(live):
            self._step_buffer[live] += 1.0
