"""What a vLLM worker loaded: the layout-free digest of the weights it serves now, under the
trainer's (Hugging Face) names, however they arrived (the checkpoint loader, dist-sr's backend,
TRL's ``load_weights`` push, vLLM's NCCL weight transfer). Every one of those ends in the model's
``load_weights``, so that is where it is recorded: every tensor handed to it, in the dtype the
engine stores (vLLM's loaders copy into the parameter, which casts round-to-nearest), summed as
it streams through. ``install_load_recorder`` (run by the ``vllm.general_plugins`` entry point in
every vLLM process) puts the record on each model vLLM's default loader builds, so the checkpoint
load and every later push are seen.

Why not read the parameters back: vLLM's CPU backend repacks linear weights for oneDNN and
empties the parameters, and vLLM fuses q/k/v and gate/up into one parameter; the tensors handed
to ``load_weights`` are the trainer's own, by name. A loader that transforms weights (online
quantization) holds something else than it was handed: the record then says what was sent. A
call that raises records nothing; one that returns is taken to have stored what it was handed.
"""

from __future__ import annotations

import torch

from ...numerics.digest import dtype_name, piece_sum


class LoadRecord:
    """Digest entries of the last tensor loaded under each HF name, as the engine stores it."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.entries: dict[str, tuple[str, tuple[int, ...], int]] = {}

    def wrap(self, load_weights):
        def recording_load_weights(weights, *args, **kwargs):
            staged: dict = {}
            result = load_weights(self._see(weights, staged), *args, **kwargs)
            self.entries.update(staged)  # only a load that returned counts
            return result

        recording_load_weights.__dist_sr_record__ = self
        return recording_load_weights

    def _see(self, weights, staged: dict):
        for name, tensor in weights:
            stored = tensor.detach()
            if stored.is_floating_point() and stored.dtype != self.dtype:
                stored = stored.to(self.dtype)  # what the parameter's copy_ makes of it
            staged[name] = (
                dtype_name(stored.dtype),
                tuple(stored.shape),
                piece_sum(stored.contiguous().reshape(-1), 0),
            )
            yield name, tensor


def load_record(model: torch.nn.Module) -> LoadRecord | None:
    return getattr(getattr(model, "load_weights", None), "__dist_sr_record__", None)


def record_loads(model: torch.nn.Module, dtype: torch.dtype) -> LoadRecord:
    """Record every later ``model.load_weights`` call (idempotent)."""
    record = load_record(model)
    if record is None:
        record = LoadRecord(dtype)
        model.load_weights = record.wrap(model.load_weights)
    return record


def install_load_recorder() -> None:
    """Make vLLM's default loader record the loads of every model it builds (idempotent)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights
    if getattr(original, "__dist_sr__", False):
        return

    def load_weights(self, model, model_config):
        record_loads(model, model_config.dtype)
        return original(self, model, model_config)

    load_weights.__dist_sr__ = True
    DefaultModelLoader.load_weights = load_weights


_not_recorded: list[str] = []  # why this process records no loads (the plugin's capability check)


def not_recorded(reason: str) -> None:
    """Say why this process cannot record loads: ``report`` then answers with the reason."""
    _not_recorded.append(reason)


def report(model: torch.nn.Module) -> dict:
    """``{"method", "digests"}`` of what ``model`` holds, from its load record."""
    record = load_record(model)
    if record is None:
        if _not_recorded:
            raise RuntimeError(f"this engine's loads were not recorded: {_not_recorded[-1]}")
        raise RuntimeError(
            "this engine's loads were not recorded: dist-sr's vLLM plugin was not loaded in this "
            "process (pip install dist-sr where vLLM runs, and keep VLLM_PLUGINS unset or naming "
            "dist_sr), or the model was not loaded by vLLM's default loader"
        )
    return {"method": "recorded at load", "digests": _hex(record.entries)}


def _hex(entries: dict) -> dict:
    return {n: [d, list(shape), f"{v:016x}"] for n, (d, shape, v) in entries.items()}
