"""Sync plans: JSON round trips, and every tensor tiled exactly once by its spans."""

import pytest

from dist_sr.weightsync.plan import Bucket, Span, SyncPlan, TensorPlan, make_buckets


def test_plans_round_trip_through_json_and_must_tile_every_tensor():
    tensors = [
        TensorPlan("w", "bfloat16", (4, 5), [Span(0, 0, 10), Span(1, 10, 20)]),
        TensorPlan("b", "float32", (3,), [Span(1, 0, 3)]),
    ]
    plan = SyncPlan(7, 2, make_buckets(tensors, bucket_bytes=40))
    assert [[t.name for t in b.tensors] for b in plan.buckets] == [["w"], ["b"]]
    assert plan.buckets[0].nbytes(0) == 20 and plan.buckets[0].nbytes(1) == 20 and plan.buckets[1].nbytes(1) == 12
    again = SyncPlan.from_json(plan.to_json())
    assert again == plan
    again.check()
    for bad in (
        [Span(0, 0, 10), Span(1, 11, 20)],
        [Span(0, 0, 10)],
        [Span(0, 0, 12), Span(1, 10, 20)],
        [Span(2, 0, 20)],
    ):
        with pytest.raises(ValueError, match="sync plan"):
            SyncPlan(1, 2, [Bucket([TensorPlan("w", "bfloat16", (4, 5), bad)])]).check()
