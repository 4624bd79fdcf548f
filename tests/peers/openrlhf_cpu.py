"""OpenRLHF on a machine without a GPU: what its code reaches for that only a GPU has, stood in
for, its own command line, and its rollout engines started as it starts them. OpenRLHF's strategy,
``Actor``, DeepSpeed config, ``ActorPPOTrainer`` and ``RolloutRayActor`` run as they are.

- ``flash_attn`` (imported at module level by ``openrlhf.models.ring_attn_utils``) has no CPU
  build: empty modules stand in (after transformers has looked for the real one, so it does not
  think FlashAttention is installed; nothing here calls them).
- ``setup_distributed`` calls ``torch.cuda.set_device`` and builds its mesh on ``"cuda"``:
  ``setup_distributed`` runs with the first a no-op and the mesh on the CPU.
- ``ActorPPOTrainer``'s CUDA calls (``trainer_on_cpu``): the device it trains on, its barrier
  with a CUDA sync, the PyNccl group and the CUDA-IPC handles (``openrlhf_worker``) and the CUDA
  receive buffer and stream around a broadcast (``harness.cuda_calls_on_cpu``).
- Rollout engines (``start_engines``): OpenRLHF's own ``create_vllm_engines`` with the arguments
  its ``train_ppo_ray`` passes, in a local Ray cluster whose "GPUs" are logical; only the worker
  extension it names is swapped for ``openrlhf_worker.CPUWorkerWrap`` (OpenRLHF's ``WorkerWrap``
  with CPU stand-ins), and each engine is named so a trainer process can look it up.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.machinery
import inspect
import os
import sys
import types
from types import SimpleNamespace

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
    """``flags`` as OpenRLHF's own ``train_ppo_ray`` reads them: the statements of its
    ``__main__`` block (the parser, ``hierarchize``, its checks and derived settings such as
    ``eps_clip_low_high``) run here with ``parse_args(flags)``, up to its call of ``train``."""
    import openrlhf.cli.train_ppo_ray as cli

    tree = ast.parse(inspect.getsource(cli))
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    build = []
    for stmt in main.body:
        if ast.unparse(stmt) == "train(args)":
            break
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "parser.parse_args":
                node.args = [ast.Name("__flags__", ast.Load())]
        build.append(stmt)
    namespace = {**vars(cli), "__flags__": flags}
    exec(compile(ast.fix_missing_locations(ast.Module(build, type_ignores=[])), cli.__file__, "exec"), namespace)
    return namespace["args"]


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


@contextlib.contextmanager
def trainer_on_cpu(ppo_actor, device):
    """``ActorPPOTrainer``'s CUDA reach on the CPU, in module ``ppo_actor``: ``torch.cuda.current_device``
    is ``device`` (while the trainer is built, ``0``: its replay buffer names ``cuda:0`` for a
    ``sample()`` PPO's data loader never calls; while it trains and syncs, ``"cpu"``, where the
    batches go), the barrier with a CUDA sync is a barrier, the PyNccl group a gloo one,
    ``get_physical_gpu_id`` one id for every process, and the IPC handles torch's CPU shared-memory
    ones (``openrlhf_worker``)."""
    import torch.distributed as dist
    import torch.multiprocessing
    from torch.multiprocessing import reductions

    from tests.peers import openrlhf_worker
    from tests.peers.harness import cuda_calls_on_cpu

    torch.multiprocessing.set_sharing_strategy("file_system")  # handles another process can open by name
    saved = [
        (torch.cuda, "current_device", lambda: device),
        (ppo_actor, "torch_dist_barrier_and_cuda_sync", dist.barrier),
        (ppo_actor, "stateless_init_process_group", openrlhf_worker.gloo_group),
        (ppo_actor, "get_physical_gpu_id", lambda: openrlhf_worker.DEVICE_ID),
        (reductions, "reduce_tensor", openrlhf_worker.cuda_ipc_handle),
    ]
    saved = [(owner, name, getattr(owner, name), value) for owner, name, value in saved]
    for owner, name, _, value in saved:
        setattr(owner, name, value)
    try:
        with cuda_calls_on_cpu():
            yield
    finally:
        for owner, name, real, _ in saved:
            setattr(owner, name, real)


NAMESPACE = "dist-sr-openrlhf-test"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_ray() -> str:
    """A local Ray cluster for the engines (logical GPUs: OpenRLHF's placement asks for them);
    returns its address for the trainer's rank 0 to join."""
    import ray

    env = {
        "PYTHONPATH": os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])]),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    os.environ.update(env)
    # Ray's own memory monitor kills workers when the whole machine runs short, which on a shared
    # CPU machine is other people's processes: leave that to the kernel
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    ray.init(
        num_cpus=2,
        num_gpus=2,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        namespace=NAMESPACE,
        runtime_env={"env_vars": env},
    )
    return ray.get_runtime_context().gcs_address


def start_engines(args, model_dir: str, prefix: str) -> list:
    """OpenRLHF's ``create_vllm_engines`` as ``train_ppo_ray`` calls it (no shared placement group:
    colocated engines share the actors' GPUs through one, and a CPU has none to share), each
    engine ready before this returns and named ``{prefix}-{i}``."""
    import openrlhf.trainer.ray.vllm_engine as vllm_engine
    import ray

    real = vllm_engine.RolloutRayActor
    made = []

    class Launch:  # RolloutRayActor.options(...).remote(**kwargs), CPU worker extension, named
        @staticmethod
        def options(**options):
            def remote(**kwargs):
                assert kwargs["worker_extension_cls"] == "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"
                kwargs["worker_extension_cls"] = "tests.peers.openrlhf_worker.CPUWorkerWrap"
                made.append(real.options(**options, name=f"{prefix}-{len(made)}").remote(**kwargs))
                return made[-1]

            return SimpleNamespace(remote=remote)

    vllm_engine.RolloutRayActor = Launch
    try:
        engines = vllm_engine.create_vllm_engines(
            args.vllm.num_engines,
            args.vllm.tensor_parallel_size,
            model_dir,
            args.train.seed,
            args.train.full_determinism_enable,
            args.vllm.enable_prefix_caching,
            args.vllm.enforce_eager,
            args.data.max_len,
            None,
            args.vllm.gpu_memory_utilization,
            args.vllm.enable_sleep,
            "processed_logprobs" if args.algo.advantage.is_correction_level != "off" else None,
            agent_func_path=args.train.agent_func_path,
            remote_rm_url=args.reward.remote_url,
            max_images_per_prompt=getattr(args.data, "max_images_per_prompt", 0),
        )
    finally:
        vllm_engine.RolloutRayActor = real
    ray.get([e.__ray_ready__.remote() for e in engines])  # built (its async __init__ returned)
    return engines


def engine_handles(address: str, prefix: str, count: int) -> list:
    """The engines ``start_engines`` named, from a trainer process joining the cluster."""
    import ray

    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    return [ray.get_actor(f"{prefix}-{i}") for i in range(count)]


def generate(engine, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    """Greedy token ids from OpenRLHF's own ``RolloutRayActor.generate``, one prompt at a time."""
    import ray
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)
    return [list(ray.get(engine.generate.remote(p, params)).outputs[0].token_ids) for p in prompts]


def stop_engines(engines: list) -> None:
    """Shut each engine's vLLM down (its engine-core process with it), then the actor."""
    import ray

    from tests.peers import openrlhf_worker

    for engine in engines:
        try:
            ray.get(engine.__ray_call__.remote(openrlhf_worker.shut_down), timeout=120)
        except Exception:  # already gone
            pass
        ray.kill(engine)
