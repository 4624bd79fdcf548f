"""FSDP2 with SR in the all-gather cast, on real FSDP2 over gloo process groups."""

import json
from collections import defaultdict

import pytest
import torch

from dist_sr import stochastic_round
from dist_sr.numerics.shards import shard_layout
from dist_sr.replica import tensor_digest
from tests.dist_utils import run_workers
from tests.engines.models import forward_weights, tiny_qwen2

pytestmark = pytest.mark.slow
SEED, STEPS = 1234, 3


def build(world_size, replicate=1):
    from torch.distributed.fsdp import fully_shard

    from dist_sr.engines import fsdp2

    model = tiny_qwen2()
    ctx = fsdp2.prepare(model, seed=SEED)
    mesh = fsdp2.FSDP2Config(replicate=replicate).mesh()  # None: plain FSDP over the world
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(model, mesh=mesh, mp_policy=fsdp2.MIXED_PRECISION)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ctx.track(opt)
    return model, ctx, opt


def batch():
    g = torch.Generator().manual_seed(7)  # the same batch on every rank: reductions are exact
    return torch.randint(0, 3, (4, 9), generator=g)


def train(model, opt, steps):
    for _ in range(steps):
        ids = batch()
        model(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return grads


def capture_working(model):
    """The unsharded BF16 weights each module's forward uses, by normalised name."""
    return forward_weights(model, batch())


def check_offsets_against_dtensor(model, world_size):
    """The global offsets SR uses are DTensor's own: the local piece of arange(numel) starts there."""
    from torch.distributed.tensor import distribute_tensor

    rank = torch.distributed.get_rank()
    for name, p in model.named_parameters():
        index = torch.arange(p.numel()).view(p.shape)
        local = distribute_tensor(index, p.device_mesh, p.placements, src_data_rank=None).to_local()
        offset, row_stride, _ = shard_layout(tuple(p.shape), tuple(local.shape), world_size, rank)
        if local.numel():
            assert row_stride is None and torch.equal(local.flatten(), torch.arange(offset, offset + local.numel())), (
                name
            )


def _bits_worker(rank, world_size, out_dir, replicate=1):
    from dist_sr.engines import fsdp2
    from dist_sr.engines.fsdp2 import FSDP2Source
    from dist_sr.sources import layout_free_digest

    model, ctx, opt = build(world_size, replicate)
    if replicate == 1:
        check_offsets_against_dtensor(model, world_size)
    ctx.record_gathers = True
    ctx.cache_rounded = False  # every gather rounds afresh: the backward re-gather must reproduce the bits
    grads = train(model, opt, STEPS)
    full = fsdp2.full_master(model)
    working = capture_working(model)
    assert ctx.step == STEPS and set(working) == set(full)
    for name, w in working.items():
        expected = stochastic_round(full[name], seed=SEED, step=STEPS, param=name)
        assert w.dtype == torch.bfloat16 and torch.equal(w.view(torch.int16), expected.view(torch.int16)), name
    # gradients are reduced and kept in FP32 on the FP32 shards
    assert all(g is None or g.dtype == torch.float32 for g in grads)
    # every gather of a (parameter, step, shard) sent the same bits: forward == backward re-gather
    by_key = defaultdict(set)
    counts = defaultdict(int)
    for name, step, offset, digest in ctx.gathers:
        by_key[(name, step, offset)].add(digest)
        counts[(name, step)] += 1
    assert all(len(d) == 1 for d in by_key.values())
    layer_keys = [k for k in counts if k[0].startswith("model.layers.") and k[1] < STEPS]
    assert layer_keys and all(counts[k] >= 2 for k in layer_keys)  # re-gathered in backward
    digests = {n: tensor_digest(w) for n, w in working.items()}
    # the digest the trainer and the rollout fleet use, summed from the shards (HSDP: one replica)
    digests["layout-free"] = layout_free_digest(FSDP2Source(model, ctx, rank, world_size), world_size)
    if rank == 0:
        label = f"world{world_size}" + (f"-replicate{replicate}" if replicate > 1 else "")
        (out_dir / f"{label}.json").write_text(json.dumps(digests, sort_keys=True))
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, digests)
    assert all(g == digests for g in gathered)  # every rank holds identical working bits


@pytest.mark.parametrize("world_size", [2])  # 1 and 4: the next test (the same worker)
def test_working_weights_are_the_keyed_rounding_of_the_full_master(world_size, tmp_path):
    run_workers(_bits_worker, world_size, tmp_path)


def test_world_sizes_1_and_4_give_identical_bf16_weights(tmp_path):
    # every rank trains on the same batch, so the FP32 reductions are exact and the masters, hence
    # the keyed BF16 bits, are identical at every step; with different per-rank data the FP32
    # summation order changes with the world size and later masters may differ in their last bits.
    # Unsharded against the widest sharding here (world 2: the test above, keyed element by element)
    for world_size in (1, 4):
        run_workers(_bits_worker, world_size, tmp_path)
    results = {w: json.loads((tmp_path / f"world{w}.json").read_text()) for w in (1, 4)}
    assert results[1] == results[4]


def _save_worker(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    from dist_sr.engines import fsdp2

    model, ctx, opt = build(world_size)
    train(model, opt, STEPS)
    dcp.save({"model": fsdp2.sharded_state_dict(model)}, checkpoint_id=str(path / "ckpt"))
    working = {n: tensor_digest(w) for n, w in capture_working(model).items()}
    if rank == 0:
        (path / "sr.json").write_text(json.dumps({"sr": ctx.state_dict(), "working": working}))


def _load_worker(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    from dist_sr.engines import fsdp2

    model, ctx, opt = build(world_size)
    saved = json.loads((path / "sr.json").read_text())
    state = {"model": fsdp2.sharded_state_dict(model)}
    dcp.load(state, checkpoint_id=str(path / "ckpt"))
    ctx.load_state_dict(saved["sr"])
    working = {n: tensor_digest(w) for n, w in capture_working(model).items()}
    assert working == saved["working"]


@pytest.mark.parametrize("load_world", [1, 4])
def test_dcp_checkpoint_reloads_at_another_world_size_with_identical_bits(load_world, tmp_path):
    run_workers(_save_worker, 2, tmp_path)
    run_workers(_load_worker, load_world, tmp_path)


def _switch_worker(rank, world_size, precision, mode, seed):
    import yaml

    from dist_sr.engines import fsdp2

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((root / "configs" / "fsdp2-sr.yaml").read_text())
    model = tiny_qwen2()
    ctx = fsdp2.apply_fsdp2(model, precision, doc["fsdp2"])
    assert (ctx.mode, ctx.seed) == (mode, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ctx.track(opt)
    train(model, opt, 2)
    full = fsdp2.full_master(model)
    for name, w in capture_working(model).items():
        if mode == "nearest":
            expected = full[name].to(torch.bfloat16)  # round-to-nearest, as a plain BF16 FSDP2 cast
        else:
            expected = stochastic_round(full[name], seed=seed, step=2, param=name, mode=mode, backend="reference")
        assert torch.equal(w.view(torch.int16), expected.view(torch.int16)), name


@pytest.mark.parametrize(
    "precision,mode,seed",
    [
        ("bf16", "nearest", 0),
        ("bf16-dither", "dither", 0),
        ({"precision": "bf16-sr", "seed": 1234}, "stochastic", 1234),
    ],
)
def test_precision_switch_selects_the_fsdp2_behaviour(precision, mode, seed):
    """The rounding each precision names, with the configured seed (literals, not read back from
    the object under test), in the bits the all-gather delivers."""
    run_workers(_switch_worker, 2, precision, mode, seed)


def test_hsdp_gives_the_bits_of_unsharded_rounding(tmp_path):
    """HSDP (2 replicas x 2 shards): the working weights are the keyed rounding of the full
    master, identical on all 4 ranks and to a 1-rank run; the layout-free digest counts each
    element once."""
    run_workers(_bits_worker, 1, tmp_path)
    run_workers(_bits_worker, 4, tmp_path, 2)
    assert json.loads((tmp_path / "world4-replicate2.json").read_text()) == json.loads(
        (tmp_path / "world1.json").read_text()
    )


def _pure_worker(rank, world_size, precision, out_dir, replicate=1):
    """bf16-pure-sr on FSDP2: BF16 shards updated by AdamWSR with the shards' global offsets."""
    from torch.distributed.tensor import DTensor

    from dist_sr.engines import fsdp2

    model = tiny_qwen2()
    assert fsdp2.apply_fsdp2(model, precision, {"shard_modules": ["Qwen2DecoderLayer"], "replicate": replicate}) is None
    opt = fsdp2.pure_bf16_optimizer(model, precision, lr=1e-3)
    train(model, opt, STEPS)
    full = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.dtype == torch.bfloat16, name  # no FP32 copy anywhere
        full[name] = p.full_tensor()
    for state in opt.state.values():
        assert state["exp_avg"].dtype == opt.moment_dtype and isinstance(state["exp_avg"], DTensor)
    digests = {n: tensor_digest(t) for n, t in full.items()}
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, {n: tensor_digest(p.to_local()) for n, p in model.named_parameters()})
    if replicate > 1:  # rank r and r + shards hold the same shard: the replicas agree bit for bit
        shards = world_size // replicate
        assert all(gathered[r] == gathered[r % shards] for r in range(world_size))
    if rank == 0:
        (out_dir / f"pure-world{world_size}-r{replicate}.json").write_text(json.dumps(digests, sort_keys=True))


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_pure_bf16_adamw_sr_sharded_equals_unsharded_at_world_sizes_1_2_4_and_hsdp(moment_dtype, tmp_path):
    """The sharded pure-BF16 run holds, bit for bit, the weights of the single-process AdamWSR."""
    from dist_sr import apply_precision
    from dist_sr.optim import AdamWSR

    precision = {"precision": "bf16-pure-sr", "seed": SEED, "moment_dtype": moment_dtype}
    # (world, replicate): the last is HSDP 2 x 2. FP32 moments are not rounded, so their sharding
    # only matters for the weights': the two widest layouts; BF16 moments are keyed by shard offset
    runs = [(1, 1), (2, 1), (4, 1), (4, 2)] if moment_dtype == "bf16" else [(4, 1), (4, 2)]
    for world_size, replicate in runs:
        run_workers(_pure_worker, world_size, precision, tmp_path, replicate)
    model = tiny_qwen2()
    tp = apply_precision(model, precision, AdamWSR, lr=1e-3)
    train(model, tp.optimizer, STEPS)
    expected = {n: tensor_digest(p.detach()) for n, p in model.named_parameters()}
    for world_size, replicate in runs:
        got = json.loads((tmp_path / f"pure-world{world_size}-r{replicate}.json").read_text())
        assert got == expected, (world_size, replicate)


def _column_shard_worker(rank, world_size):
    """AdamWSR on DTensors sharded on a non-leading dim (uneven, one empty shard) == unsharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dist_sr.optim import AdamWSR

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(3)
    shapes = {"w2d": (6, 10), "w3d": (2, 5, 3), "tiny": (4, 2)}  # 2 columns over 4 ranks: two empty shards
    full = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()} for _ in range(3)]
    plain = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
    sharded = {n: torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(1)])) for n, t in full.items()}
    opts = [AdamWSR(list(ps.items()), lr=1e-2, seed=9, moment_dtype="bf16") for ps in (plain, sharded)]
    for step_grads in grads:
        for n in shapes:
            plain[n].grad = step_grads[n].clone()
            sharded[n].grad = distribute_tensor(step_grads[n].clone(), mesh, [Shard(1)])
        for opt in opts:
            opt.step()
    for n in shapes:
        assert torch.equal(sharded[n].full_tensor().view(torch.int16), plain[n].detach().view(torch.int16)), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opts[1].state[sharded[n]][k].full_tensor(), opts[0].state[plain[n]][k]), (n, k)


def test_adamw_sr_on_column_sharded_dtensors_equals_unsharded():
    run_workers(_column_shard_worker, 4)


def test_fsdp2_config_errors():
    from dist_sr.engines import fsdp2

    with pytest.raises(ValueError, match="unknown field"):
        fsdp2.FSDP2Config.from_dict({"shard": ["x"]})


def _digest_paths_worker(rank, world_size):
    """FSDP2Engine.digest() reads the BF16 shards the all-gathers were handed; expected_digest()
    re-rounds the FP32 masters. They agree after a forward; a master changed behind the
    forward's back (the weights the model used are stale), or not gathered since its update,
    makes them differ until the next forward that rounds it."""
    from dist_sr.engines.base import TrainSettings
    from dist_sr.engines.config import DistributedConfig
    from dist_sr.engines.fsdp2.engine import FSDP2Engine
    from dist_sr.precision import PrecisionConfig

    settings = TrainSettings(
        precision=PrecisionConfig("bf16-sr", seed=SEED),
        lr=1e-3,
        distributed=DistributedConfig(engine="fsdp2", fsdp2={"shard_modules": ["Qwen2DecoderLayer"]}),
    )
    eng = FSDP2Engine(settings, tiny_qwen2())
    ids = batch()
    for _ in range(2):
        eng.backward(eng.module(input_ids=ids, labels=ids).loss)
        eng.step()
    with torch.no_grad():
        eng.module(input_ids=ids)
    assert eng.digest() == eng.expected_digest()
    # a master written without the forward seeing it (on every rank's shard of it)
    with torch.no_grad():
        local = eng.module.model.norm.weight.to_local()
        if local.numel():
            local.add_(0.5)
    assert eng.digest() != eng.expected_digest()
    with torch.no_grad():  # without masters_changed() the forward still uses the cached shards: still caught
        eng.module(input_ids=ids)
    assert eng.digest() != eng.expected_digest()
    eng.ctx.masters_changed()
    with torch.no_grad():
        eng.module(input_ids=ids)
    assert eng.digest() == eng.expected_digest()
    # an update the forward has not gathered yet
    eng.backward(eng.module(input_ids=ids, labels=ids).loss)
    eng.step()
    assert eng.digest() != eng.expected_digest()


def test_the_gathered_bits_and_the_masters_rounding_are_two_independent_digests():
    run_workers(_digest_paths_worker, 2)


def _fsdp2_engine():
    from dist_sr.engines.base import TrainSettings
    from dist_sr.engines.config import DistributedConfig
    from dist_sr.engines.fsdp2.engine import FSDP2Engine
    from dist_sr.precision import PrecisionConfig

    settings = TrainSettings(
        precision=PrecisionConfig("bf16-sr", seed=SEED),
        lr=1e-3,
        distributed=DistributedConfig(engine="fsdp2", fsdp2={"shard_modules": ["Qwen2DecoderLayer"]}),
    )
    return FSDP2Engine(settings, tiny_qwen2())


def _manifest_save_worker(rank, world_size, path):
    eng = _fsdp2_engine()
    ids = batch()
    digests = {}
    for step in (1, 2):
        eng.backward(eng.module(input_ids=ids, labels=ids).loss)
        eng.step()
        eng.save(path, step)
        digests[step] = eng.expected_digest()
    if rank == 0:
        (path / "digests.json").write_text(json.dumps(digests))


def _manifest_load_worker(rank, world_size, path, why="files differ"):
    eng = _fsdp2_engine()
    with (
        pytest.warns(RuntimeWarning, match=rf"resuming from .*step1; refused newer .*: .*step2: .*{why}")
        if rank == 0
        else _no_warning_check()
    ):
        assert eng.load(path) == 1
    assert eng.expected_digest() == json.loads((path / "digests.json").read_text())["1"]


def _no_warning_check():
    import contextlib

    return contextlib.nullcontext()


def test_a_corrupted_latest_fsdp2_checkpoint_is_refused_and_the_previous_one_resumes(tmp_path):
    """Every shard file is in the checkpoint's manifest; one flipped byte in the newest makes the
    resume take the previous complete checkpoint, with its own verified digest."""
    run_workers(_manifest_save_worker, 2, tmp_path)
    shard = sorted((tmp_path / "fsdp2" / "step2").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    run_workers(_manifest_load_worker, 2, tmp_path)


class _Planted:
    """Unpickling this creates the file it names: what a planted pickle could do instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_planted_without_the_secret_is_never_unpickled(tmp_path):
    """A process that can write the checkpoint volume but lacks the job's secret replaces the
    newest checkpoint's DCP metadata (which PyTorch unpickles) with a pickle of its own and
    rewrites the manifest's SHA-256s to match: the manifest is not signed with the job's key, so
    the resume refuses it before DCP reads a byte, takes the previous checkpoint, and the planted
    pickle never runs."""
    import hashlib
    import pickle

    run_workers(_manifest_save_worker, 2, tmp_path)
    step2 = tmp_path / "fsdp2" / "step2"
    marker = tmp_path / "planted-pickle-ran"
    (step2 / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    files = {
        str(p.relative_to(step2)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(step2.rglob("*"))
        if p.is_file() and p.name != "MANIFEST.json"
    }
    (step2 / "MANIFEST.json").write_text(json.dumps({"sha256": files}))
    run_workers(_manifest_load_worker, 2, tmp_path, "MANIFEST.json is not signed")
    assert not marker.exists()


def _materialised_worker(rank, world_size):
    """verl's FSDP2 build: rank 0 holds the weights, the others build on the meta device; the
    model is wrapped, sharded, materialised (``to_empty`` / ``to``) and loaded from rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from dist_sr.engines import fsdp2

    if rank == 0:
        model = tiny_qwen2()
    else:
        with torch.device("meta"):
            model = tiny_qwen2()
    full = model.state_dict()
    ctx = fsdp2.prepare(model, seed=SEED)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(model, mp_policy=fsdp2.MIXED_PRECISION)
    model = model.to("cpu") if rank == 0 else model.to_empty(device="cpu")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    ctx.masters_changed()
    assert all(isinstance(p.to_local(), fsdp2.SRShadowParam) for p in model.parameters())
    masters = fsdp2.full_master(model)
    assert torch.equal(masters["lm_head.weight"], tiny_qwen2().lm_head.weight.detach())  # rank 0's weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ctx.track(opt)
    train(model, opt, 2)
    assert all(type(s).__name__ != "SRShadowParam" for st in opt.state.values() for s in st.values())  # moments plain
    masters = fsdp2.full_master(model)
    working = capture_working(model)
    for name, master in masters.items():
        expected = stochastic_round(master, seed=SEED, step=2, param=name)
        assert torch.equal(working[name].view(torch.int16), expected.view(torch.int16)), name


def test_a_model_materialised_after_wrapping_keeps_rounding_with_the_key_on_every_rank():
    run_workers(_materialised_worker, 2)
