"""The layout-free digest: sums that add up over any split, and see every wrong byte."""

import random

import pytest
import torch

from dist_sr.numerics import digest
from dist_sr.numerics.digest import combine, piece_sum, tensor_sums


def _random_split(numel, parts, rng):
    cuts = sorted(rng.sample(range(1, numel), parts - 1))
    return list(zip([0] + cuts, cuts + [numel]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shard_sums_add_up_to_the_full_tensors_digest_for_any_split(dtype):
    rng = random.Random(0)
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    full = piece_sum(x, 0)
    flat = x.reshape(-1)
    for parts in (2, 3, 7):
        ranges = _random_split(flat.numel(), parts, rng)
        assert sum(piece_sum(flat[s:e], s) for s, e in ranges) % 2**64 == full


def test_the_digest_sees_one_flipped_bit_a_swap_and_a_misplaced_piece():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    base = piece_sum(x, 0)
    flipped = x.clone()
    flipped.view(torch.int16)[123] ^= 1
    swapped = x.clone()
    swapped[[5, 6]] = x[[6, 5]]
    assert x[5] != x[6]
    assert piece_sum(flipped, 0) != base and piece_sum(swapped, 0) != base
    assert piece_sum(x[:2048], 0) + piece_sum(x[2048:], 1) != base  # a piece sent with the wrong offset
    named = {"a": x, "b": x[:10]}
    assert combine(tensor_sums(named)) == combine(dict(reversed(list(tensor_sums(named).items()))))
    assert combine(tensor_sums(named)) != combine(tensor_sums({"a": x, "b": x[:10].reshape(2, 5)}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.uint8, torch.int8])
@pytest.mark.parametrize("host", ["native", "torch"])
def test_every_host_path_sums_exactly_what_the_definition_sums(dtype, host):
    """The compiled library the wheel ships and the chunked torch path (where it is not built)
    agree bit for bit with the term-by-term definition: on negative words (sign extension), any
    start (past 2^63 included), lengths around the vector widths, the thread split and the chunk."""
    g = torch.Generator().manual_seed(5)
    for n in (0, 1, 31, 33, 1000, digest.CHUNK + 7, (1 << 21) + 5):
        x = (torch.randn(n, generator=g) * 100).to(dtype)
        for start in (0, 5, 2**40 + 3, 2**63 + 11):
            expected = digest.piece_sum_reference(x, start)
            assert digest.piece_sums([(x, start)], host=host) == [expected], (n, start)


@pytest.mark.parametrize("host", ["native", "torch"])
def test_rows_of_a_strided_view_sum_as_their_rows_would_one_by_one(host):
    """A 2-D piece (rows of a strided view, row r holding elements ``start + r * step + j``): what
    a read-back digests a tensor-parallel slice with, without copying it."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(300, 2 * digest.CHUNK // 300 + 700, generator=g) * 100).to(torch.bfloat16)
    for r0, r1, c0, c1 in [(0, 300, 0, x.shape[1]), (5, 290, 10, 600), (0, 1, 3, 700), (7, 8, 0, 5), (3, 3, 0, 5)]:
        view = x[r0:r1, c0:c1]
        start, step = 2**40 + 1, 10_000
        rows = [digest.piece_sum_reference(view[r], start + r * step) for r in range(view.shape[0])]
        assert digest.piece_sums([(view, start, step)], host=host) == [sum(rows) % 2**64]


def test_this_install_digests_host_tensors_with_the_compiled_library():
    """Every install CI makes (editable and wheel) builds ``dist_sr.numerics.digest_c``: no process
    digests at torch speed because a kernel was not built yet."""
    assert digest.backend() == "native"


def _pieces():
    g = torch.Generator().manual_seed(7)
    return [
        ((torch.randn(n, generator=g) * 100).to(dtype), start)
        for n, dtype, start in (
            (0, torch.bfloat16, 3),
            (1, torch.float32, 0),
            (1000, torch.bfloat16, 2**40 + 3),
            ((1 << 19) + 5, torch.float32, 17),
            (33, torch.float16, 5),
        )
    ]


def test_a_buckets_sums_read_back_together_are_each_pieces_sum():
    """``piece_sums`` (what a sync digests each bucket with): the compiled sums on host pieces,
    and the torch path (taken here by asking for it), whose pieces are summed where they live
    and read back once, gives the same sums."""
    pieces = _pieces()
    expected = [piece_sum(x, start) for x, start in pieces]
    assert digest.piece_sums(pieces) == expected
    assert digest.piece_sums(pieces, host="torch") == expected
    assert digest.piece_sums([]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_engine_sums_what_the_cpu_sums():
    """Engines on GPUs digest CUDA tensors (torch path there): same sums as the CPU, and a
    bucket's pieces read back with one synchronisation."""
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn((1 << 20) + 3, generator=g) * 100).to(dtype)
        assert piece_sum(x.cuda(), 2**33 + 1) == piece_sum(x, 2**33 + 1)
    pieces = _pieces()
    on_device = [(x.cuda(), start) for x, start in pieces]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchroniz") as syncs:
            sums = digest.piece_sums(on_device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sums == [piece_sum(x, start) for x, start in pieces]
    assert len([w for w in syncs if "synchroniz" in str(w.message)]) == 1, [str(w.message) for w in syncs]
