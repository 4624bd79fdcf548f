"""DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": N}``) with keyed SR, on real DeepSpeed
over gloo: every element of a tensor-parallel shard is rounded with its index in the full
parameter, so two TP layouts hold the single-rank bits; shards DeepSpeed does not describe are
refused by name when SR is attached."""

import importlib.util
import json
import os

import pytest
import torch

from dist_sr import stochastic_round
from tests.dist_utils import run_workers

deepspeed = pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

SEED, STEPS = 1234, 2
# DeepSpeed 0.19.8 describes each AutoTP shard's place in its parameter (an affine map); older ones do not
DESCRIBED = importlib.util.find_spec("deepspeed.checkpoint.affine") is not None


def tp_model():
    """A Qwen2 with 4 KV heads (AutoTP splits at most by that) and an MLP width (41) that every TP
    size here splits unevenly."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=41,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=16,
        initializer_range=0.25,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def engine_for(tp: int, stage: int):
    from dist_sr.engines import deepspeed as dsr

    model = tp_model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10_000,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "stochastic_rounding": {"enabled": True, "seed": SEED, "mode": "stochastic"},
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def full_tensors(engine, tp: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (full BF16 working weight, full FP32 master)}``: each TP shard concatenated with the
    other TP ranks' along the dim DeepSpeed split it on (collective)."""
    from deepspeed.utils import groups, safe_get_full_fp32_param

    from dist_sr.engines.deepspeed.tp import META
    from dist_sr.numerics.key import normalize_param_name

    out = {}
    for name, p in engine.module.named_parameters():
        local = (p.data.clone(), safe_get_full_fp32_param(p).view(p.shape).clone())
        meta = getattr(p, META, None) or {}
        dim = meta.get("partition_dim")
        if tp > 1 and dim is not None and not meta.get("replicated"):
            shards = [None] * tp
            torch.distributed.all_gather_object(shards, local, group=groups.get_tensor_model_parallel_group())
            local = (torch.cat([s[0] for s in shards], dim), torch.cat([s[1] for s in shards], dim))
        out[normalize_param_name(name)] = local
    return out


def set_fp32_masters(engine, tp: int) -> None:
    """Every rank's FP32 masters set to its share of the FP32 model (DeepSpeed started them from
    the BF16 cast, where SR is exact), and the working weights re-derived from them."""
    from deepspeed.utils import groups, safe_set_full_fp32_param

    from dist_sr.engines.deepspeed.tp import META
    from dist_sr.numerics.key import normalize_param_name

    fp32 = {normalize_param_name(n): p.detach().clone() for n, p in tp_model().named_parameters()}
    for name, p in engine.module.named_parameters():
        full, meta = fp32[normalize_param_name(name)], getattr(p, META, None) or {}
        if tp > 1 and meta.get("partition_dim") is not None and not meta.get("replicated"):
            full = full.split(list(meta["partition_sizes"]), meta["partition_dim"])[
                groups.get_tensor_model_parallel_rank()
            ]
        safe_set_full_fp32_param(p, full)
    engine.dist_sr.resync()


def _tp_worker(rank, world_size, tp, stage, out_dir):
    if tp > 1 and not DESCRIBED:  # a DeepSpeed that does not map its shards: refused before the first step
        from dist_sr.engines.deepspeed.tp import UnsupportedTensorParallel

        with pytest.raises(UnsupportedTensorParallel, match=r"q_proj.weight \(LinearLayer\).*no affine map"):
            engine_for(tp, stage)
        return
    engine = engine_for(tp, stage)
    set_fp32_masters(engine, tp)
    start = full_tensors(engine, tp)
    assert any(not torch.equal(m, m.bfloat16().float()) for _, m in start.values())  # off the BF16 grid
    for name, (w, master) in start.items():
        expected = stochastic_round(master, seed=SEED, step=0, param=name)
        assert torch.equal(w.view(torch.int16), expected.view(torch.int16)), name
    bits = {n: w.view(torch.int16).tolist() for n, (w, _) in start.items()}
    if tp == 1:  # the reference: one rank, no tensor parallelism, the same FP32 model
        (out_dir / "single.json").write_text(json.dumps(bits))
    else:  # the step-0 rounding of the same masters, split over TP ranks: the single rank's bits
        single = json.loads((out_dir / "single.json").read_text())
        assert set(bits) == set(single)
        assert [n for n in bits if bits[n] != single[n]] == []
    ids = torch.randint(0, 8, (2, 9), generator=torch.Generator().manual_seed(7))
    for _ in range(STEPS):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    for name, (w, master) in full_tensors(engine, tp).items():  # and every step keeps the contract
        expected = stochastic_round(master, seed=SEED, step=STEPS, param=name)
        assert torch.equal(w.view(torch.int16), expected.view(torch.int16)), name


@pytest.mark.slow
@pytest.mark.parametrize("tp,world,stage", [(2, 2, 1), (4, 4, 1), (2, 4, 2)], ids=["tp2", "tp4", "tp2xdp2-zero2"])
def test_tensor_parallel_shards_hold_the_single_rank_bits(tp, world, stage, tmp_path):
    run_workers(_tp_worker, 1, 1, stage, tmp_path)
    run_workers(_tp_worker, world, tp, stage, tmp_path)


def test_a_shard_without_deepspeeds_map_is_refused_by_name():
    from dist_sr.engines.deepspeed.tp import UnsupportedTensorParallel, blocks_of

    with pytest.raises(
        UnsupportedTensorParallel, match=r"model.layers.0.mlp.gate_proj.weight \(GateUpPack_LinearLayer\)"
    ):
        blocks_of("model.layers.0.mlp.gate_proj.weight", torch.zeros(4, 3), "GateUpPack_LinearLayer", 0)


def test_a_shard_holding_a_scaled_copy_is_refused_by_name():
    pytest.importorskip("deepspeed.checkpoint.affine")  # DeepSpeed 0.19.8
    from deepspeed.checkpoint.affine import replicated_map

    from dist_sr.engines.deepspeed.tp import META, UnsupportedTensorParallel, blocks_of

    bias = torch.zeros(6)
    setattr(bias, META, {"conversion": {"affine_map": replicated_map((6,), 2, scale=0.5).to_dict()}})
    with pytest.raises(UnsupportedTensorParallel, match=r"o_proj.bias \(LinearAllreduce\).*scaled by 0.5"):
        blocks_of("o_proj.bias", bias, "LinearAllreduce", 1)


def test_row_and_column_shards_become_row_blocks():
    pytest.importorskip("deepspeed.checkpoint.affine")  # DeepSpeed 0.19.8
    from deepspeed.checkpoint.affine import ParamAffineMap, contiguous_split_map

    from dist_sr.engines.deepspeed.tp import row_block
    from dist_sr.numerics.shards import RowBlock

    for dim, rank, expected in [(0, 1, RowBlock(0, 1, 4 * 7, 3 * 7, 4 * 7)), (1, 1, RowBlock(0, 5, 3, 4, 7))]:
        sizes = [3, 4] if dim == 0 else [4, 3]
        shape = (7, 7) if dim == 0 else (5, 7)
        m = ParamAffineMap.from_dict(contiguous_split_map(shape, sizes, dim).to_dict())
        (piece,) = m.pieces_by_rank[rank]
        got = row_block(piece.shape, piece.source_offset, piece.source_strides, piece.dest_offset, piece.dest_strides)
        assert got == expected


def _untested_stage_worker(rank, world_size, stage):
    from dist_sr.engines.deepspeed import UnsupportedDeepSpeed

    with pytest.raises(UnsupportedDeepSpeed, match=rf'"autotp_size": 2}} with ZeRO stage {stage}: .*"stage": 1'):
        engine_for(2, stage)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0])
def test_tensor_parallelism_at_an_untested_zero_stage_is_refused_by_name(stage):
    run_workers(_untested_stage_worker, 2, stage)
