"""verl on a machine without a GPU: a CPU platform for verl's platform registry (verl 0.9 has
none: without a GPU it falls back to CUDA and NCCL). A test stand-in for the device only; verl's
engine, exporters and senders run as they are. Import before any verl module that reads the
platform (``transformer_impl`` does at import)."""

from __future__ import annotations

import contextlib
import os
import types

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

os.environ["VERL_PLATFORM"] = "cpu"
os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # verl registers its FSDP engines for cuda/npu only

_noop = lambda *a, **k: None  # noqa: E731
device_module = types.SimpleNamespace(
    synchronize=_noop,
    empty_cache=_noop,
    ipc_collect=_noop,
    is_available=lambda: True,
    current_device=lambda: "cpu",
    get_device_name=lambda *a: "CPU",  # verl's MFU: an unknown device, infinite peak flops
    device_count=lambda: 1,
    set_device=_noop,
    mem_get_info=lambda *a: (8 << 30, 16 << 30),
    memory_allocated=lambda *a: 0,
    memory_reserved=lambda *a: 0,
    max_memory_allocated=lambda *a: 0,
    max_memory_reserved=lambda *a: 0,
    reset_peak_memory_stats=_noop,
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    memory=types.SimpleNamespace(_set_allocator_settings=_noop),
    current_stream=lambda *a: None,
    Stream=None,
)


@PlatformRegistry.register(platform="cpu")
class CPUPlatform(PlatformBase):
    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: device_module)

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False  # verl's senders then take their shared-memory path

    def cudart(self):
        return None
