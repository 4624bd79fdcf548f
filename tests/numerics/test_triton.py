"""Triton kernels give the reference's bits through every launch path: in Triton's interpreter on
the CPU here, and on a CUDA device where there is one (those cases skip cleanly without a GPU)."""

import os

import numpy as np
import pytest
import torch

from dist_sr import AdamWSR, ShadowAdamW, ShadowOptimizer, stochastic_round
from dist_sr.numerics import RoundingBatch, RoundingJob, reference
from dist_sr.numerics.adamw import AdamWHyper, moment_param
from dist_sr.numerics.fused import AdamWPiece, AdamWPlan
from dist_sr.numerics.key import stream_key, stream_keys
from dist_sr.numerics.reference import adamw_step as adamw_reference_
from tests.conftest import bits16, f32_from_bits

triton = pytest.importorskip("triton")
from dist_sr.numerics.backends.triton import dry_run, sr_launch, tables  # noqa: E402
from dist_sr.numerics.backends.triton import kernels as tk  # noqa: E402
from dist_sr.numerics.backends.triton import launcher as la  # noqa: E402

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need TRITON_INTERPRET=1"
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
# Every launch path is exercised: one tensor (scalar arguments), many aligned tensors (16-byte
# accesses on full blocks) and many misaligned ones (addresses or offsets not multiples of 4).
SIZES = [1, 5, 4095, 4096, 4097, 9000, 0, 77, 3, 8192 + 13]
OFFSETS = [0, 3, 2**33 + 1, 2**40, 0, 17, 0, 1000, 5, 2**32 - 2]


def ref_bits(x, key, offset, rows=None):
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    reference.round_into(x.detach().cpu().contiguous().view(-1), out, key, offset, rows)
    return bits16(out)


def special_values(n, seed):
    """Random bit patterns (every NaN class, Inf, -0, subnormals, max finite among them)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 1 << 32, (n,), generator=g, dtype=torch.int64)
    edge = [
        0x7FC00000,
        0x7F800001,
        0xFFFFFFFF,
        0x7F800000,
        0xFF800000,
        0x80000000,
        0x00000001,
        0x807FFFFF,
        0x7F7FFFFF,
        0xFF7FFFFF,
        0x7F7F8000,
        0x3F808000,
    ]
    bits[: min(n, len(edge))] = torch.tensor(edge[:n])
    return f32_from_bits(bits)


@pytest.mark.parametrize("device", DEVICES)
def test_test_vectors_single_and_batched(vectors, device):
    cases = vectors["cases"]
    for case in cases:
        x = f32_from_bits([int(b, 16) for b in case["x_bits"]]).to(device)
        out = torch.empty(x.numel(), dtype=torch.bfloat16, device=device)
        key = int(case["stream_key"], 16) if case["stream_key"] else None
        sr_launch.round_one(x, out, None if key is None else key - ((key >> 63) << 64), case["offset"])
        assert [f"{b:04x}" for b in bits16(out.cpu()).tolist()] == case["expected_bf16_bits"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keyed", [True, False])
def test_every_upper_half_with_edge_low_halves(device, keyed):
    upper = torch.arange(1 << 16, dtype=torch.int64) << 16
    bits = torch.cat([upper + low for low in (0x0000, 0x0001, 0x7FFF, 0x8000, 0xFFFF)])
    x = f32_from_bits(bits)
    key = stream_key(seed=3, step=4, param="w") if keyed else None
    got = stochastic_round(
        x.to(device),
        seed=3,
        step=4,
        param="w",
        offset=12345,
        mode="stochastic" if keyed else "nearest",
        backend="triton",
    )
    assert torch.equal(bits16(got.cpu()), ref_bits(x, key, 12345))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["stochastic", "dither", "nearest"])
@pytest.mark.parametrize("layout", ["aligned", "misaligned"])
def test_many_tensors_in_one_call_equal_the_reference(device, mode, layout):
    xs = [special_values(n, i) for i, n in enumerate(SIZES)]
    if (
        layout == "misaligned"
    ):  # views at odd element offsets of one buffer: neither 16-byte aligned nor offset % 4 == 0
        buf = torch.cat([torch.zeros(1)] + [torch.cat([x, torch.zeros(3)]) for x in xs]).to(device)
        out_buf = torch.empty(buf.numel() + 1, dtype=torch.bfloat16, device=device)
        starts = np.cumsum([1] + [n + 3 for n in SIZES])[:-1].tolist()
        dev_xs = [buf[s : s + n] for s, n in zip(starts, SIZES)]
        outs = [out_buf[s + 1 : s + 1 + n] for s, n in zip(starts, SIZES)]
        offsets = [o + 1 for o in OFFSETS]
    else:
        dev_xs = [x.to(device) for x in xs]
        outs = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in SIZES]
        offsets = OFFSETS
    jobs = [RoundingJob(f"layer{i}.weight", x, o, off) for i, (x, o, off) in enumerate(zip(dev_xs, outs, offsets))]
    batch = RoundingBatch(jobs, backend="triton")
    for step in (9, 10):  # the same batch again: its cached launch, fresh keys
        batch.run(seed=1, step=step, mode=mode)
        for i, (x, out, off) in enumerate(zip(xs, outs, offsets)):
            key = None if mode == "nearest" else stream_key(seed=1, step=step, param=f"layer{i}.weight", mode=mode)
            assert torch.equal(bits16(out.cpu()), ref_bits(x, key, off)), (i, step)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pieces", ["one", "two and a strided shard"])
def test_a_batch_derives_each_steps_keys_like_the_host(device, pieces):
    # a RoundingBatch on the Triton backend derives keys on the device from the step (one piece:
    # one host hash as a kernel argument; a strided shard: its own launch), at the range's ends too
    w = special_values(40 * 30, 7).view(40, 30)
    xs = [special_values(1000, 8)] + ([special_values(77, 9), w[:, 10:20].contiguous()] if pieces != "one" else [])
    rows = [None, None, (10, 30)]
    offsets = [5, 2**35, 10]
    jobs = [
        RoundingJob(
            f"b.p{i}",
            x.to(device),
            torch.empty(x.shape, dtype=torch.bfloat16, device=device),
            offsets[i],
            None if rows[i] is None else rows[i][1],
        )
        for i, x in enumerate(xs)
    ]
    batch = RoundingBatch(jobs, backend="triton")
    for step in (1, 2**63, 2**64 - 1):
        batch.run(seed=4, step=step)
        for i, (x, job) in enumerate(zip(xs, jobs)):
            key = stream_key(seed=4, step=step, param=f"b.p{i}")
            assert torch.equal(bits16(job.out.cpu()).view(-1), ref_bits(x, key, offsets[i], rows[i])), (i, step)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_column_shard_equals_the_full_parameter_rounding(device):
    w = special_values(37 * 50, 3).view(37, 50)
    full = stochastic_round(w, seed=2, step=5, param="m.w", backend="reference")
    shard = w[:, 20:33].contiguous().to(device)
    got = stochastic_round(shard, seed=2, step=5, param="m.w", offset=20, row_stride=50, backend="triton")
    assert torch.equal(bits16(got.cpu()), bits16(full[:, 20:33].contiguous()))


def fused_case(n, i, pure, moment_bf16, grad_dtype, device):
    g = torch.Generator().manual_seed(100 + i)
    s = torch.randn(n, generator=g)
    s[:3] = torch.tensor([0.0, -0.0, 1e-39])[: min(n, 3)]
    m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6
    grad = torch.randn(n, generator=g).to(grad_dtype)
    if pure:
        p, out = s.to(torch.bfloat16), None
        if moment_bf16:
            m, v = m.to(torch.bfloat16), v.to(torch.bfloat16)
    else:
        p, out = s, torch.empty(n, dtype=torch.bfloat16)
    return [t if t is None else t.to(device) for t in (p, m, v, grad, out)]


def as_bits(t):
    return bits16(t.cpu()) if t.dtype == torch.bfloat16 else t.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flavour", ["shadow", "pure-fp32-moments", "pure-bf16-moments"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["stochastic", "nearest"])
def test_fused_adamw_plan_equals_the_reference(device, flavour, grad_dtype, mode):
    pure, moment_bf16 = flavour != "shadow", flavour == "pure-bf16-moments"
    sizes, offsets = [3000, 1, 2048, 0, 517, 4100, 6], [0, 5, 2**33, 0, 7, 2**32 + 4, 1]
    cases = [fused_case(n, i, pure, moment_bf16, grad_dtype, device) for i, n in enumerate(sizes)]
    want = [[None if t is None else t.detach().cpu().clone() for t in c] for c in cases]
    hypers = [
        AdamWHyper(1e-3 * (i + 1), 0.9, 0.999, 1e-8, 0.01, i + 1, 0.5 if i == 2 else 1.0) for i in range(len(sizes))
    ]
    plan = AdamWPlan(
        [AdamWPiece(f"p{i}", c[0], c[1], c[2], c[4], off) for i, (c, off) in enumerate(zip(cases, offsets))],
        backend="triton",
    )
    for step in (4, 5):
        plan.step_([c[3] for c in cases], hypers, seed=1, step=step, mode=mode)
        for i, (w, off) in enumerate(zip(want, offsets)):
            keys = (
                None
                if mode == "nearest"
                else [
                    stream_key(seed=1, step=step, param=n)
                    for n in (f"p{i}", moment_param(f"p{i}", "exp_avg"), moment_param(f"p{i}", "exp_avg_sq"))
                ]
            )
            adamw_reference_(
                w[0],
                w[1],
                w[2],
                w[3],
                w[4],
                None if keys is None else keys[0],
                off,
                hypers[i],
                None if keys is None else (keys[1], keys[2]),
            )
        for c, w in zip(cases, want):
            for got, exp in zip(c[:3] + c[4:], w[:3] + w[4:]):
                if got is not None:
                    assert torch.equal(as_bits(got), as_bits(exp))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["stochastic", "dither"])
def test_fused_keys_derived_on_the_device_at_the_steps_range_ends(device, mode):
    # the Triton backend derives a step's keys on the device from the uploaded step: the same
    # keys as the host's stream_keys at every step a key may have, 0 and 2^64 - 1 included
    sizes, offsets = [700, 5, 64], [0, 3, 2**40]
    cases = [fused_case(n, i, True, True, torch.bfloat16, device) for i, n in enumerate(sizes)]
    want = [[None if t is None else t.detach().cpu().clone() for t in c] for c in cases]
    h = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
    plan = AdamWPlan(
        [AdamWPiece(f"m.p{i}", c[0], c[1], c[2], None, off) for i, (c, off) in enumerate(zip(cases, offsets))],
        backend="triton",
    )
    for step in (0, 2**63 - 1, 2**63, 2**64 - 1):
        plan.step_([c[3] for c in cases], [h] * len(sizes), seed=2**64 - 3, step=step, mode=mode)
        for i, (w, off) in enumerate(zip(want, offsets)):
            keys = [
                stream_key(seed=2**64 - 3, step=step, param=n, mode=mode)
                for n in (f"m.p{i}", moment_param(f"m.p{i}", "exp_avg"), moment_param(f"m.p{i}", "exp_avg_sq"))
            ]
            adamw_reference_(w[0], w[1], w[2], w[3], None, keys[0], off, h, (keys[1], keys[2]))
        for c, w in zip(cases, want):
            for got, exp in zip(c[:3], w[:3]):
                assert torch.equal(as_bits(got), as_bits(exp)), step


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adamw_on_misaligned_views_and_a_device_grad_scale(device):
    n, k = 5000, 3
    buf = [torch.randn(n + k, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    buf[2] = buf[2].abs() * 1e-6
    grad = torch.randn(n + k).to(torch.bfloat16)
    want = [b[k:].clone() for b in buf]
    want_out = torch.empty(n, dtype=torch.bfloat16)
    scale = torch.tensor([0.25])
    h = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 3)
    key = stream_key(seed=2, step=7, param="w")
    adamw_reference_(*want, grad[k:], want_out, key, 1, h, grad_scale=scale)
    dev = [b.to(device)[k:] for b in buf]
    out = torch.empty(n + 1, dtype=torch.bfloat16, device=device)[1:]
    plan = AdamWPlan([AdamWPiece("w", dev[0], dev[1], dev[2], out, 1)], backend="triton")
    plan.step_([grad.to(device)[k:]], [h], seed=2, step=7, grad_scale=scale.to(device))
    for got, exp in zip(dev, want):
        assert torch.equal(got.cpu(), exp)
    assert torch.equal(bits16(out.cpu()), bits16(want_out))


# ---- the launch path's host work -----------------------------------------------------------------


def test_the_host_table_does_not_grow_with_the_elements():
    # 290 tensors (the shapes of a Qwen2.5-0.5B's parameter list) of 10^3 or 10^8 elements: the
    # arrays the host builds and uploads have the same size; only numbers inside them differ
    count = 290
    shapes = {}
    for n in (10**3, 10**8):
        ns, g0 = [n] * count, [0] * count
        fields = [list(range(0, 16 * count, 16)), list(range(0, 16 * count, 16)), ns, g0]
        meta, starts = tables.table_arrays(fields, ns, g0, la.SR_BLOCK, aligned=True)
        shapes[n] = (meta.shape, starts.shape)
        assert starts[-1] == count * -(-n // la.SR_BLOCK)  # the grid is a number, not a table
    assert shapes[10**3] == shapes[10**8] == ((4, count), (count + 1,))


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every torch operator a block runs (allocations and views included)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_public_call_is_one_direct_launch_with_raw_addresses():
    # after a specialization's first (JIT) call, stochastic_round launches the compiled kernel
    # with raw addresses: no tensor operator at all when out is given, one allocation when not
    n = 1000
    x, out = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    with dry_run.dry_run() as record:
        stochastic_round(x, seed=3, step=1, param="m.w", out=out, backend="triton")
        with _Ops() as given:
            stochastic_round(x, seed=3, step=2, param="m.w", out=out, backend="triton")
        with _Ops() as allocated:
            y = stochastic_round(x, seed=3, step=3, param="m.w", backend="triton")
    assert record.jit == ["sr_one_kernel"]
    assert given.ops == [] and allocated.ops == [torch.ops.aten.empty.memory_format]
    (_, _, _), (_, grid2, args2), (_, grid3, args3) = record.launches
    key = stream_key(seed=3, step=2, param="m.w")
    assert args2[:5] == (x.data_ptr(), out.data_ptr(), n, 0, key - ((key >> 63) << 64))
    assert args3[:2] == (x.data_ptr(), y.data_ptr()) and all(type(a) in (int, bool) for a in args2 + args3)
    assert grid2 == grid3 == -(-n // la.SR_BLOCK)


@pytest.mark.parametrize("layout", ["misaligned offset", "misaligned address", "beyond 2^31"])
def test_each_specialization_compiles_once(layout):
    # Triton's specialization (16-byte alignment of each pointer, width of each integer) picks
    # the compiled kernel: a new one is compiled once, then launched directly
    n = 300
    x, out = torch.randn(n + 1), torch.empty(n + 1, dtype=torch.bfloat16)
    offset = {"misaligned offset": 5, "misaligned address": 0, "beyond 2^31": 2**33 + 4}[layout]
    xs = x[1:] if layout == "misaligned address" else x[:n]
    with dry_run.dry_run() as record:
        stochastic_round(x[:n], seed=1, step=1, param="w", out=out[:n], backend="triton")
        for step in (2, 3):
            stochastic_round(xs, seed=1, step=step, param="w", offset=offset, out=out[:n], backend="triton")
    assert record.jit == ["sr_one_kernel", "sr_one_kernel"] and len(record.launches) == 3
    shift = offset % 4 if layout != "beyond 2^31" and layout != "misaligned address" else 0
    aligned = layout == "beyond 2^31"
    for _, grid, args in record.launches[1:]:
        assert args[3] == offset and args[6] is aligned and grid == -(-(n + shift) // la.SR_BLOCK)


def test_a_direct_launch_passes_the_arguments_the_jit_launch_passed():
    # after a specialization's first (JIT) launch, Launcher launches the compiled kernel itself with
    # the kernel's full argument list: every positional argument in its place (tensors as raw
    # addresses) and the keyword constants filled in, whatever order the call site gave them in
    t = [torch.zeros(8, dtype=torch.int64) for _ in range(6)]
    kw = dict(
        BLOCK=1024, MOMENT_BF16=True, PURE=False, GRAD_BF16=True, ALIGNED=True, KEYED=True
    )  # not in signature order
    with dry_run.dry_run() as record:
        for _ in range(3):
            la.launcher(tk.adamw_many_kernel)(7, *t, 290, num_warps=4, **kw)
    assert record.jit == ["adamw_many_kernel"] and len(record.launches) == 3
    (_, g0, jit_args), (_, g1, direct), (_, g2, again) = record.launches
    want = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in jit_args)
    assert g0 == g1 == g2 == 7 and direct == again
    assert tuple(direct) == want == (*(x.data_ptr() for x in t), 290, True, True, True, False, True, 1024)
    # other constants are another specialization: compiled (through the JIT) before a direct launch
    with dry_run.dry_run() as record:
        for keyed in (True, False, False):
            la.launcher(tk.adamw_many_kernel)(7, *t, 290, num_warps=4, **{**kw, "KEYED": keyed})
    assert record.jit == ["adamw_many_kernel"] * 2 and [a[-6] for _, _, a in record.launches] == [True, False, False]


def _count_uploads(monkeypatch):
    calls = []
    real = tables.upload

    def counting(array, device):
        calls.append(array.nbytes)
        return real(array, device)

    monkeypatch.setattr(tables, "upload", counting)
    return calls


class _ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every read of a tensor value into Python (.item(), float(t), bool(t), ...): on a
    GPU each one is a host-device round trip."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "optimizer", ["ShadowAdamW", "ShadowOptimizer", "ShadowOptimizer-skip", "AdamWSR-bf16", "AdamWSR-fp32"]
)
def test_a_step_uploads_once_and_reads_nothing_back(device, optimizer, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).to(device=device, dtype=torch.bfloat16)
    params = list(model.named_parameters())
    if optimizer == "ShadowAdamW":
        opt = ShadowAdamW(params, lr=1e-3, seed=1, backend="triton")
    elif optimizer.startswith("ShadowOptimizer"):
        # skipping non-finite steps (the default) costs one scalar read per step: measured below
        opt = ShadowOptimizer(
            params,
            torch.optim.AdamW,
            lr=1e-3,
            seed=1,
            backend="triton",
            fused=True,
            skip_nonfinite=optimizer.endswith("skip"),
        )
    else:
        opt = AdamWSR(params, lr=1e-3, seed=1, moment_dtype=optimizer[-4:], backend="triton")
    x = torch.randn(8, 64, device=device, dtype=torch.bfloat16)

    def step():
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        if optimizer == "ShadowAdamW":
            opt.clip_grad_norm_(0.01)  # the scale stays on the device
        opt.step()

    step()  # builds the plan (and the moments) once
    uploads = _count_uploads(monkeypatch)
    with _ScalarReads() as mode:
        step()
        step()
    # nothing read back; with non-finite skipping on, exactly the one flag per step
    assert len(mode.reads) == (2 if optimizer.endswith("skip") else 0), mode.reads
    assert len(uploads) == 2  # one small upload per step: keys, gradient addresses, constants
    assert max(uploads) <= 8 * 8 * len(params) + 4 * 8 * 2  # O(tensors) bytes, independent of elements


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["ShadowAdamW", "AdamWSR-bf16", "AdamWSR-fp32"])
def test_irregular_steps_through_the_array_host_path_equal_the_reference(device, optimizer):
    # the step's host work runs in array passes; the irregular cases must still give each
    # parameter the reference AdamW of its own group and its own Adam step: a parameter without
    # a gradient (skipped; its Adam step falls behind the others' in its group), a non-contiguous
    # gradient (read by value), two param groups with their own learning rates
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8)).to(device=device, dtype=torch.bfloat16)
    named = list(model.named_parameters())
    lrs = [1e-2, 1e-2, 3e-3, 3e-3]
    groups = [{"params": named[:2], "lr": lrs[0]}, {"params": named[2:], "lr": lrs[2]}]
    pure, moment_bf16 = optimizer != "ShadowAdamW", optimizer == "AdamWSR-bf16"
    opt = (
        ShadowAdamW(groups, seed=9, backend="triton")
        if not pure
        else AdamWSR(groups, seed=9, moment_dtype=optimizer[-4:], backend="triton")
    )
    mdt = torch.bfloat16 if moment_bf16 else torch.float32
    want = [
        {
            "p": p.detach().cpu().clone() if pure else p.detach().cpu().float(),
            "out": p.detach().cpu().clone(),
            "m": torch.zeros(p.numel(), dtype=mdt),
            "v": torch.zeros(p.numel(), dtype=mdt),
            "t": 0,
        }
        for _, p in named
    ]
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(4)).to(device=device, dtype=torch.bfloat16)
    for step in range(1, 5):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        if step == 2:
            model[0].bias.grad = None  # no gradient: skipped, its Adam step stays behind
        if step == 3:  # the same values, laid out column-major
            w = model[1].weight
            w.grad = w.grad.t().contiguous().t()
            assert not w.grad.is_contiguous()
        for (name, p), lr, st in zip(named, lrs, want):
            if p.grad is None:
                continue
            st["t"] += 1
            keys = [
                stream_key(seed=9, step=step, param=n)
                for n in (name, moment_param(name, "exp_avg"), moment_param(name, "exp_avg_sq"))
            ]
            h = AdamWHyper(lr, 0.9, 0.999, 1e-8, 0.01, st["t"])
            flat = st["p"].view(-1)
            adamw_reference_(
                flat,
                st["m"],
                st["v"],
                p.grad.detach().cpu().reshape(-1),
                None if pure else st["out"].view(-1),
                keys[0],
                0,
                h,
                (keys[1], keys[2]) if moment_bf16 else None,
            )
        opt.step()
    states = opt.state_dict()
    states = (states["inner"] if not pure else states)["state"]
    assert [float(st["step"]) for st in states.values()] == [4.0, 3.0, 4.0, 4.0]
    for (name, p), st, saved in zip(named, want, states.values()):
        assert torch.equal(bits16(p.data.cpu()), bits16(st["p"] if pure else st["out"])), name
        for k in ("m", "v"):
            got = saved["exp_avg" if k == "m" else "exp_avg_sq"].cpu().reshape(-1)
            assert torch.equal(as_bits(got), as_bits(st[k])), (name, k)


# ---- CUDA only ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_use_triton_and_match_the_cpu():
    x = torch.randn(1 << 22)
    gpu = stochastic_round(x.cuda(), seed=7, step=3, param="model.w", offset=11)
    cpu = stochastic_round(x, seed=7, step=3, param="model.w", offset=11)
    assert torch.equal(bits16(gpu.cpu()), bits16(cpu))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("mode", ["stochastic", "dither", "nearest"])
def test_cuda_direct_launches_match_the_cpu(mode):
    # every specialization twice: the first call goes through Triton's JIT, the second is the
    # direct launch with raw addresses that every later call takes
    buf = special_values(70001, 11)
    for shift, offset, shape in [
        (0, 0, (70000,)),
        (1, 0, (70000,)),
        (0, 3, (70000,)),
        (0, 2**33 + 1, (70000,)),
        (0, 8, (350, 200)),
        (3, 2**40, (7, 10000)),
    ]:
        x = buf[shift : shift + 70000].view(shape)
        want = stochastic_round(x, seed=5, step=9, param="m.w", offset=offset, mode=mode, backend="reference")
        dev = buf.cuda()[shift : shift + 70000].view(shape)
        for _ in range(2):
            got = stochastic_round(dev, seed=5, step=9, param="m.w", offset=offset, mode=mode)
            assert torch.equal(bits16(got.cpu()), bits16(want)), (shift, offset, shape)


def _twin_models(device):
    from torch import nn

    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16)).to(torch.bfloat16)
    gpu_model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16)).to(torch.bfloat16).to(device)
    gpu_model.load_state_dict(cpu_model.state_dict())
    return cpu_model, gpu_model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("optimizer", ["ShadowAdamW", "ShadowOptimizer", "AdamWSR-bf16", "AdamWSR-fp32"])
def test_optimizers_on_cuda_match_the_cpu_bitwise(optimizer):
    cpu_model, gpu_model = _twin_models("cuda")

    def make(model):
        if optimizer == "ShadowAdamW":
            return ShadowAdamW(model.named_parameters(), lr=1e-3, seed=5)
        if optimizer == "ShadowOptimizer":  # compare the rounding: SGD at lr 2^-7 is exact on any device
            return ShadowOptimizer(model.named_parameters(), torch.optim.SGD, lr=2**-7, seed=5)
        return AdamWSR(model.named_parameters(), lr=1e-3, seed=5, moment_dtype=optimizer[-4:])

    opts = [make(m) for m in (cpu_model, gpu_model)]
    x = torch.randn(32, 256).to(torch.bfloat16)
    for _ in range(3):
        for model, opt, inp in ((cpu_model, opts[0], x), (gpu_model, opts[1], x.cuda())):
            opt.zero_grad()
            model(inp).float().pow(2).mean().backward()
        for pc, pg in zip(cpu_model.parameters(), gpu_model.parameters()):
            pg.grad.copy_(pc.grad)  # identical gradients: only the optimizer's arithmetic is compared
        for opt in opts:
            opt.step()
    for pc, pg in zip(cpu_model.parameters(), gpu_model.parameters()):
        assert torch.equal(bits16(pc.data), bits16(pg.data.cpu()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("optimizer", ["ShadowAdamW", "ShadowOptimizer", "AdamWSR-bf16", "AdamWSR-fp32"])
def test_cuda_step_never_synchronises(optimizer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)]).cuda().to(torch.bfloat16)
    if optimizer == "ShadowAdamW":
        opt = ShadowAdamW(model.named_parameters(), lr=1e-3, seed=1)
    elif optimizer == "ShadowOptimizer":
        # non-finite skipping reads one flag per step (tests/numerics: test_a_step_uploads_once...)
        opt = ShadowOptimizer(
            model.named_parameters(), torch.optim.AdamW, lr=1e-3, seed=1, fused=True, skip_nonfinite=False
        )
    else:
        opt = AdamWSR(model.named_parameters(), lr=1e-3, seed=1, moment_dtype=optimizer[-4:])
    x = torch.randn(16, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # plans, moments and kernels built outside the checked steps
        model(x).float().pow(2).mean().backward()
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            if optimizer == "ShadowAdamW":
                opt.clip_grad_norm_(1.0)
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_shadow_adamw_step_captures_in_a_cuda_graph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)]).cuda().to(torch.bfloat16)
    opt = ShadowAdamW(model.named_parameters(), lr=1e-3, seed=1)
    x = torch.randn(16, 128, device="cuda", dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()  # warm-up on a side stream, as torch's graph recipe asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    graph.replay()
    torch.cuda.synchronize()
    for _, _p, s in opt.named_shadows():
        assert torch.isfinite(s).all()


# ---- steps derived on the device (capturable) ----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["stochastic", "dither"])
def test_keys_and_constants_derived_on_the_device_equal_the_hosts(device, mode):
    from dist_sr.numerics.adamw import constants as _constants

    names = ["w", "model.layers.0.mlp.down_proj.weight", "x" * 97, "y" * 98, "z" * 99, "q" * 300, "a.b#exp_avg_sq"]
    tmpl = tables.KeyTemplates(names, seed=1234, mode=mode, device=torch.device(device))
    hypers = [AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 1), AdamWHyper(3e-6, 0.8, 0.95, 1e-6, 0.1, 1)]
    hyper = torch.tensor(
        [[h.lr, h.beta1, h.beta2, h.eps, h.weight_decay] for h in hypers], dtype=torch.float64, device=device
    )
    for step in (1, 2, 77, 10**6, 2**40 + 5):
        counter = torch.tensor([step - 1], dtype=torch.int64, device=device)
        keys = torch.empty(len(names), dtype=torch.int64, device=device)
        consts = torch.empty(16, dtype=torch.float32, device=device)
        tmpl.run(counter, keys, hyper, consts, 2)
        assert keys.cpu().numpy().tolist() == stream_keys(names, seed=1234, step=step, mode=mode).tolist(), step
        for k, h in enumerate(hypers):
            host = torch.tensor(
                _constants(AdamWHyper(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, step)), dtype=torch.float32
            )
            assert torch.equal(consts.cpu()[8 * k : 8 * k + 7], host[:7]), (step, k)


def _capturable_pair(kind, device):
    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 5)).to(device=device, dtype=torch.bfloat16)
        for _ in range(2)
    ]
    models[1].load_state_dict(models[0].state_dict())
    opts = []
    for capturable, m in zip((False, True), models):
        kw = dict(seed=9, backend="triton", capturable=capturable)
        if kind == "ShadowAdamW":
            opts.append(ShadowAdamW(m.named_parameters(), lr=1e-2, weight_decay=0.1, **kw))
        elif kind == "ShadowOptimizer":
            opts.append(ShadowOptimizer(m.named_parameters(), torch.optim.SGD, lr=1e-2, momentum=0.9, **kw))
        else:
            opts.append(AdamWSR(m.named_parameters(), lr=1e-2, moment_dtype=kind[-4:], **kw))
    return models, opts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["ShadowAdamW", "ShadowOptimizer", "AdamWSR-fp32", "AdamWSR-bf16"])
def test_capturable_steps_equal_plain_steps_bitwise(device, kind):
    models, opts = _capturable_pair(kind, device)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in models[0].parameters()]
        for m, opt in zip(models, opts):
            for p, grad in zip(m.parameters(), grads):
                p.grad = grad.to(device)
            if kind == "ShadowAdamW":
                opt.clip_grad_norm_(0.5)
            opt.step()
    assert opts[1].step_count == opts[0].step_count == 3
    for pa, pb in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(bits16(pa.data.cpu()), bits16(pb.data.cpu()))
    sa, sb = opts[0].state_dict(), opts[1].state_dict()
    flat = lambda sd: [v for v in torch.utils._pytree.tree_leaves(sd) if isinstance(v, torch.Tensor)]  # noqa: E731
    for a, b in zip(flat(sa), flat(sb)):
        assert torch.equal(a.cpu().float(), b.cpu().float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", ["ShadowAdamW", "ShadowOptimizer", "AdamWSR-bf16"])
def test_a_step_replayed_from_a_cuda_graph_equals_eager_steps(kind):
    models, opts = _capturable_pair(kind, "cuda")
    static = [torch.randn(p.shape, device="cuda").to(torch.bfloat16) for p in models[0].parameters()]
    for m in models:
        for p, grad in zip(m.parameters(), static):
            p.grad = grad.clone()
    opts[0].step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opts[1].step()  # the first step builds plans and state outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opts[1].step()
    for _ in range(4):  # the capture itself ran no step; each replay is one
        graph.replay()
        opts[0].step()
    torch.cuda.synchronize()
    assert opts[1].step_count == opts[0].step_count == 5
    for pa, pb in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(bits16(pa.data.cpu()), bits16(pb.data.cpu()))
