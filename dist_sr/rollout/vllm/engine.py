"""The rollout engine of a ``vllm serve`` fleet (``rollout.engine: vllm``).

``sync_weights(version)`` runs the weight sync (every trainer rank); ``generate`` sends each of
this rank's prompts, as token ids, to an engine that verified the current version (round-robin
over the ready engines, requests in parallel so vLLM batches them) and returns the completions as
padded token tensors, tagged with the version and the digest the engines reported. After the
rollouts every rank asks the engines it used whether they are still exactly what the sync
verified (no restart, no control event since); if any is not, the rollouts are discarded, the
fleet is synced and verified again, and the prompts are generated again.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ...config import ConfigError
from ...weightsync import auth
from ...weightsync.control import TIMEOUT_S, EngineError, NoReadyEngineError
from ...weightsync.disk.snapshot import Snapshots
from ...weightsync.trainer.sync import WeightSync
from ..base import Rollouts, encode_prompts
from .control import controls, http

log = logging.getLogger(__name__)


VLLM_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def served_dtype(module: torch.nn.Module) -> str:
    """vLLM's ``--dtype`` for an engine that serves ``module``'s working weights as they are: its
    parameters' dtype (an FP32 trainer's engine computes in FP32, not on a BF16 cast of them)."""
    dtype = next(module.parameters()).dtype
    if dtype not in VLLM_DTYPES:
        raise ConfigError(
            f"rollout.vllm.local_python: the trainer's working weights are {dtype}, which a local vLLM engine "
            f"does not serve; use a precision whose working dtype is one of {sorted(VLLM_DTYPES.values())}"
        )
    return VLLM_DTYPES[dtype]


class VLLMFleetEngine:
    """The rollout engine over a fleet of ``vllm serve`` engines (``rollout.vllm``): its own
    processes or pods, reached over HTTP and fed the trainer's bits over the weight-transfer group."""

    remote = True

    @classmethod
    def preflight(cls, config) -> None:
        """The job's sync secret, read (and length-checked) now, not at the first sync; engines this
        run starts on its host get one generated for the run."""
        if config.vllm.local_python and auth.load(required=False) is None:
            os.environ[auth.ENV] = auth.generate()  # engines started here inherit this run's secret
        auth.load()

    @classmethod
    def build(cls, config, trainer, tokenizer, *, device, sharded: bool, source=None) -> VLLMFleetEngine:
        """The fleet of ``config.vllm``; with ``local_python``, engines started here first, serving the
        checkpoint the trainer's model was loaded from (``name_or_path``) in the trainer's working
        dtype (``served_dtype``: FP32 for fp32, FP16 for fp16, else BF16), so every precision's
        rollouts come from its own weights: on-policy."""
        fleet = config.vllm
        if not fleet.local_python:
            return cls.from_config(fleet, trainer, tokenizer, device=device, source=source)
        from dataclasses import replace
        from pathlib import Path

        from ...net import free_port
        from .local import start_local_engines

        if sharded:
            raise ConfigError("rollout.vllm.local_python starts engines for one trainer process; use urls with several")
        model_dir = getattr(trainer.module, "name_or_path", "")
        if not model_dir or not (Path(model_dir) / "config.json").exists():
            raise ConfigError(
                f"rollout.vllm.local_python: the trainer's model was not loaded from a local checkpoint directory "
                f"({model_dir!r}); local engines serve that directory"
            )
        dtype = served_dtype(trainer.module)
        log_dir = Path(fleet.local_log_dir) if fleet.local_log_dir else Path(model_dir).parent / "engines"
        engines = start_local_engines(fleet, model_dir, dtype=dtype, log_dir=log_dir)
        try:
            out = cls.from_config(
                # the group's store on a free port: several runs with local engines share this host
                replace(fleet, urls=[e.url for e in engines], local_python=None, group_port=free_port()),
                trainer,
                tokenizer,
                device=device,
                source=source,
            )
        except BaseException:
            for e in engines:
                e.stop()
            raise
        out.local_engines = engines
        return out

    def __init__(
        self,
        sync: WeightSync,
        tokenizer,
        *,
        timeout_s: float = TIMEOUT_S,
        device=None,
        snapshot_dir: str | None = None,
        snapshot_every: int = 0,
        snapshot_deltas: bool = False,
        model_config=None,
        startup_timeout_s: float = 1800.0,
    ):
        self.sync, self.tokenizer = sync, tokenizer
        self.timeout_s, self.device = timeout_s, device
        self.snapshot_every = snapshot_every
        self.snapshots = (
            Snapshots(snapshot_dir, model_config, tokenizer, deltas=snapshot_deltas, base_every=snapshot_every)
            if snapshot_dir
            else None
        )
        self.startup_timeout_s = startup_timeout_s
        self.version: int | None = None
        self._model_names: dict[str, str] = {}
        self.local_engines: list = []  # engines this run started on its host (rollout.vllm.local_python)

    @classmethod
    def from_config(cls, fleet_cfg, trainer, tokenizer, device=None, source=None) -> "VLLMFleetEngine":
        """The fleet of ``rollout.vllm``, fed the trainer's working weights (``trainer.weight_source()``)
        or ``source``, a ``WeightSource`` of other bits (a benchmark's export of the masters)."""
        if not fleet_cfg.urls:
            raise ValueError(
                "rollout.engine=vllm needs rollout.vllm.urls (the engines' base URLs), "
                "or a Kubernetes render (dist-sr k8s) that fills them in"
            )
        if fleet_cfg.snapshot_deltas and not fleet_cfg.snapshot_dir:
            raise ConfigError(
                "rollout.vllm.snapshot_deltas needs rollout.vllm.snapshot_dir: where the base and its deltas go"
            )
        host = fleet_cfg.group_host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        sync = WeightSync(
            source if source is not None else trainer.weight_source(),
            controls(fleet_cfg.urls, fleet_cfg.timeout_s),
            transport=fleet_cfg.transport,
            bucket_mb=fleet_cfg.bucket_mb,
            timeout_s=fleet_cfg.timeout_s,
            group_host=host,
            group_port=fleet_cfg.group_port,
            delta=fleet_cfg.delta_sync,
            backend=fleet_cfg.backend,
        )
        return cls(
            sync,
            tokenizer,
            timeout_s=fleet_cfg.timeout_s,
            device=device,
            snapshot_dir=fleet_cfg.snapshot_dir,
            snapshot_every=fleet_cfg.snapshot_every,
            snapshot_deltas=fleet_cfg.snapshot_deltas,
            model_config=getattr(trainer.module, "config", None),
            startup_timeout_s=fleet_cfg.startup_timeout_s,
        )

    def sync_weights(self, version: int, verify: bool = True) -> None:
        first = self.version is None
        if self.snapshots is not None and (
            first or self.snapshots.deltas or (self.snapshot_every and version % self.snapshot_every == 0)
        ):
            self.snapshots.write(self.sync.source, version)
        if first:
            self.wait_for_engines()
        self.sync.sync(version, verify=verify)
        self.version = version

    def wait_for_engines(self) -> None:
        """Rank 0 polls until an engine answers (they may be starting from the first snapshot)."""
        if self.sync.rank != 0:
            return
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            for e in self.sync.engines:
                try:
                    e.control.health()
                    return
                except EngineError:
                    pass
            if time.monotonic() > deadline:
                raise NoReadyEngineError(
                    f"no rollout engine came up within {self.startup_timeout_s:.0f}s: "
                    f"{[e.url for e in self.sync.engines]}"
                )
            time.sleep(2)

    def sync_metrics(self) -> dict:
        """The last sync, for the step's metrics: bytes this rank sent, seconds, whether it was a
        delta sync."""
        r = self.sync.last
        return (
            {}
            if r is None
            else {"sync_bytes": r.bytes_sent, "sync_s": r.seconds, "sync_delta": r.delta_base is not None}
        )

    def trainer_digest(self) -> str:
        """Layout-free digest of the trainer's current working weights (collective)."""
        return self.sync.current_digest()

    def _model_name(self, url: str) -> str:
        if url not in self._model_names:
            self._model_names[url] = http(url, "/v1/models", timeout=self.timeout_s)["data"][0]["id"]
        return self._model_names[url]

    REGENERATE = 2  # times rollouts are redone after an engine changed under them, before giving up

    def generate(self, prompts, *, samples_per_prompt, max_new_tokens, temperature, generator, with_digest=False):
        """Every trainer rank (collective: ranks agree whether the rollouts stand)."""
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
        problems: list[str] = []
        for _ in range(1 + self.REGENERATE):
            out, used = self._generate(prompts, seeds, samples_per_prompt, max_new_tokens, temperature, with_digest)
            problems = self.sync.changed(used)
            if self.sync.all_ok(not problems):
                return out
            for p in problems:
                log.error("rollouts discarded: %s", p)
            self.sync.sync(self.version, verify=True)  # re-verify every engine (a changed one is resynced)
        raise NoReadyEngineError(
            f"rollouts for weight version {self.version} kept coming from engines that changed "
            f"after verification: {problems}"
        )

    def _generate(self, prompts, seeds, samples_per_prompt, max_new_tokens, temperature, with_digest):
        result = self.sync.last
        if result is None or self.version is None or result.version != self.version:
            raise NoReadyEngineError("generate() before a completed weight sync: call sync_weights first")
        ready = result.ready
        ids, mask = encode_prompts(self.tokenizer, prompts)
        rows = [ids[i][mask[i].bool()].tolist() for i in range(len(prompts))]
        offset = self.sync.rank
        used = sorted({ready[(i + offset) % len(ready)] for i in range(len(prompts))})

        def request(i: int) -> list[list[int]]:
            url = ready[(i + offset) % len(ready)]
            body = {
                "model": self._model_name(url),
                "prompt": rows[i],
                "n": samples_per_prompt,
                "max_tokens": max_new_tokens,
                "temperature": temperature,
                "seed": seeds[i],
                "return_token_ids": True,
                "skip_special_tokens": False,
                "logprobs": 0,
            }
            try:
                choices = sorted(
                    http(url, "/v1/completions", body, timeout=self.timeout_s)["choices"], key=lambda c: c["index"]
                )
            except EngineError as exc:
                raise EngineError(f"rollout request to {url} failed: {exc}") from None
            return [(c["token_ids"], (c.get("logprobs") or {}).get("token_logprobs")) for c in choices]

        with ThreadPoolExecutor(max_workers=min(16, len(prompts))) as pool:
            answers = [c for per_prompt in pool.map(request, range(len(prompts))) for c in per_prompt]
        completions = [toks for toks, _ in answers]
        logprobs = [lp for _, lp in answers]
        have_logprobs = all(
            lp is not None and len(lp) == len(toks) and all(isinstance(x, (int, float)) for x in lp)
            for toks, lp in answers
        )
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        width = max(1, max(len(c) for c in completions))
        comp = torch.full((len(completions), width), pad, dtype=torch.long)
        comp_mask = torch.zeros_like(comp)
        comp_logp = torch.zeros(comp.shape, dtype=torch.float32)
        for i, toks in enumerate(completions):
            if eos in toks:
                toks = toks[: toks.index(eos) + 1]
            comp[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            comp_mask[i, : len(toks)] = 1
            if have_logprobs:
                comp_logp[i, : len(toks)] = torch.tensor(logprobs[i][: len(toks)], dtype=torch.float32)
        texts = self.tokenizer.batch_decode(comp * comp_mask + pad * (1 - comp_mask), skip_special_tokens=True)
        ids = ids.repeat_interleave(samples_per_prompt, 0)
        mask = mask.repeat_interleave(samples_per_prompt, 0)
        dev = self.device
        if with_digest and not result.digest:
            raise NoReadyEngineError(
                f"weight sync {self.version} ran without verification; sync with verify=True "
                "to get a digest with the rollouts"
            )
        return Rollouts(
            ids.to(dev),
            mask.to(dev),
            comp.to(dev),
            comp_mask.to(dev),
            texts,
            self.version,
            result.digest if with_digest else None,
            comp_logp.to(dev) if have_logprobs else None,
        ), used

    def close(self) -> None:
        """Stop the engines this run started on its host (``rollout.vllm.local_python``), if any."""
        for e in self.local_engines:
            e.stop()
