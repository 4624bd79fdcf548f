"""The device-aware rounding plan (``engines.placement``): rounded where the master lives, copied
to where the working weight lives; a ``meta`` tensor stands for an accelerator on this machine."""

import pytest
import torch

from dist_sr import stochastic_round
from dist_sr.engines.placement import FlatTransfer, PlacedRounding, Route, Segment, gaps
from dist_sr.numerics.shards import RowBlock, Span, spans_in_range

SEED, STEP = 1234, 7


def masters(n=64, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.3


def keyed(x, name, offset=0):
    return stochastic_round(x, seed=SEED, step=STEP, param=name, offset=offset).view(torch.int16)


def two_params():
    """A flat partition holding elements [10, 40) of "a" (50 elements) and [0, 20) of "b", then
    4 elements of padding."""
    src = masters(54)
    segments = [Segment("a", 0, 30, 10), Segment("b", 30, 20, 0)]
    return src, segments


def test_masters_and_weights_on_one_device_are_rounded_in_place():
    src, segments = two_params()
    dest = torch.zeros(54, dtype=torch.bfloat16)
    plan = PlacedRounding([FlatTransfer(src, dest, segments)])
    plan.run(seed=SEED, step=STEP, mode="stochastic")
    assert torch.equal(dest[:30].view(torch.int16), keyed(src[:30], "a", 10))
    assert torch.equal(dest[30:50].view(torch.int16), keyed(src[30:50], "b"))
    assert plan.routes == (Route("a", "cpu", "cpu", "cpu", None), Route("b", "cpu", "cpu", "cpu", None))


def test_weights_on_another_device_are_rounded_beside_the_masters_and_copied_once():
    src, segments = two_params()
    dest = torch.empty(54, dtype=torch.bfloat16, device="meta")  # the accelerator
    plan = PlacedRounding([FlatTransfer(src, dest, segments)], fill_gaps=True)
    (job_a, job_b) = plan.jobs
    assert {job_a.x.device.type, job_a.out.device.type, job_b.out.device.type} == {"cpu"}  # rounded on the host
    plan.run(seed=SEED, step=STEP, mode="stochastic")
    assert [r.working for r in plan.routes] == ["meta", "meta"]
    assert all(r.master == r.rounded_into == "cpu" and r.copied_by == "dist-sr" for r in plan.routes)
    # what went to the device is the staging buffer: the keyed bits, the padding as it is
    (_, stage) = plan._copies[0]
    assert stage.device.type == "cpu" and stage.dtype == torch.bfloat16 and stage.numel() == 54
    assert torch.equal(stage[:30].view(torch.int16), keyed(src[:30], "a", 10))
    assert torch.equal(stage[50:], src[50:].to(torch.bfloat16))


def test_a_staged_plan_delivers_the_bits_of_rounding_in_place():
    src, segments = two_params()
    direct, staged = torch.zeros(54, dtype=torch.bfloat16), torch.zeros(54, dtype=torch.bfloat16)
    PlacedRounding([FlatTransfer(src, direct, segments)], fill_gaps=True).run(seed=SEED, step=STEP, mode="stochastic")
    plan = PlacedRounding([FlatTransfer(src, staged, segments)], fill_gaps=True, stage=True)
    plan.run(seed=SEED, step=STEP, mode="stochastic")
    assert torch.equal(direct.view(torch.int16), staged.view(torch.int16))
    assert all(r.copied_by == "dist-sr" for r in plan.routes)


def test_an_engine_staging_buffer_is_filled_and_left_for_the_engine_to_copy():
    src, segments = two_params()
    dest, buffer = torch.zeros(54, dtype=torch.bfloat16), torch.zeros(54, dtype=torch.bfloat16)
    plan = PlacedRounding([FlatTransfer(src, dest, segments, staging=buffer, copied_by="deepspeed")], fill_gaps=True)
    plan.run(seed=SEED, step=STEP, mode="stochastic", copy=False)
    assert torch.equal(buffer[30:50].view(torch.int16), keyed(src[30:50], "b")) and not dest.any()
    assert all(r.copied_by == "deepspeed" for r in plan.routes)
    plan.copy()
    assert torch.equal(dest.view(torch.int16), buffer.view(torch.int16))


def test_gaps_are_the_elements_no_segment_covers():
    assert gaps([Segment("a", 4, 3, 0), Segment("b", 0, 2, 0)], 10) == [(2, 4), (7, 10)]
    assert gaps([], 3) == [(0, 3)] and gaps([Segment("a", 0, 3, 0)], 3) == []


def test_a_released_plan_holds_no_tensor():
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    src, segments = two_params()
    dest = torch.empty(54, dtype=torch.bfloat16, device="meta")
    plan = PlacedRounding([FlatTransfer(src, dest, segments)])
    plan.run(seed=SEED, step=STEP, mode="stochastic")
    ref = StorageWeakRef(src.untyped_storage())
    del src, segments
    gc.collect()
    assert not ref.expired()  # the plan holds views of the masters
    plan.release()
    gc.collect()
    assert ref.expired()


def test_refuses_pieces_it_cannot_place():
    src = masters(8)
    with pytest.raises(TypeError, match="FP32 into BF16"):
        PlacedRounding([FlatTransfer(src.double(), torch.zeros(8, dtype=torch.bfloat16), [])])
    with pytest.raises(ValueError, match="staging buffer must be BF16"):
        PlacedRounding(
            [FlatTransfer(src, torch.zeros(8, dtype=torch.bfloat16), [], staging=torch.zeros(4, dtype=torch.bfloat16))]
        )


# -- a local shard's elements in the full parameter (tensor parallelism) ---------------------------


def column_shard(rows=5, cols=7, c0=2, c1=5):
    """A row-parallel weight's shard: columns [c0, c1) of a [rows, cols] parameter."""
    return RowBlock(0, rows, c1 - c0, c0, cols)


def global_indices(spans):
    """For each local element of the spans, its index in the full parameter."""
    out = {}
    for s in spans:
        if s.rows is None:
            for k in range(s.numel):
                out[s.start + k] = s.offset + k
        else:
            row_len, stride = s.rows
            for k in range(s.numel):
                r, c = divmod(k, row_len)
                out[s.start + k] = s.offset + r * stride + c
    return out


@pytest.mark.parametrize("start,stop", [(0, 15), (1, 14), (4, 5), (2, 13), (3, 3), (0, 6), (7, 9)])
def test_any_fragment_of_a_column_shard_is_keyed_by_its_index_in_the_full_parameter(start, stop):
    rows, cols, c0, c1 = 5, 7, 2, 5
    full = torch.arange(rows * cols).view(rows, cols)
    shard = full[:, c0:c1].reshape(-1)  # what the shard's element k is, in the full parameter
    spans = spans_in_range([column_shard(rows, cols, c0, c1)], start, stop)
    got = global_indices(spans)
    assert got == {k: int(shard[k]) for k in range(start, stop)}
    assert len(spans) <= 3  # a partial row, whole rows, a partial row


def test_a_leading_dim_shard_is_one_contiguous_span():
    block = RowBlock.contiguous(0, 12, 36)  # a local shard holding elements [36, 48) of its parameter
    assert spans_in_range([block], 2, 9) == [Span(2, 7, 38)]
