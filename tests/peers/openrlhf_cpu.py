"""OpenRLHF on a machine without a GPU: what its code reaches for that only a GPU has, stood in
for, and its own command line. OpenRLHF's strategy, ``Actor``, DeepSpeed config and
``broadcast_to_vllm`` run as they are.

- ``flash_attn`` (imported at module level by ``openrlhf.models.ring_attn_utils``) has no CPU
  build: empty modules stand in (after transformers has looked for the real one, so it does not
  think FlashAttention is installed; nothing here calls them).
- ``setup_distributed`` calls ``torch.cuda.set_device`` and builds its mesh on ``"cuda"``:
  ``setup_distributed`` runs with the first a no-op and the mesh on the CPU.
- its CUDA calls around a broadcast: ``harness.cuda_calls_on_cpu``.
"""

from __future__ import annotations

import ast
import importlib.machinery
import inspect
import sys
import types

import torch
import transformers.modeling_flash_attention_utils  # noqa: F401  (before the stand-in below)


def _unavailable(*args, **kwargs):
    raise RuntimeError("flash_attn is not available on this CPU machine")


for _name, _attrs in (
    ("flash_attn", ()),
    ("flash_attn.bert_padding", ("index_first_axis", "pad_input", "rearrange", "unpad_input")),
    ("flash_attn.utils", ()),
    ("flash_attn.utils.distributed", ("all_gather",)),
):
    if _name not in sys.modules:
        _module = types.ModuleType(_name)
        # a spec but no file and no version: transformers' availability check calls it "not installed"
        _module.__spec__ = importlib.machinery.ModuleSpec(_name, None)
        for _attr in _attrs:
            setattr(_module, _attr, _unavailable)
        sys.modules[_name] = _module


def cli_args(flags: list[str]):
    """``flags`` parsed by OpenRLHF's own ``train_ppo_ray`` command line (its parser is built in
    the script's ``__main__`` block: those statements run here, up to ``parse_args``), nested as
    OpenRLHF nests them (``openrlhf.utils.config.hierarchize``)."""
    import openrlhf.cli.train_ppo_ray as cli
    from openrlhf.utils.config import hierarchize

    tree = ast.parse(inspect.getsource(cli))
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    build = []
    for stmt in main.body:
        if "parse_args" in ast.unparse(stmt):
            break
        build.append(stmt)
    namespace = dict(vars(cli))
    exec(compile(ast.Module(build, type_ignores=[]), cli.__file__, "exec"), namespace)
    return hierarchize(namespace["parser"].parse_args(flags))


def setup_distributed(strategy) -> None:
    """``DeepspeedStrategy.setup_distributed`` with its two CUDA calls on the CPU."""
    import openrlhf.utils.deepspeed.deepspeed as ds_strategy
    from torch.distributed.device_mesh import init_device_mesh

    real_mesh, real_set = ds_strategy.init_device_mesh, torch.cuda.set_device
    ds_strategy.init_device_mesh = lambda device, *a, **k: init_device_mesh("cpu", *a, **k)
    torch.cuda.set_device = lambda *a, **k: None
    try:
        strategy.setup_distributed()
    finally:
        ds_strategy.init_device_mesh, torch.cuda.set_device = real_mesh, real_set
