"""``rollout_weights`` / ``rollout_shards`` / ``export_bf16``: what any exporter hands a rollout
engine is the trainer's forward weights, bitwise, from every training setup (real FSDP2 and
DeepSpeed over gloo)."""

import gc
import os

import pytest
import torch

import dist_sr
from dist_sr import export_bf16, rollout_shards, rollout_weights, stochastic_round
from dist_sr.numerics import live
from tests.dist_utils import run_workers
from tests.engines.models import tiny_qwen2

SEED, STEPS = 4321, 2


def bits(t):
    return t.contiguous().view(torch.int16)


def assert_announced(obj, exported: dict):
    """``rollout_metadata`` announces, without gathering, exactly what ``rollout_weights`` yields."""
    from dist_sr.numerics.digest import dtype_name
    from dist_sr.weightsync.trainer.export import rollout_metadata

    assert [tuple(m) for m in rollout_metadata(obj)] == [
        (n, dtype_name(t.dtype), tuple(t.shape)) for n, t in exported.items()
    ]


def assert_same(got: dict, expected: dict):
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert got[name].dtype == torch.bfloat16 and torch.equal(bits(got[name]), bits(expected[name])), name


def _fsdp2_worker(rank, world_size):
    from dist_sr.engines import fsdp2
    from tests.engines.test_fsdp2 import SEED as SEED_FSDP2
    from tests.engines.test_fsdp2 import build, capture_working, train

    model, ctx, opt = build(world_size)
    train(model, opt, STEPS)
    masters = fsdp2.full_master(model)
    expected = {n: stochastic_round(m, seed=SEED_FSDP2, step=STEPS, param=n) for n, m in masters.items()}
    assert_same(dict(rollout_weights(model)), expected)  # every rank gets every full tensor
    assert_announced(model, dict(rollout_weights(model)))
    assert_same(capture_working(model), expected)  # ... which is what the forward pass used
    # an exporter that gathers FP32 masters itself (param.full_tensor(), as TRL/verl do) and
    # calls export_bf16 instead of .to(bfloat16) ships the same bits; the RTN cast would not
    assert_same({n: export_bf16(n, m) for n, m in masters.items()}, expected)
    rtn_diff = sum(int((bits(m.to(torch.bfloat16)) != bits(expected[n])).sum()) for n, m in masters.items())
    assert rtn_diff > 0.05 * sum(m.numel() for m in masters.values())
    # shard-direct: this rank's pieces at their global offsets; all ranks' pieces cover each tensor once
    pieces = [(p.name, p.start, p.end, p.bits.clone()) for p in rollout_shards(model)]
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, pieces)
    for name, full in expected.items():
        flat = torch.zeros(full.numel(), dtype=torch.int16)
        covered = torch.zeros(full.numel(), dtype=torch.int32)
        for n, start, end, b in (p for ps in everyone for p in ps):
            if n == name:
                flat[start:end] = b.view(torch.int16)
                covered[start:end] += 1
        assert torch.equal(flat, bits(full).reshape(-1)) and bool((covered == 1).all()), name


@pytest.mark.slow
def test_fsdp2_rollout_weights_and_export_are_the_forward_bits():
    run_workers(_fsdp2_worker, 2)


def _deepspeed_worker(rank, world_size, stage):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from tests.engines.test_deepspeed import SEED as DS_SEED
    from tests.engines.test_deepspeed import engine_for, train, working_and_master

    engine = engine_for(f"zero{stage}")
    train(engine, STEPS)
    state = working_and_master(engine)
    expected = {n: stochastic_round(m, seed=DS_SEED, step=STEPS, param=n) for n, (_, m) in state.items()}
    assert_same(dict(rollout_weights(engine)), expected)
    assert_announced(engine, dict(rollout_weights(engine)))
    assert_same({n: export_bf16(n, m) for n, (_, m) in state.items()}, expected)
    pieces = list(rollout_shards(engine))
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, [(p.name, p.start, p.end, p.bits.clone()) for p in pieces])
    for name, full in expected.items():
        flat = torch.zeros(full.numel(), dtype=torch.int16)
        for n, start, end, b in (p for ps in everyone for p in ps):
            if n == name:
                flat[start:end] = b.view(torch.int16)
        assert torch.equal(flat, bits(full).reshape(-1)), name


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_rollout_weights_are_the_keyed_bits_at_every_stage(stage):
    pytest.importorskip("deepspeed")
    run_workers(_deepspeed_worker, 2, stage)


def _tied_frozen_worker(rank, world_size):
    """Tied embeddings (as Qwen2.5-0.5B) and a frozen parameter under FSDP2 with SR."""
    from torch.distributed.fsdp import fully_shard

    from dist_sr.engines import fsdp2
    from tests.engines.test_fsdp2 import capture_working, train

    model = tiny_qwen2(vocab_size=5, tie_word_embeddings=True, initializer_range=0.02)  # Qwen2Config's default range
    model.model.norm.weight.requires_grad_(False)
    ctx = fsdp2.prepare(model, seed=SEED)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, to the one wrapped master
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(model, mp_policy=fsdp2.MIXED_PRECISION)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ctx.track(opt)
    train(model, opt, STEPS)
    masters = fsdp2.full_master(model)
    exported = dict(rollout_weights(model))
    assert_announced(model, exported)  # the tied weight once, the frozen one in its own dtype
    used = capture_working(model)
    assert "lm_head.weight" not in exported and torch.equal(
        bits(used["lm_head.weight"]), bits(used["model.embed_tokens.weight"])
    )
    assert_same(exported, {n: used[n] for n in exported})  # the forward's bits, frozen norm included
    frozen = "model.norm.weight"
    assert torch.equal(bits(exported[frozen]), bits(masters[frozen].to(torch.bfloat16)))  # RTN, as FSDP2 casts it
    # a state_dict exporter sees the alias too: keyed by the tied weight's first name
    embed = masters["model.embed_tokens.weight"]
    assert torch.equal(bits(export_bf16("lm_head.weight", embed)), bits(exported["model.embed_tokens.weight"]))


@pytest.mark.slow
def test_tied_and_frozen_parameters_export_the_forward_bits():
    run_workers(_tied_frozen_worker, 2)


def test_a_zero3_module_without_its_engine_is_refused():
    class Partitioned(torch.nn.Module):  # a ZeRO-3 module passed without its engine
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
            self.w.ds_id = 0

    with pytest.raises(TypeError, match="pass the DeepSpeed engine"):
        list(rollout_weights(Partitioned()))


def test_a_module_with_bf16_working_weights_is_exported_as_it_is():
    model = tiny_qwen2()
    opt = dist_sr.ShadowOptimizer(model.named_parameters(), seed=3, working_dtype=torch.bfloat16, lr=1e-2)
    model(input_ids=torch.tensor([[0, 1, 2]]), labels=torch.tensor([[0, 1, 2]])).loss.backward()
    opt.step()
    got = dict(rollout_weights(model))
    assert_same(got, {n: p.detach() for n, p in model.named_parameters()})
    assert_announced(model, got)


def test_export_refuses_what_it_cannot_round_faithfully():
    from dist_sr.engines import fsdp2

    gc.collect()
    assert not live.owners()
    with pytest.raises(RuntimeError, match="no model trained with SR is live"):
        export_bf16("model.embed_tokens.weight", torch.zeros(3))
    model = tiny_qwen2()
    model.lm_head.weight.requires_grad_(False)
    ctx = fsdp2.prepare(model, seed=9)
    w = torch.randn(3, 24)
    ctx.step = 5
    assert torch.equal(
        bits(export_bf16("module.model.embed_tokens.weight", w)),  # wrapper prefixes removed
        bits(stochastic_round(w, seed=9, step=5, param="model.embed_tokens.weight")),
    )
    assert torch.equal(
        bits(export_bf16("lm_head.weight", w)), bits(w.to(torch.bfloat16))
    )  # frozen: RTN, as the forward
    with pytest.raises(KeyError, match="not the rollout engine's"):
        export_bf16("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(3))
    with pytest.raises(TypeError, match="FP16 is not supported"):
        export_bf16("model.embed_tokens.weight", torch.zeros(3, dtype=torch.float16))
    # a piece of the parameter at its global offset has the bits of the same elements of the whole
    piece = export_bf16("model.embed_tokens.weight", w.reshape(-1)[30:50], offset=30)
    assert torch.equal(bits(piece), bits(export_bf16("model.embed_tokens.weight", w).reshape(-1)[30:50]))
    other = fsdp2.prepare(tiny_qwen2(), seed=10)  # a second SR model with the same names: ambiguous
    with pytest.raises(RuntimeError, match="pass key="):
        export_bf16("model.embed_tokens.weight", w)
    assert torch.equal(
        bits(export_bf16("model.embed_tokens.weight", w, key=other)),
        bits(stochastic_round(w, seed=10, step=0, param="model.embed_tokens.weight")),
    )
    del model, ctx, other
