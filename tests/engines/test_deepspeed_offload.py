"""DeepSpeed's memory modes with keyed SR, on real DeepSpeed engines over gloo (DeepSpeed's CPU
accelerator): optimizer and parameter offload, ZeRO++ hpZ, ``offload_states``, and the ZeRO
features refused by name. Where each piece is rounded and copied is read from the plan
(``engine.dist_sr.layout.routes()``); on this machine every device is the host, so the routes
say who copies (DeepSpeed's own buffer and copy, or dist-sr's); the same checks on a GPU, where
the masters are on the host and the weights on the device, are in ``bench/gpu_check.sh``."""

import gc
import os

import pytest
import torch

from tests.dist_utils import run_workers
from tests.engines.models import forward_weights, tiny_qwen2
from tests.engines.test_deepspeed import SEED, assert_keyed, ds_json, train

deepspeed = pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytestmark = pytest.mark.slow

OFFLOAD = {
    "zero1-offload-optimizer": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    "zero2-offload-optimizer-pinned": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "zero3-offload-optimizer": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "zero3-offload-param-and-optimizer": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
    },
}


def config(zero, **extra):
    return ds_json(zero_optimization=zero, **extra)


def engine_for(zero, **extra):
    from dist_sr.engines import deepspeed as dsr

    model = tiny_qwen2()
    engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=config(zero, **extra))
    return engine


def _offload_worker(rank, world_size, layout):
    from dist_sr.engines.deepspeed.layouts import OffloadFragmentLayout, Zero3Layout

    engine = engine_for(OFFLOAD[layout])
    sr = engine.dist_sr
    assert_keyed(engine)  # step 0
    train(engine, 3)
    assert_keyed(engine)
    routes = sr.layout.routes()
    planned = [None] * world_size  # the ranks' partitions together cover every parameter
    torch.distributed.all_gather_object(planned, {r.param for r in routes})
    assert set().union(*planned) == {sr.names[id(p)] for p in engine.module.parameters()}
    opt = engine.optimizer
    if isinstance(sr.layout, OffloadFragmentLayout):
        # rounded on the host into DeepSpeed's own BF16 buffer, which DeepSpeed copies to the weights
        assert all(r.master == r.rounded_into == "cpu" and r.copied_by == "deepspeed" for r in routes)
        buffers = {b.data_ptr() for b in opt.param_buffer_of_bit16_for_cpu_offload_groups}
        assert {target.data_ptr() for _, target in sr.layout.group_plan(0)._copies} <= buffers
        # and the FP32 partitions are back where DeepSpeed keeps them after every step
        assert all(t.dtype == torch.float32 for t in opt.single_partition_of_fp32_groups)
    else:
        assert isinstance(sr.layout, Zero3Layout)
        masters = {str(t.device) for t in opt.fp32_partitioned_groups_flat}
        weights = {str(t.device) for t in opt.fp16_partitioned_groups_flat}
        assert {r.master for r in routes} == masters and {r.working for r in routes} == weights
        # one device here: rounded straight into the BF16 partitions, nothing staged
        assert all(r.copied_by is None for r in routes)


@pytest.mark.parametrize("layout", list(OFFLOAD))
def test_offload_layouts_hold_the_keyed_rounding_of_the_full_master(layout):
    run_workers(_offload_worker, 2, layout)


def _staged_worker(rank, world_size, layout):
    import functools

    from dist_sr.engines import placement
    from dist_sr.engines.deepspeed import layouts

    # round through a staging buffer and copy, as when the partitions are on another device
    layouts.PlacedRounding = functools.partial(placement.PlacedRounding, stage=True)
    engine = engine_for(OFFLOAD[layout])
    train(engine, 2)
    assert_keyed(engine)
    assert all(r.copied_by == "dist-sr" for r in engine.dist_sr.layout.routes())


@pytest.mark.parametrize("layout", ["zero3-offload-optimizer"])
def test_zero3_rounding_staged_beside_the_masters_and_copied_gives_the_keyed_bits(layout):
    run_workers(_staged_worker, 2, layout)


def _offload_states_worker(rank, world_size, sr_on):
    """``engine.offload_states()`` (what RL frameworks call before rollouts) moves the FP32 and BF16
    partitions to new host buffers: their old storages must be freed with SR as without it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from dist_sr.engines import deepspeed as dsr

    model = tiny_qwen2()
    cfg = config({"stage": 2})
    if not sr_on:
        del cfg["stochastic_rounding"]
    engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train(engine, 1)
    opt = engine.optimizer
    refs = [StorageWeakRef(t.untyped_storage()) for t in [*opt.single_partition_of_fp32_groups, *opt.bit16_groups_flat]]
    engine.offload_states()
    gc.collect()
    assert all(r.expired() for r in refs), [r.expired() for r in refs]
    engine.reload_states()
    train(engine, 1)
    if sr_on:
        assert_keyed(engine)  # planned again where the partitions are now


@pytest.mark.parametrize("sr_on", [False, True], ids=["without-sr", "with-sr"])
def test_offload_states_frees_the_partitions_dist_sr_rounded(sr_on):
    run_workers(_offload_states_worker, 1, sr_on)


def _hpz_worker(rank, world_size):
    engine = engine_for({"stage": 3, "zero_hpz_partition_size": 2})
    assert engine.zero_hpz_partition_size() == 2
    train(engine, 2)
    assert_keyed(engine)
    # the forward pass gathers hpZ's secondary partitions: they hold the keyed bits too
    from dist_sr import stochastic_round
    from tests.engines.test_deepspeed import working_and_master

    masters = {n: m for n, (_, m) in working_and_master(engine).items()}
    ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(3))
    used = forward_weights(engine.module, ids)
    for name, w in used.items():
        expected = stochastic_round(masters[name], seed=SEED, step=2, param=name)
        assert torch.equal(w.view(torch.int16), expected.view(torch.int16)), name


def test_zero_plus_plus_hpz_forward_uses_the_keyed_bits():
    run_workers(_hpz_worker, 4)


def _quantized_weights_worker(rank, world_size):
    from dist_sr.engines.deepspeed import UnsupportedDeepSpeed

    with pytest.raises(UnsupportedDeepSpeed, match="zero_optimization.zero_quantized_weights"):
        engine_for({"stage": 3, "zero_quantized_weights": True})  # before DeepSpeed builds anything


def test_zero_plus_plus_quantized_weights_are_refused_by_name():
    run_workers(_quantized_weights_worker, 1)


def test_mics_is_refused_by_name_where_deepspeed_still_offers_it():
    from types import SimpleNamespace

    from dist_sr.engines.deepspeed import UnsupportedDeepSpeed
    from dist_sr.engines.deepspeed.layouts import check_zero_features

    engine = SimpleNamespace(config={"zero_optimization": {"stage": 3, "mics_shard_size": 2}})
    with pytest.raises(UnsupportedDeepSpeed, match="mics_shard_size=2"):
        check_zero_features(engine)  # an engine built by DeepSpeed < 0.19.8, which still had MiCS
    check_zero_features(SimpleNamespace(config={"zero_optimization": {"stage": 3}}))


# ZenFlow as its users write it: ZeRO-Offload with a "zenflow" block and DeepSpeed's own CPU Adam
# (ZenFlow's selective AdamW refuses torch's). Its sequential form trains on this CPU at stage 2;
# at stage 3 DeepSpeed builds it here and its backward then needs CUDA.
ZENFLOW = {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 2, "update_interval": 2}


def zenflow_config(stage: int, sr: bool = True) -> dict:
    cfg = config({"stage": stage, "offload_optimizer": {"device": "cpu"}, "zenflow": ZENFLOW})
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    if not sr:
        del cfg["stochastic_rounding"]
    return cfg


def built_engines():
    from deepspeed.runtime.engine import DeepSpeedEngine

    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]


def _zenflow_block_worker(rank, world_size, stage):
    from dist_sr.engines.deepspeed import UnsupportedDeepSpeed

    assert getattr(deepspeed.initialize, "__dist_sr_hook__", False), "the start-up hook is not installed here"
    model = tiny_qwen2()
    with pytest.raises(UnsupportedDeepSpeed, match=r"^zero_optimization\.zenflow: .*Remove the \"zenflow\" block"):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=zenflow_config(stage))
    assert built_engines() == []  # refused from the config, before DeepSpeed built anything


@pytest.mark.parametrize("stage", [2, 3])
def test_zenflow_with_the_sr_block_is_refused_by_name_before_deepspeed_builds_it(stage):
    run_workers(_zenflow_block_worker, 1, stage)


def _zenflow_env_worker(rank, world_size, path, stage, expect_class):
    import argparse

    from dist_sr.engines.deepspeed import UnsupportedDeepSpeed

    os.environ["DIST_SR_SEED"] = "1234"  # the switch from the job's environment, a config without the block
    args = argparse.Namespace(deepspeed_config=path, local_rank=0)
    model = tiny_qwen2()
    with pytest.raises(UnsupportedDeepSpeed, match=r"^zero_optimization\.zenflow: "):
        deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    (engine,) = built_engines()  # DeepSpeed built ZenFlow: refused on what it built, before the first step
    assert type(engine.optimizer).__name__ == expect_class and engine.global_steps == 0
    assert getattr(engine, "dist_sr", None) is None


@pytest.mark.parametrize(
    "stage, expect_class", [(2, "ZenFlowZeroOptimizerSequential"), (3, "DeepSpeedZeroOptimizer_Stage3")]
)
def test_zenflow_switched_on_by_dist_sr_seed_is_refused_on_the_optimizer_deepspeed_built(tmp_path, stage, expect_class):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(zenflow_config(stage, sr=False)))
    run_workers(_zenflow_env_worker, 1, str(path), stage, expect_class)


def _zenflow_unkeyed_worker(rank, world_size):
    os.environ.pop("DIST_SR_SEED", None)
    model = tiny_qwen2()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=zenflow_config(2, False))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(7))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    moved = [n for n, p in engine.module.named_parameters() if not torch.equal(p.detach(), before[n])]
    # no optimizer step, so no FP32->BF16 copy yet: ZenFlow's selective AdamW wrote these in BF16
    assert engine.global_steps == 0 and moved, moved


def test_zenflow_writes_the_bf16_weights_in_its_backward_where_no_copy_site_runs():
    """Why ZenFlow is refused rather than keyed: it changes the working weights outside every
    FP32->BF16 copy (its BF16 update of the selected columns runs inside the backward pass)."""
    run_workers(_zenflow_unkeyed_worker, 1)


def test_superoffload_is_refused_by_name_from_the_config_and_from_its_optimizer_class():
    """SuperOffload needs a CUDA GPU to build, so here: the config's field (checked before
    DeepSpeed builds anything) and the check a built engine's optimizer goes through (its class)."""
    from deepspeed.runtime.superoffload.superoffload_stage3 import SuperOffloadOptimizer_Stage3

    from dist_sr.engines.deepspeed import UnsupportedDeepSpeed
    from dist_sr.engines.deepspeed.layouts import check_optimizer, check_zero_config

    words = r"^zero_optimization\.offload_optimizer\.super_offload: .*\"super_offload\": false"
    with pytest.raises(UnsupportedDeepSpeed, match=words):
        check_zero_config({"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}})
    check_zero_config({"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": False}})
    with pytest.raises(UnsupportedDeepSpeed, match=words):
        check_optimizer(SuperOffloadOptimizer_Stage3.__new__(SuperOffloadOptimizer_Stage3))  # its class alone


class _CopiesItself:
    """A ZeRO-1/2 optimizer class that rewrites the BF16 partitions itself after DeepSpeed's step
    (round-to-nearest from the masters), as ZenFlow's does: what dist-sr must detect."""

    @staticmethod
    def build():
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        class CopiesItself(DeepSpeedZeroOptimizer):
            def step(self, closure=None):
                super().step(closure)
                for i, flat in enumerate(self.single_partition_of_fp32_groups):
                    self.parallel_partitioned_bit16_groups[i][0].data.copy_(flat.data)

        class OnlyConstructs(DeepSpeedZeroOptimizer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.built_by_a_subclass = True

        return CopiesItself, OnlyConstructs


def _subclass_worker(rank, world_size):
    from deepspeed.runtime import engine as ds_engine

    from dist_sr.engines.deepspeed import UnsupportedDeepSpeed

    copies_itself, only_constructs = _CopiesItself.build()
    ds_engine.DeepSpeedZeroOptimizer = copies_itself  # where DeepSpeed's engine finds its ZeRO-1/2 class
    model = tiny_qwen2()
    with pytest.raises(
        UnsupportedDeepSpeed, match=r"CopiesItself, a subclass of DeepSpeedZeroOptimizer .*replacing step"
    ):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config({"stage": 2}))
    ds_engine.DeepSpeedZeroOptimizer = only_constructs  # constructs differently, copies as tested
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config({"stage": 2}))
    assert engine.optimizer.built_by_a_subclass
    train(engine, 2)
    assert_keyed(engine)


def test_a_zero_optimizer_subclass_with_its_own_methods_is_refused_naming_them_and_one_without_is_keyed():
    run_workers(_subclass_worker, 1)
