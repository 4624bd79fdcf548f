"""DeepSpeed ZeRO with keyed SR, on real DeepSpeed engines over gloo process groups."""

import json
import os

import pytest
import torch

from dist_sr import stochastic_round
from dist_sr.engines.deepspeed import SRConfig, UnsupportedDeepSpeed, check_version, split_config
from dist_sr.engines.deepspeed.version import UNIVERSAL_RELOAD, version_tuple
from dist_sr.replica import tensor_digest
from tests.dist_utils import run_workers
from tests.engines.models import tiny_qwen2

deepspeed = pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

SEED, STEPS = 1234, 3
SR_BLOCK = {"enabled": True, "seed": SEED, "mode": "stochastic"}
LAYOUTS = {
    "zero0": {"zero_optimization": {"stage": 0}},
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero1-bf16-optimizer": {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero1-cpu-offload": {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
    "zero2-cpu-offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero3": {"zero_optimization": {"stage": 3}},
}


def ds_json(**sections):
    """The DeepSpeed JSON the DeepSpeed tests train with (micro-batch 2, bf16, torch's AdamW, the
    SR block), plus ``sections`` (``zero_optimization`` and any other)."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10_000,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "stochastic_rounding": SR_BLOCK,
        **sections,
    }


def ds_config(layout):
    return ds_json(**LAYOUTS[layout])


def engine_for(layout):
    from dist_sr.engines import deepspeed as dsr

    model = tiny_qwen2()
    engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=ds_config(layout))
    return engine


def train(engine, steps):
    ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(7))  # same batch on every rank
    for _ in range(steps):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def working_and_master(engine):
    """{name: (full BF16 working weight, full FP32 master)} (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 0:  # unpartitioned: the optimizer holds full FP32 copies
        opt = engine.optimizer
        hp_of = {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lps, hps)}
        masters = {n: hp_of[id(p)].detach().clone() for n, p in params}
    else:
        masters = {n: safe_get_full_fp32_param(p).view(getattr(p, "ds_shape", p.shape)).clone() for n, p in params}
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            working = {n: p.data.clone() for n, p in params}
    else:
        working = {n: p.data.clone() for n, p in params}
    return {n: (working[n], masters[n]) for n, _ in params}


def assert_keyed(engine):
    state = working_and_master(engine)
    for name, (w, master) in state.items():
        expected = stochastic_round(master, seed=SEED, step=engine.global_steps, param=name)
        assert w.dtype == torch.bfloat16 and torch.equal(w.view(torch.int16), expected.view(torch.int16)), name
    return {n: tensor_digest(w) for n, (w, _) in state.items()}


def _keyed_worker(rank, world_size, layout, steps, out_dir):
    engine = engine_for(layout)
    assert_keyed(engine)  # step 0: the initial rounding
    train(engine, steps)
    assert engine.global_steps == steps
    digests = assert_keyed(engine)
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, digests)
    assert all(g == digests for g in gathered)  # every rank holds identical working bits
    if rank == 0 and out_dir is not None:
        (out_dir / f"{layout}-world{world_size}.json").write_text(json.dumps(digests, sort_keys=True))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_bf16_element_is_the_keyed_rounding_of_the_full_master(layout):
    run_workers(_keyed_worker, 2, layout, STEPS, None)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_world_sizes_1_and_4_give_identical_weights_after_the_first_step(layout, tmp_path):
    # unpartitioned and the widest partitioning here (world 2 is the test above); after one step
    # from the same weights and data: later steps may differ in the last bits of the FP32 master
    # because DeepSpeed's reductions change order with the world size
    for world_size in (1, 4):
        run_workers(_keyed_worker, world_size, layout, 1, tmp_path)
    digests = [json.loads((tmp_path / f"{layout}-world{w}.json").read_text()) for w in (1, 4)]
    assert digests[0] == digests[1]


def _save_worker(rank, world_size, layout, path):
    engine = engine_for(layout)
    train(engine, STEPS)
    engine.save_checkpoint(str(path), tag="ckpt")
    digests = assert_keyed(engine)
    if rank == 0:
        (path / "digests.json").write_text(json.dumps(digests))


def _load_worker(rank, world_size, layout, path):
    engine = engine_for(layout)
    engine.load_checkpoint(str(path), tag="ckpt")
    assert engine.global_steps == STEPS  # the key's step survives the reload
    assert assert_keyed(engine) == json.loads((path / "digests.json").read_text())
    train(engine, 1)  # and training goes on keyed
    assert_keyed(engine)


@pytest.mark.slow
# one layout per optimizer class and offload path (ZeRO 1 reloads through the ZeRO 2 optimizer)
@pytest.mark.parametrize("layout", ["zero0", "zero1-bf16-optimizer", "zero2", "zero2-cpu-offload", "zero3"])
def test_checkpoint_reload_re_derives_identical_bits(layout, tmp_path):
    run_workers(_save_worker, 2, layout, tmp_path)
    run_workers(_load_worker, 2, layout, tmp_path)


def _load_universal_worker(rank, world_size, layout, path):
    from dist_sr.engines import deepspeed as dsr

    model = tiny_qwen2()
    config = ds_config(layout) | {"checkpoint": {"load_universal": True}}
    engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=config)
    if version_tuple() < UNIVERSAL_RELOAD:  # an older DeepSpeed would reload other masters: refused
        with pytest.raises(UnsupportedDeepSpeed, match="other FP32 masters"):
            engine.load_checkpoint(str(path / "universal"), tag="ckpt_universal")
        return
    engine.load_checkpoint(str(path / "universal"), tag="ckpt_universal")
    assert engine.global_steps == STEPS
    assert assert_keyed(engine) == json.loads((path / "digests.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout,load_world", [("zero2", 1), ("zero2", 4), ("zero1-bf16-optimizer", 4)])
def test_universal_checkpoint_reloads_at_another_world_size_with_identical_bits(layout, load_world, tmp_path):
    import subprocess
    import sys

    run_workers(_save_worker, 2, layout, tmp_path)
    (tmp_path / "universal").mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(tmp_path / "ckpt"),
            "--output_folder",
            str(tmp_path / "universal" / "ckpt_universal"),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            "--inject_missing_state",
        ],
        check=True,
        capture_output=True,
    )
    (tmp_path / "universal" / "latest_universal").write_text("ckpt_universal")
    run_workers(_load_universal_worker, load_world, layout, tmp_path)


def _corruption_worker(rank, world_size):
    from dist_sr import ReplicaDivergenceError, check_replicas

    engine = engine_for("zero2")
    train(engine, 1)
    check_replicas(engine.module)
    if rank == 1:
        with torch.no_grad():
            engine.module.lm_head.weight.view(torch.int16)[1, 2] ^= 1
    with pytest.raises(ReplicaDivergenceError) as info:
        check_replicas(engine.module)
    assert info.value.params == ["lm_head.weight"]


@pytest.mark.slow
def test_injected_replica_corruption_is_caught():
    run_workers(_corruption_worker, 2)


def _fp32_engine_worker(rank, world_size):
    from dist_sr.engines import deepspeed as dsr

    config = ds_config("zero1")
    del config["bf16"]
    fp32_model = tiny_qwen2()
    with pytest.raises(ValueError, match="needs BF16 working weights"):
        dsr.initialize(model=fp32_model, model_parameters=fp32_model.parameters(), config=config)


@pytest.mark.slow
def test_unsupported_engines_are_refused_with_the_fix():
    run_workers(_fp32_engine_worker, 1)


@pytest.mark.parametrize("version", ["0.18.9", "0.19.4", "0.20.0", "1.0.0", "garbage"])
def test_untested_deepspeed_versions_are_refused(version):
    with pytest.raises(UnsupportedDeepSpeed, match=r">=0.19.5,<0.20"):
        check_version(version)


def test_installed_version_is_tested():
    check_version()


def test_config_block_is_read_and_removed():
    config, sr = split_config(ds_config("zero2"))
    assert "stochastic_rounding" not in config and sr == SRConfig(True, SEED, "stochastic")
    off = ds_config("zero2") | {"stochastic_rounding": {"enabled": False}}
    assert split_config(off)[1] is None
    with pytest.raises(ValueError, match="unknown field"):
        split_config(ds_config("zero2") | {"stochastic_rounding": {"sead": 1}})
    with pytest.raises(ValueError, match="unknown mode"):
        split_config(ds_config("zero2") | {"stochastic_rounding": {"mode": "up"}})


def test_config_file_path_is_accepted(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config("zero3")))
    config, sr = split_config(path)
    assert config["zero_optimization"]["stage"] == 3 and sr.seed == SEED


@pytest.mark.parametrize(
    "precision,expect",
    [
        ("fp32", (None, None, None)),
        ("fp16", (None, True, None)),
        ("bf16", (True, None, None)),
        ({"precision": "bf16-sr", "seed": 9}, (True, None, {"enabled": True, "seed": 9, "mode": "stochastic"})),
        ("bf16-dither", (True, None, {"enabled": True, "seed": 0, "mode": "dither"})),
    ],
)
def test_precision_switch_selects_the_deepspeed_behaviour(precision, expect):
    from dist_sr.engines.deepspeed import config_for_precision

    config = config_for_precision(precision, ds_config("zero2"))
    got = (
        config.get("bf16", {}).get("enabled"),
        config.get("fp16", {}).get("enabled"),
        config.get("stochastic_rounding"),
    )
    assert got == expect


def test_pure_bf16_precision_is_refused_for_deepspeed():
    from dist_sr import PrecisionConfigError
    from dist_sr.engines.deepspeed import config_for_precision

    with pytest.raises(PrecisionConfigError, match="keeps no FP32 master"):
        config_for_precision("bf16-pure-sr", ds_config("zero2"))


REPO_CONFIGS = sorted(
    (__import__("pathlib").Path(__file__).resolve().parents[2] / "configs" / "deepspeed").glob("*.json")
)


def _repo_config_worker(rank, world_size, path):
    from dist_sr.engines import deepspeed as dsr

    model = tiny_qwen2()
    engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=str(path))
    assert engine.dist_sr.mode == "stochastic"
    ids = torch.randint(0, 3, (engine.train_micro_batch_size_per_gpu(), 9), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    assert_keyed(engine)


@pytest.mark.slow
@pytest.mark.parametrize("path", REPO_CONFIGS, ids=lambda p: p.stem)
def test_repo_deepspeed_configs_train_with_keyed_sr(path):
    run_workers(_repo_config_worker, 2, path)


def _our_engine(stage=2):
    from dist_sr.engines.base import TrainSettings
    from dist_sr.engines.config import DistributedConfig
    from dist_sr.engines.deepspeed.engine import DeepSpeedEngine
    from dist_sr.precision import PrecisionConfig

    settings = TrainSettings(
        precision=PrecisionConfig("bf16-sr", seed=SEED),
        distributed=DistributedConfig(engine="deepspeed", zero_stage=stage),
        lr=1e-2,
        batch_per_rank=2,
    )
    return DeepSpeedEngine(settings, tiny_qwen2())


def _guard_save_worker(rank, world_size, path):
    eng = _our_engine()
    ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(7))
    for _step in (1, 2):
        eng.backward(eng.module(input_ids=ids, labels=ids).loss)
        eng.step()
    assert eng.digest() == eng.expected_digest()
    eng.save(path, 2)
    # one flipped bit of a working weight (on every replica: replica divergence has its own
    # check): the held bits and the masters' rounding differ, and the save is refused before
    # anything is written
    with torch.no_grad():
        eng.module.lm_head.weight.view(torch.int16)[1, 2] ^= 1
    assert eng.digest() != eng.expected_digest()
    with pytest.raises(RuntimeError, match="not saving step 3: the BF16 working weights .* are not the keyed rounding"):
        eng.save(path, 3)
    assert not (path / "deepspeed" / "step3").exists() and (path / "deepspeed" / "latest").read_text() == "step2"


def _guard_load_worker(rank, world_size, path, expect):
    from dist_sr.engines.checkpoints import CheckpointCorrupt

    eng = _our_engine()
    if expect == "digest":
        with pytest.raises(
            RuntimeError,
            match=r"step2/mp_rank_00_model_states.pt: after loading, the working weights "
            r"have digest .* the checkpoint recorded",
        ):
            eng.load(path)
    elif expect == "corrupt":
        with pytest.raises(
            CheckpointCorrupt, match=r"step2: files differ from those written: \['[^']*optim_states.pt'\]"
        ):
            eng.load(path)
    else:
        assert eng.load(path) == 2 and eng.digest() == eng.expected_digest()


@pytest.mark.slow
def test_our_deepspeed_checkpoints_are_verified_on_save_and_on_load(tmp_path):
    """A checkpoint is written only from a consistent state and loads back verified. A flipped bit
    in a stored FP32 master is refused by the files' manifest; with the manifest rewritten to
    match (a writer that stored a wrong master), by the digest recorded at save time."""
    from dist_sr.engines.checkpoints import write_manifest

    run_workers(_guard_save_worker, 2, tmp_path)
    run_workers(_guard_load_worker, 2, tmp_path, "ok")
    (optim,) = sorted((tmp_path / "deepspeed" / "step2").glob("*zero_pp_rank_0_*optim_states.pt"))
    state = torch.load(optim, weights_only=False)
    flat = state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    flat.view(torch.int32)[5] ^= 1 << 20  # a bit high in the mantissa: the rounding changes
    torch.save(state, optim)
    run_workers(_guard_load_worker, 2, tmp_path, "corrupt")
    write_manifest(tmp_path / "deepspeed" / "step2")
    run_workers(_guard_load_worker, 2, tmp_path, "digest")


def test_the_deprecated_integration_path_warns_and_gives_the_same_objects():
    import importlib
    import sys

    from dist_sr.engines import deepspeed

    sys.modules.pop("dist_sr.integrations.deepspeed", None)
    with pytest.warns(DeprecationWarning, match="moved to dist_sr.engines.deepspeed"):
        old = importlib.import_module("dist_sr.integrations.deepspeed")
    assert old.__all__ == deepspeed.__all__
    assert all(getattr(old, n) is getattr(deepspeed, n) for n in deepspeed.__all__)
