"""What a vLLM worker holds, under the trainer's (Hugging Face) names, however the weights arrived
(the checkpoint loader, a dummy start the trainer fills, dist-sr's backend, TRL's ``load_weights``
push, verl's and OpenRLHF's own worker extensions, vLLM's NCCL weight transfer).

Two views, both in the dtype the engine stores:
- **as loaded** (``LoadRecord``): every tensor handed to the model's ``load_weights``, where every
  one of those transports ends, digested as it streams through (vLLM's loaders copy into the
  parameter, which casts round-to-nearest). A call that raises records nothing; one that
  returns is taken to have stored what it was handed.
- **read back** (``readback.Readback``): what the parameters hold now at the places the model's
  own loaders put each tensor, so a tensor-parallel loader that takes the wrong slice, a load
  that drops a tensor or a loader that transforms it shows up. vLLM's CPU backend repacks linear
  weights and empties their parameters: those (and anything else that cannot be read back) are
  verified only as loaded, and the report names them.

``install_load_recorder`` (run by the ``vllm.general_plugins`` entry point in every vLLM process)
puts the record on every model any of vLLM's model loaders builds, whatever the load format: a
``dummy`` start then reports "no weights from the trainer yet" until the first push.
"""

from __future__ import annotations

import torch

from ... import patching
from ...numerics.digest import cast_piece_sum, dtype_name
from .readback import Readback


class LoadRecord:
    """Digest entries of the last tensor loaded under each HF name, as the engine stores it, and
    how the engine was started (``loader``, ``load_format``; ``pushes``: the ``load_weights`` calls
    after the model loader finished)."""

    def __init__(self, dtype: torch.dtype, *, loader: str | None = None, load_format: str | None = None):
        self.dtype = dtype
        self.loader, self.load_format = loader, load_format
        self.entries: dict[str, tuple[str, tuple[int, ...], int]] = {}
        self.pushes = 0
        self.building = False  # inside the model loader's own load
        self.readback = Readback()

    def wrap(self, load_weights):
        def recording_load_weights(weights, *args, **kwargs):
            staged: dict = {}
            result = load_weights(self._see(weights, staged), *args, **kwargs)
            self.entries.update(staged)  # only a load that returned counts
            if not self.building:
                self.pushes += 1
            return result

        recording_load_weights.__dist_sr_record__ = self
        return recording_load_weights

    def _see(self, weights, staged: dict):
        for name, tensor in weights:
            stored = tensor.detach()
            dtype = self.dtype if stored.is_floating_point() else stored.dtype  # what the parameter's copy_ makes of it
            staged[name] = (dtype_name(dtype), tuple(stored.shape), cast_piece_sum(stored, dtype))
            yield name, tensor


def load_record(model: torch.nn.Module) -> LoadRecord | None:
    return getattr(getattr(model, "load_weights", None), "__dist_sr_record__", None)


def record_loads(
    model: torch.nn.Module, dtype: torch.dtype, *, loader: str | None = None, load_format: str | None = None
) -> LoadRecord:
    """Record every later ``model.load_weights`` call (idempotent)."""
    record = load_record(model)
    if record is None:
        record = LoadRecord(dtype, loader=loader, load_format=load_format)
        model.load_weights = record.wrap(model.load_weights)
    return record


def _recording(load_weights):
    """A model loader's ``load_weights(self, model, model_config)`` that first puts the record on
    ``model`` (the loader's own loads then count as the start, not as pushes)."""

    def load_weights_recorded(self, model, model_config, *args, **kwargs):
        load_config = getattr(self, "load_config", None)
        record = record_loads(
            model,
            model_config.dtype,
            loader=type(self).__name__,
            load_format=str(getattr(load_config, "load_format", "") or "") or None,
        )
        outer, record.building = record.building, True
        try:
            return load_weights(self, model, model_config, *args, **kwargs)
        finally:
            record.building = outer

    return load_weights_recorded


def _wrap_loader_class(cls) -> None:
    own = cls.__dict__.get("load_weights")
    if own is not None and not patching.patched(own) and not getattr(own, "__isabstractmethod__", False):
        patching.patch(cls, "load_weights", _recording(own), by=__name__)


def install_load_recorder() -> None:
    """Make every vLLM model loader (the built-in ones, ``register_model_loader`` ones defined
    later) record the loads of the models it builds (idempotent)."""
    import vllm.model_executor.model_loader  # noqa: F401  (imports every built-in loader)
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if patching.patched(BaseModelLoader.__dict__.get("__init_subclass__")):
        return
    todo = [BaseModelLoader]
    while todo:
        cls = todo.pop()
        _wrap_loader_class(cls)
        todo.extend(cls.__subclasses__())

    def __init_subclass__(cls, **kwargs):
        super(BaseModelLoader, cls).__init_subclass__(**kwargs)
        _wrap_loader_class(cls)

    patching.patch(BaseModelLoader, "__init_subclass__", classmethod(__init_subclass__), by=__name__)


_not_recorded: list[str] = []  # why this process records no loads (the plugin's capability check)


def not_recorded(reason: str) -> None:
    """Say why this process cannot record loads: ``report`` then answers with the reason."""
    _not_recorded.append(reason)


def report(model: torch.nn.Module) -> dict:
    """What ``model`` holds: ``{"method", "digests"}`` (as loaded: ``{name: [dtype, shape, hex]}``),
    ``"start"`` (``{"loader", "load_format", "pushes"}``), ``"readback"`` (``{name: [dtype, shape,
    hex partial sum, covered, signature]}``, this worker's part) and ``"unreadable"`` (``{name:
    why}``): the tensors verified only as loaded."""
    record = load_record(model)
    if record is None:
        if _not_recorded:
            raise RuntimeError(f"this engine's loads were not recorded: {_not_recorded[-1]}")
        raise RuntimeError(
            "this engine's loads were not recorded: dist-sr's vLLM plugin was not loaded in this "
            "process (pip install dist-sr where vLLM runs, and keep VLLM_PLUGINS unset or naming "
            "dist_sr), or the model was not built by one of vLLM's model loaders"
        )
    return {
        "method": "recorded at load",
        "digests": _hex(record.entries),
        "start": {"loader": record.loader, "load_format": record.load_format, "pushes": record.pushes},
        **record.readback.report(model, record.entries),
    }


def _hex(entries: dict) -> dict:
    return {n: [d, list(shape), f"{v:016x}"] for n, (d, shape, v) in entries.items()}
