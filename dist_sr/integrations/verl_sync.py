"""verl's weight syncs checked against the trainer's rounding key, and dist-sr's numbers in verl's
own metrics (``dist_sr.integrations.verl`` installs this; nothing to configure).

After every weight sync, whatever engine verl built (``load_format: dummy`` included), through
dist-sr's ``vllm.general_plugins`` entry point, which gives every vLLM worker the
``dist_sr_held_weights`` RPC whatever worker extension verl configured:

- **colocated** (``checkpoint_engine.backend: naive``, ``ActorRolloutRefWorker.update_weights`` ->
  ``ServerAdapter.update_weights``): every trainer rank digests the keyed BF16 working weights of
  its FSDP2 shards (from the FP32 masters, not from what was sent), under the names verl's
  exporter gives them (``convert_weight_keys``); the rank that owns a replica's vLLM server asks
  its workers what they hold and compares tensor by tensor (``rollout.vllm.check``: read back from
  the parameters where the backend allows, otherwise as handed to ``load_weights``). Tensors verl's
  exporter makes after gathering (MoE unfusing) are compared as it streamed them; the tensors it
  gathered are compared with the key.
- **checkpoint engines** (``nccl``, ``nixl``, ...): on the trainer, rank 0 compares what verl's
  exporter gathered with the key; on the rollout side, each replica's ``CheckpointEngineWorker``
  that owns a vLLM server compares the engine with the digest of what arrived. That the transport
  delivered what was exported is not compared across the two sides. A rollout side that checks
  nothing is a gap the trainer's check names ("rollout side not verified"), as it does for
  ``delta_sharded`` (deltas, not tensors, arrive): replicas other than vLLM's (``rollout.name``
  ``sglang``, ``trtllm``: only vLLM's ``ServerAdapter`` is patched), and rollout workers that do
  not import this module (no ``custom_backend_module``).

A failure stops the step with ``HeldWeightsMismatch`` naming the engine and the tensors;
``DIST_SR_VERIFY=warn`` logs it and trains on. verl's ``vLLMHttpServer.collective_rpc`` drops the
workers' answers (verl 0.9.1), so the owning rank reaches the engine with Ray's ``__ray_call__``
(``engine_answers``).

Metrics go into what ``FSDPEngine.train_batch`` returns, so verl's ``TrainingWorker`` gathers them
over the data-parallel ranks and ``update_actor`` hands them to the trainer's ``Tracking``
(W&B, TensorBoard, console) as ``actor/dist_sr/...``:

- every optimizer step: ``dist_sr/changed_frac``, the share of BF16 working weights whose bits
  that step changed (``optim.metrics.ChangedShare``: sampled on global indices, all ranks summed);
- once per ``update_actor`` (its last mini-batch; every call of a bare ``train_batch``):
  ``dist_sr/seed``, ``dist_sr/mode_dither`` (1 for ``dither``, 0 for ``stochastic``),
  ``dist_sr/key_step`` (the optimizer step the working weights are keyed by now), and the last
  weight sync's check: ``dist_sr/tensors_differ`` (tensors with a problem, export and engines),
  and in the colocated path ``dist_sr/engines_verified``, ``dist_sr/tensors_read_back`` and
  ``dist_sr/tensors_as_loaded`` (summed over the engines); through a checkpoint engine
  ``dist_sr/rollout_side_verified`` (1: each vLLM replica compares its engine with what arrived
  and stops the sync on a difference; 0: the rollout side checks nothing). verl syncs after
  ``update_actor``, so these describe the *previous* sync: the weights this step's rollouts were
  generated with.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
from dataclasses import dataclass

import torch

from .. import patching
from ..engines.fsdp2.source import FSDP2Source
from ..numerics.digest import piece_sum
from ..optim.metrics import ChangedShare
from ..rollout.vllm.check import VERIFY_ENV, EngineCheck, HeldWeightsMismatch, Problem, check_engine, verify_mode
from ..sources import digest_entries

log = logging.getLogger("dist_sr.integrations.verl")
# a level of its own, as verl's loggers have: a library that turns the root logger down (one that
# vLLM's API server imports sets it to ERROR) must not mute dist-sr's warnings
if log.level == logging.NOTSET:
    log.setLevel(os.environ.get("VERL_LOGGING_LEVEL", "WARN"))
ASK_TIMEOUT_S = 300.0
HELD_RPC = "dist_sr_held_weights"
Entries = dict[str, tuple[str, tuple[int, ...], int]]
ROLLOUT_SIDE = "checkpoint engine, rollout side: the engine against what arrived"
_EXPORT_TAP: contextvars.ContextVar = contextvars.ContextVar("dist_sr_export_tap", default=None)


def key_context(engine):
    """The ``SRContext`` the patched build attached to verl's ``engine`` (its trained actor), or
    None for an engine built without keyed SR (the reference model, a critic)."""
    return getattr(engine, _CTX, None)


def set_key_context(engine, ctx) -> None:
    setattr(engine, _CTX, ctx)


_CTX = "_dist_sr_ctx"  # on verl's engine object: a name verl's own attributes never take


class StreamDigests:
    """Digest entries ``{name: (dtype, shape, sum)}`` of a weight stream's tensors, taken as they
    pass, as the engine stores them: floating tensors in ``dtype`` (vLLM's load copies each into
    its parameter, which casts round-to-nearest). ``follows``: an earlier tap of the same stream;
    a tensor that passed it unchanged is not digested twice."""

    def __init__(self, dtype: torch.dtype, follows: StreamDigests | None = None):
        self.dtype, self.follows = dtype, follows
        self.entries: Entries = {}
        self.followed = False
        self.last: tuple[str, torch.Tensor] | None = None  # kept for a follower, until it has seen it
        if follows is not None:
            follows.followed = True

    def note(self, name: str, tensor: torch.Tensor) -> None:
        seen = self.follows.last if self.follows is not None else None
        if seen is not None:
            self.follows.last = None
        if seen is not None and seen[0] == name and seen[1] is tensor:
            self.entries[name] = self.follows.entries[name]
        else:
            t = tensor.detach()
            if t.is_floating_point() and t.dtype != self.dtype:
                t = t.to(self.dtype)
            dtype = str(t.dtype).removeprefix("torch.")
            self.entries[name] = (dtype, tuple(t.shape), piece_sum(t.contiguous().reshape(-1), 0))
        if self.followed:
            self.last = (name, tensor)

    def watch(self, pairs):
        """``pairs`` (a sync or async iterable of ``(name, tensor)``), noting each as it passes."""
        return self._watch_async(pairs) if hasattr(pairs, "__aiter__") else self._watch(pairs)

    def _watch(self, pairs):
        for name, tensor in pairs:
            self.note(name, tensor)
            yield name, tensor
        self.last = None

    async def _watch_async(self, pairs):
        async for name, tensor in pairs:
            self.note(name, tensor)
            yield name, tensor
        self.last = None


class ExportTap:
    """One sync's stream on a trainer rank: ``exported``, the full tensors verl's exporter gathered
    (under its names, before its MoE unfusing), and ``streamed``, what went on to the engine."""

    def __init__(self, dtype: torch.dtype):
        self.exported = StreamDigests(dtype)
        self.streamed = StreamDigests(dtype, follows=self.exported)

    def compare(self, keyed: Entries) -> tuple[Entries, tuple[Problem, ...], tuple[str, ...]]:
        """``(what the engine must hold, the export's problems against the key, the tensors the
        engine is compared with as streamed)``: the key for every tensor streamed as gathered; for
        the ones verl's exporter made after gathering, what it streamed."""
        exported, streamed = self.exported.entries, self.streamed.entries
        problems = []
        for name, want in keyed.items():
            got = exported.get(name)
            if got is None:
                problems.append(Problem(name, "verl's exporter did not send it"))
            elif got != want:
                form = "" if got[:2] == want[:2] else f" ({got[0]} {list(got[1])}, not {want[0]} {list(want[1])})"
                problems.append(
                    Problem(
                        name,
                        f"verl's exporter sent other bits than the trainer's keyed working weight{form}: "
                        "an FP32 master the engine casts to nearest, or another version",
                    )
                )
        made = tuple(sorted(set(streamed) - set(exported)))
        expected = {n: v for n, v in keyed.items() if n in streamed} | {n: streamed[n] for n in made}
        return expected, tuple(problems), made


@dataclass(frozen=True)
class SyncCheck:
    """One weight sync checked; in the trainer, the same on every rank."""

    path: str  # "colocated", "checkpoint engine (<backend>)", or "checkpoint engine, rollout side"
    engines: tuple[EngineCheck, ...] = ()
    export: tuple[Problem, ...] = ()  # the trainer's export against the key
    streamed_only: tuple[str, ...] = ()  # compared with what verl streamed (its exporter made them)
    gap: str = ""  # what this sync could not verify, and the fix

    @property
    def ok(self) -> bool:
        return not self.export and not self.gap and all(e.ok for e in self.engines)

    def differing(self) -> set[str]:
        return {p.tensor for p in self.export} | {p.tensor for e in self.engines for p in e.problems}

    def summary(self) -> str:
        parts = [e.summary() for e in self.engines] + ([self.gap] if self.gap else [])
        if self.export:
            first = "; ".join(f"{p.tensor}: {p.reason}" for p in self.export[:3])
            more = "; ..." if len(self.export) > 3 else ""
            parts.append(f"the trainer's export: {len(self.export)} tensor(s) not the keyed bits ({first}{more})")
        elif not self.engines and not self.gap:
            parts.append("the trainer's export carried the keyed bits of every tensor")
        if self.streamed_only:
            made = len(self.streamed_only)
            parts.append(f"{made} tensor(s) verl's exporter made after gathering, compared as streamed")
        return " | ".join(parts)

    def metrics(self) -> dict[str, float]:
        out = {"dist_sr/tensors_differ": float(len(self.differing()))}
        if self.path.startswith("checkpoint engine ("):  # the trainer's view of a checkpoint-engine sync
            out["dist_sr/rollout_side_verified"] = float(not self.gap)
        if self.path == "colocated":
            out["dist_sr/engines_verified"] = float(sum(e.ok for e in self.engines))
            out["dist_sr/tensors_read_back"] = float(sum(len(e.held) for e in self.engines))
            out["dist_sr/tensors_as_loaded"] = float(sum(len(e.as_loaded) for e in self.engines))
        return out


def enforce(check: SyncCheck, *, speak: bool = True) -> None:
    """Raise ``HeldWeightsMismatch`` for a failed check (``DIST_SR_VERIFY=warn``: log it and go
    on); ``speak``: this rank logs (one per trainer)."""
    if check.ok:
        if speak:
            log.info("dist-sr: weights checked after verl's sync (%s): %s", check.path, check.summary())
        return
    message = f"dist-sr held-weights check after verl's weight sync ({check.path}): {check.summary()}"
    if verify_mode() == "warn":
        if speak:
            log.warning("%s (%s=warn: training goes on)", message, VERIFY_ENV)
        return
    raise HeldWeightsMismatch(f"{message}. {VERIFY_ENV}=warn logs this and trains on")


def keyed_entries(engine) -> Entries:
    """Collective over the trainer's ranks: digest entries of the actor's keyed BF16 working
    weights (``FSDP2Source``: each rank rounds its own FP32 shards with the key, nothing is
    gathered), under the names verl's exporter sends (``convert_weight_keys``)."""
    import torch.distributed as dist
    from verl.utils.model import convert_weight_keys

    world = dist.get_world_size()
    entries = digest_entries(FSDP2Source(engine.module, key_context(engine), dist.get_rank(), world), world)
    return convert_weight_keys(entries, getattr(engine.module, "_fsdp_wrapped_module", engine.module))


def engine_answers(server, method: str, timeout: float) -> list:
    """Runs inside verl's ``vLLMHttpServer`` actor, sent with Ray's ``__ray_call__`` (Ray runs it
    in a thread beside the actor's event loop): ``collective_rpc(method)`` on the server's vLLM
    engine, with every worker's answer, which verl's own ``collective_rpc`` drops."""
    task = getattr(server, "_server_task", None) or getattr(server, "task", None)
    if task is None:
        raise RuntimeError(
            "dist-sr: verl's vLLMHttpServer has no server task (_server_task) whose event loop runs its "
            "engine; written for verl 0.9"
        )
    coro = server.engine.collective_rpc(method, timeout=timeout)
    return asyncio.run_coroutine_threadsafe(coro, task.get_loop()).result(timeout)


async def ask_engine(adapter, method: str = HELD_RPC, timeout: float = ASK_TIMEOUT_S) -> list:
    """Every worker's answer to ``method`` from the vLLM server ``adapter`` (verl's
    ``ServerAdapter``, on the rank that owns it) talks to."""
    if not adapter._ensure_server_handle():
        raise RuntimeError("dist-sr: this rank does not own a rollout server")
    return await adapter.server_handle.__ray_call__.remote(engine_answers, method, timeout)


def engine_label(adapter) -> str:
    return f"vllm replica {adapter.replica_rank}"


async def check_one_engine(adapter, expected: Entries) -> EngineCheck:
    """Ask ``adapter``'s engine what it holds and compare it with ``expected``; an engine that
    cannot answer is a problem that says why."""
    name = engine_label(adapter)
    try:
        answers = await ask_engine(adapter)
    except Exception as exc:
        reason = (
            f"its workers did not answer {HELD_RPC} ({exc!r}); install dist-sr where vLLM runs (its "
            "vllm.general_plugins entry point gives the workers this RPC) and keep VLLM_PLUGINS unset or naming dist_sr"
        )
        return EngineCheck(name, (), {}, (Problem("(every tensor)", reason),), 0, "?")
    return check_engine(name, answers, expected)


def _gather(mine):
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return [p for p in parts if p is not None]


async def check_colocated(worker, tap: ExportTap | None = None) -> SyncCheck:
    """Collective over the trainer's ranks of ``worker`` (verl's ``ActorRolloutRefWorker``): every
    replica's engine compared with the trainer's key, after a sync whose stream ``tap`` saw on
    the owning ranks (None: before any sync, every tensor compared with the key)."""
    keyed = keyed_entries(worker.actor.engine)
    mine = None
    if getattr(worker.rollout, "_has_server", False):
        expected, export, made = tap.compare(keyed) if tap is not None else (keyed, (), ())
        mine = (await check_one_engine(worker.rollout, expected), export, made)
    parts = _gather(mine)
    export = {p.tensor: p for _, problems, _ in parts for p in problems}
    made = sorted({n for _, _, names in parts for n in names})
    return SyncCheck("colocated", tuple(e for e, _, _ in parts), tuple(export.values()), tuple(made))


def check_export(engine, tap: ExportTap | None, backend: str) -> SyncCheck:
    """Collective over the trainer's ranks: what verl's exporter gathered (on the rank that
    ``tap`` watched) against the key."""
    keyed = keyed_entries(engine)
    parts = _gather(tap.compare(keyed)[1:] if tap is not None else None)
    export, made = parts[0] if parts else ((), ())
    return SyncCheck(f"checkpoint engine ({backend})", (), export, made)


class _TrainerSync:
    """Set on verl's ``ServerAdapter`` while the trainer's colocated sync runs through it."""

    def __init__(self, tap: ExportTap | None):
        self.tap = tap


def _rollout_dtype(config) -> torch.dtype:
    name = str(getattr(config, "dtype", "bfloat16")).removeprefix("torch.")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}.get(name, torch.float32)


# ---- the patches ------------------------------------------------------------------------------


def _update_weights_checked(update):
    """``ActorRolloutRefWorker.update_weights``, then the check of that sync on every rank."""

    @functools.wraps(update)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        import torch.distributed as dist

        engine = getattr(getattr(self, "actor", None), "engine", None)
        if key_context(engine) is None:
            return await update(self, global_steps=global_steps, mode=mode)
        rollout = getattr(self, "rollout", None)
        backend = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
        colocated = backend == "naive"
        watching = getattr(rollout, "_has_server", False) if colocated else dist.get_rank() == 0
        tap = ExportTap(_rollout_dtype(self.config.rollout)) if watching and backend != "delta_sharded" else None
        engine._dist_sr_tap = tap
        if colocated and rollout is not None:
            rollout._dist_sr_trainer_sync = _TrainerSync(tap)
        try:
            result = await update(self, global_steps=global_steps, mode=mode)
        finally:
            engine._dist_sr_tap = None
            if colocated and rollout is not None:
                rollout._dist_sr_trainer_sync = None
        check = await _check_sync(self, engine, tap, backend)
        engine._dist_sr_last_sync = check
        enforce(check, speak=dist.get_rank() == 0)
        return result

    return update_weights


async def _check_sync(worker, engine, tap: ExportTap | None, backend: str) -> SyncCheck:
    """The check of one sync through ``backend`` (collective over the trainer's ranks)."""
    if backend == "delta_sharded":
        return SyncCheck(
            f"checkpoint engine ({backend})",
            gap="rollout side not verified: the engines receive deltas, so what they hold is not verified; use "
            "checkpoint_engine.backend naive or a full-tensor checkpoint engine (nccl, nixl, ...)",
        )
    if backend != "naive":
        check = check_export(engine, tap, backend)
        gap = rollout_side_gap(worker.config.rollout)
        return SyncCheck(check.path, check.engines, check.export, check.streamed_only, gap) if gap else check
    if not _is_vllm(worker.rollout):
        return SyncCheck(
            "colocated",
            gap=f"rollout side not verified: rollout {type(worker.rollout).__name__}: dist-sr verifies vLLM engines "
            f"only; use rollout.name=vllm, or {VERIFY_ENV}=warn to train on with the engines unchecked",
        )
    return await check_colocated(worker, tap)


def rollout_side_gap(rollout) -> str:
    """What the rollout side of a checkpoint-engine sync leaves unverified, or "" where each
    replica compares its engine with what arrived (``_adapter_update_checked``): that needs vLLM
    replicas (only vLLM's ``ServerAdapter`` is patched) and rollout workers that import this module
    (``checkpoint_engine.custom_backend_module``). ``rollout``: verl's rollout config."""
    name = str(getattr(rollout, "name", None) or "vllm")
    if name != "vllm":
        return (
            f"rollout side not verified: rollout.name={name}, and dist-sr compares what the engines hold with what "
            f"arrived only for vLLM replicas ({name}'s ServerAdapter is not patched): nothing checks what this sync "
            f"delivered to them; use rollout.name=vllm, or {VERIFY_ENV}=warn to train on with it unverified"
        )
    modules = rollout.checkpoint_engine.get("custom_backend_module") or ()
    if "dist_sr.integrations.verl" not in ([modules] if isinstance(modules, str) else list(modules)):
        return (
            "rollout side not verified: it checks its engines only where dist_sr.integrations.verl is imported: set "
            "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=dist_sr.integrations.verl"
        )
    return ""


def _is_vllm(rollout) -> bool:
    try:
        from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter
    except ImportError:  # no vLLM in this environment
        return False
    return isinstance(rollout, ServerAdapter)


def _adapter_update_checked(update):
    """``ServerAdapter.update_weights``: in the trainer's colocated sync, the stream is watched for
    the trainer's check; anywhere else (a ``CheckpointEngineWorker`` on the rollout side), the
    engine is compared with what arrived."""

    @functools.wraps(update)
    async def update_weights(self, weights, global_steps: int = None, wire_format: str = "named_tensors", **kwargs):
        trainer = getattr(self, "_dist_sr_trainer_sync", None)
        if trainer is not None:
            if trainer.tap is not None:
                weights = trainer.tap.streamed.watch(weights)
            return await update(self, weights, global_steps=global_steps, wire_format=wire_format, **kwargs)
        if not self._has_server:
            return await update(self, weights, global_steps=global_steps, wire_format=wire_format, **kwargs)
        if wire_format != "named_tensors":
            result = await update(self, weights, global_steps=global_steps, wire_format=wire_format, **kwargs)
            gap = f"weights arrive as {wire_format!r}: what the engine holds is not verified"
            enforce(SyncCheck(ROLLOUT_SIDE, gap=gap))
            return result
        received = StreamDigests(_rollout_dtype(self.config))
        kwargs.update(global_steps=global_steps, wire_format=wire_format)
        result = await update(self, received.watch(weights), **kwargs)
        enforce(SyncCheck(ROLLOUT_SIDE, (await check_one_engine(self, received.entries),)))
        return result

    return update_weights


def _export_tapped(export):
    """``FSDPEngine.get_per_tensor_param`` with this sync's tap (if any) set for verl's unfusing."""

    @functools.wraps(export)
    def get_per_tensor_param(self, *args, **kwargs):
        token = _EXPORT_TAP.set(getattr(self, "_dist_sr_tap", None))
        try:
            return export(self, *args, **kwargs)
        finally:
            _EXPORT_TAP.reset(token)

    return get_per_tensor_param


def _unfuse_tapped(unfuse):
    """verl's ``unfuse_moe_params``: its input (the gathered full tensors) passes the tap first."""

    @functools.wraps(unfuse)
    def unfuse_moe_params(weights, *args, **kwargs):
        tap = _EXPORT_TAP.get()
        return unfuse(tap.exported.watch(weights) if tap is not None else weights, *args, **kwargs)

    return unfuse_moe_params


def _train_batch_measured(train):
    """``FSDPEngine.train_batch``, then dist-sr's metrics added to what it returns."""

    @functools.wraps(train)
    def train_batch(self, data, loss_function):
        output = train(self, data, loss_function)
        if key_context(self) is not None:
            metrics = step_metrics(self, data)  # collective: every rank
            if self.is_mp_src_rank_with_outputs():
                output["metrics"].update(metrics)
        return output

    return train_batch


def observe_changes(engine, module=None, *, restart: bool = False) -> float | None:
    """Collective: the share of the actor's BF16 working-weight bits changed since the last call
    (None on the first, or with ``restart``: after masters were written outside a step).
    ``module``: the actor's FSDP2 module, while verl has not yet set ``engine.module``."""
    import torch.distributed as dist

    if restart or getattr(engine, "_dist_sr_changes", None) is None:
        engine._dist_sr_changes = ChangedShare()
        first = True
    else:
        first = False
    module = engine.module if module is None else module
    source = FSDP2Source(module, key_context(engine), dist.get_rank(), dist.get_world_size())
    changed, sampled = engine._dist_sr_changes.observe(source.local_pieces([m[0] for m in source.metadata()]))
    counts = torch.tensor([changed, sampled], dtype=torch.float64)
    dist.all_reduce(counts)
    return None if first or not counts[1] else float(counts[0] / counts[1])


def actor_built(engine, module) -> None:
    """After the actor's weights are loaded into ``module``, built or resumed (collective):
    ``DIST_SR_VERIFY`` is read (a bad value is refused now, not at the first sync) and the
    changed-bits baseline taken."""
    verify_mode()
    observe_changes(engine, module, restart=True)


def step_metrics(engine, data) -> dict[str, list[float]]:
    """dist-sr's metrics after one ``train_batch`` (collective), as verl's engines return theirs:
    one value per metric in a list."""
    from verl.utils import tensordict_utils as tu

    ctx = key_context(engine)
    out = {}
    changed = observe_changes(engine)
    if changed is not None:
        out["dist_sr/changed_frac"] = [changed]
    if tu.get(data, key="update_lr_scheduler", default=True):  # the last mini-batch of update_actor
        out["dist_sr/seed"] = [float(ctx.seed)]
        out["dist_sr/mode_dither"] = [float(ctx.mode == "dither")]
        out["dist_sr/key_step"] = [float(ctx.step)]
        sync = getattr(engine, "_dist_sr_last_sync", None)
        if sync is not None:
            out.update({k: [v] for k, v in sync.metrics().items()})
    return out


def enable(engine_cls) -> None:
    """Install the checks and metrics on verl (idempotent): ``engine_cls`` is verl's
    ``FSDPEngine``, whose exporters ``dist_sr.integrations.verl`` has already patched."""
    import importlib.util

    from verl.workers import engine_workers
    from verl.workers.engine.fsdp import transformer_impl

    missing = [
        what
        for what, ok in (
            ("FSDPEngine.train_batch", hasattr(engine_cls, "train_batch")),
            ("transformer_impl.unfuse_moe_params", hasattr(transformer_impl, "unfuse_moe_params")),
            ("ActorRolloutRefWorker.update_weights", hasattr(engine_workers.ActorRolloutRefWorker, "update_weights")),
        )
        if not ok
    ]
    if missing:
        raise ImportError(f"dist_sr.integrations.verl: this verl lacks {', '.join(missing)} (written for verl 0.9)")
    if patching.patched(engine_cls.train_batch):
        return
    patch = functools.partial(patching.patch, by=__name__)
    patch(engine_cls, "train_batch", _train_batch_measured(engine_cls.train_batch))
    patch(engine_cls, "get_per_tensor_param", _export_tapped(engine_cls.get_per_tensor_param), tag="tap")
    patch(transformer_impl, "unfuse_moe_params", _unfuse_tapped(transformer_impl.unfuse_moe_params))
    worker = engine_workers.ActorRolloutRefWorker
    patch(worker, "update_weights", _update_weights_checked(worker.update_weights))
    if importlib.util.find_spec("vllm") is not None:  # no vLLM here: no vLLM engine to check from here
        from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

        patch(ServerAdapter, "update_weights", _adapter_update_checked(ServerAdapter.update_weights))
