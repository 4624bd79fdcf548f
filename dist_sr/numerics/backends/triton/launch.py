"""Host side of the Triton kernels: launches whose host work grows with the number of tensors,
never with the number of elements, and that never wait on the GPU.

- One tensor: the pointers, length, offset and key are kernel arguments; nothing is uploaded.
- Many tensors: an int64 table (pointers, lengths, offsets; ``TensorTable``) is built once per
  tensor set and cached on the device; each call uploads only what changes per step (keys,
  gradient addresses, AdamW constants) in one non-blocking copy from pinned memory, then makes
  one launch per kernel variant (normally one).

Nothing here reads a device value back (no ``.item()``, no ``.tolist()``, no pageable copies),
so a step runs under ``torch.cuda.set_sync_debug_mode("error")`` and can be captured in a CUDA
graph. Under ``TRITON_INTERPRET=1`` the same code runs on CPU tensors (the tests' mode here).
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Iterator, Sequence

import numpy as np
import torch

from ...key import STEP_BYTE, key_message, signed64, stream_key
from ..base import DeviceStep, KeyStep
from . import kernels as tk
from . import keys as triton_keys
from .interpret import interpreting

# Launch shapes (elements per program, warps per program). The bits never depend on them;
# DIST_SR_TRITON_{SR,ADAMW}_{BLOCK,WARPS} override them (bench/triton_tune.py measures the choices).
# The defaults are bench/triton_tune.py's picks on an H200 (2026-11-30): the SR cast at 8192 x 16
# took 0.391 ms at 2^28 elements, as long as the device copy of the same bytes (4096 x 8: 0.448);
# fused AdamW+SR was fastest at 1024 x 4 in both flavours (docs/gpu-check-h200.md).
SR_BLOCK = int(os.environ.get("DIST_SR_TRITON_SR_BLOCK", 8192))
SR_WARPS = int(os.environ.get("DIST_SR_TRITON_SR_WARPS", 16))
ADAMW_BLOCK = int(os.environ.get("DIST_SR_TRITON_ADAMW_BLOCK", 1024))
ADAMW_WARPS = int(os.environ.get("DIST_SR_TRITON_ADAMW_WARPS", 4))
ALIGN_BYTES = 16
_CACHE_SIZE = 256
_DTYPE = attrgetter("dtype")


def check_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    device = tensors[0].device
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run them on the CPU"
        )
    for t in tensors:
        if t.device != device or not t.is_contiguous():
            raise ValueError("Triton kernels need contiguous tensors on one device")
    return device


# Bits must not depend on the compiler contracting a * b + c into one rounding (no FMA), so every
# launch that does floating-point arithmetic passes these options.
FP_OPTIONS = {"enable_fp_fusion": False}


def _fp_options() -> dict:
    return {} if interpreting() else FP_OPTIONS


def current_device() -> int:
    return torch._C._cuda_getDevice()


def raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


_DIRECT = [True]  # False once this Triton's compiled-kernel launch interface turned out different


def run_compiled(kernel, grid: int, device: int, args: Sequence) -> bool:
    """Launch a kernel Triton compiled, on ``device``'s current stream, with every argument as
    its signature lists them (pointers as raw addresses, constexprs included). False, with a
    one-time warning, if this Triton launches compiled kernels differently (the caller then goes
    through the JIT) or ``device`` is not the current device (the kernel is loaded there)."""
    if not _DIRECT[0] or device != current_device():
        return False
    try:
        kernel.run(grid, 1, 1, raw_stream(device), kernel.function, kernel.packed_metadata, None, None, None, *args)
    except Exception as exc:  # another Triton's launcher interface: the JIT path from now on
        import warnings

        warnings.warn(
            f"dist_sr: direct Triton launch unavailable ({exc}); using the JIT launcher", RuntimeWarning, stacklevel=2
        )
        _DIRECT[0] = False
        return False
    return True


class Launcher:
    """Launches a Triton kernel with little host work per call.

    Triton's JIT binds and specializes every argument on every call (tens of microseconds, which
    is most of a small rounding's cost). Here the first call of each specialization goes through
    the JIT (it compiles, caches and launches); later calls launch that compiled kernel directly.
    The specialization is Triton's own rule for these arguments: each pointer's 16-byte alignment
    and each integer's width (every integer parameter is ``do_not_specialize``). Under the
    interpreter, or if this Triton's launch interface is not the one expected, the JIT path is used.
    """

    def __init__(self, fn):
        self.fn = fn
        self.names = list(fn.arg_names)
        self.compiled: dict = {}
        self._orders: dict = {}  # per set of keyword arguments: the compiled call's argument list

    def __call__(self, grid: int, *args, num_warps: int = 4, **kw) -> None:
        if interpreting() or not _DIRECT[0]:
            self.fn[(grid,)](*args, num_warps=num_warps, **kw)
            return
        device = current_device()
        spec = tuple(
            (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else -(1 << 31) <= a < (1 << 31)
            for a in args
        )
        kws = tuple(kw.items())  # a call site passes its keywords in one order: no sorting per call
        key = (spec, device, num_warps, kws)
        kernel = self.compiled.get(key)
        if kernel is None:
            self.compiled[key] = self.fn[(grid,)](*args, num_warps=num_warps, **kw)
            return
        order = self._orders.get(kws)
        if order is None:  # the positional arguments' places among the kernel's, the keywords filled in
            order = self._orders[kws] = (
                [kw.get(n) for n in self.names],
                [i for i, n in enumerate(self.names) if n not in kw],
            )
        full = order[0].copy()
        # raw addresses: the launcher would otherwise call data_ptr() and ask the driver about each
        for i, a in zip(order[1], args):
            full[i] = a.data_ptr() if isinstance(a, torch.Tensor) else a
        if not run_compiled(kernel, grid, device, full):
            self.fn[(grid,)](*args, num_warps=num_warps, **kw)


_LAUNCHERS: dict = {}


def launcher(fn) -> Launcher:
    la = _LAUNCHERS.get(fn)
    if la is None:
        la = _LAUNCHERS[fn] = Launcher(fn)
    return la


@dataclass(frozen=True)
class TensorTable:
    """A multi-tensor launch's fixed part, on the device: ``meta`` (int64, fields x tensors),
    ``bmap`` (each program's tensor and block, expanded on the device from O(T) block counts)
    and the grid."""

    meta: torch.Tensor
    bmap: torch.Tensor
    count: int
    grid: int


def table_arrays(
    fields: Sequence[Sequence[int]], ns: Sequence[int], g0s: Sequence[int], block: int, aligned: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The host arrays of a ``TensorTable``: ``meta`` (len(fields) x T, int64) and ``starts``.

    Their sizes depend on the number of tensors only: a tensor of ``n`` elements is one entry
    whatever ``n`` is (its block count is a number in ``starts``, not a row per block)."""
    meta = np.asarray(fields, dtype=np.int64).reshape(len(fields), len(ns))
    shift = 0 if aligned else np.asarray(g0s, dtype=np.int64) % 4
    blocks = -(-(np.asarray(ns, dtype=np.int64) + shift) // block)
    starts = np.zeros(len(ns) + 1, dtype=np.int64)
    np.cumsum(blocks, out=starts[1:])
    return meta, starts


class _Cache:
    def __init__(self):
        self._tables: OrderedDict = OrderedDict()

    def table(self, signature: tuple, build) -> TensorTable:
        table = self._tables.get(signature)
        if table is None:
            table = build()
            self._tables[signature] = table
            if len(self._tables) > _CACHE_SIZE:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(signature)
        return table

    def clear(self) -> None:
        self._tables.clear()

    def __len__(self) -> int:
        return len(self._tables)


TABLES = _Cache()
# Host buffers captured into a CUDA graph must outlive it: kept here (one per captured upload).
_CAPTURED: list[torch.Tensor] = []


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device``: one non-blocking copy from pinned memory (the caching host
    allocator does not reuse the buffer before the copy has run)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    pinned = host.pin_memory()
    if torch.cuda.is_current_stream_capturing():
        _CAPTURED.append(pinned)
    return pinned.to(device, non_blocking=True)


def _make_table(fields, ns, g0s, block, aligned, device) -> TensorTable:
    meta, starts = table_arrays(fields, ns, g0s, block, aligned)
    both = upload(np.concatenate([meta.reshape(-1), starts]), device)
    grid = int(starts[-1])
    bmap = torch.empty(max(grid, 1), dtype=torch.int64, device=device)
    tk.block_map_kernel[(len(ns),)](both[meta.size :], bmap, CHUNK=1024)
    return TensorTable(both[: meta.size], bmap, len(ns), grid)


def _split_by_alignment(
    count: int, addresses: Sequence[Sequence[int]], g0s: Sequence[int]
) -> list[tuple[bool, list[int]]]:
    """Indices of the aligned pieces and of the others (the second group is usually empty)."""
    flags = [g0s[i] % 4 == 0 and all(a[i] % ALIGN_BYTES == 0 for a in addresses) for i in range(count)]
    groups = [(True, [i for i in range(count) if flags[i]]), (False, [i for i in range(count) if not flags[i]])]
    return [(aligned, idx) for aligned, idx in groups if idx]


# ---- per-step data derived on the device (steps captured in CUDA graphs) -----------------------

KEY_LANES = 64


class KeyTemplates:
    """The key messages of a fixed list of names with the step left zero, on the device
    (``[16 * NB, T]`` little-endian words and each message's length), for ``step_data_kernel``."""

    def __init__(self, names: Sequence[str], seed: int, mode: str, device: torch.device):
        msgs = [key_message(n, seed=seed, step=0, mode=mode) for n in names]
        self.count = len(msgs)
        self.blocks = max(1, max(-(-len(m) // 128) for m in msgs))
        raw = np.zeros((len(msgs), self.blocks * 128), dtype=np.uint8)
        for i, m in enumerate(msgs):
            raw[i, : len(m)] = np.frombuffer(m, dtype=np.uint8)
        words = np.ascontiguousarray(raw.view("<u8").view(np.int64).T)
        sigma = np.asarray(triton_keys.SIGMA, dtype=np.int64).reshape(-1)
        both = upload(
            np.concatenate([words.reshape(-1), np.asarray([len(m) for m in msgs], dtype=np.int64), sigma]), device
        )
        self.words, self.lens = both[: words.size], both[words.size : words.size + len(msgs)]
        self.sigma = both[words.size + len(msgs) :]
        self.stochastic = mode == "stochastic"

    def run(
        self,
        counter: torch.Tensor,
        keys: torch.Tensor,
        hyper: torch.Tensor | None = None,
        consts: torch.Tensor | None = None,
        slots: int = 0,
    ) -> None:
        """Keys of step ``counter + 1`` into ``keys``; with ``hyper`` (float64 ``[slots, 5]``:
        lr, beta1, beta2, eps, weight decay), AdamW's constants of that step into ``consts``."""
        launcher(triton_keys.step_data_kernel)(
            triton_cdiv(self.count, KEY_LANES),
            self.words,
            self.lens,
            self.sigma,
            counter,
            keys,
            self.count,
            keys if hyper is None else hyper,
            keys if consts is None else consts,
            slots,
            self.blocks,
            STEP_BYTE=STEP_BYTE,
            KEYED_STEP=self.stochastic,
            BT=KEY_LANES,
            BS=max(1, 1 << (max(slots, 1) - 1).bit_length()),
            **_fp_options(),
        )


# ---- SR cast -------------------------------------------------------------------------------------

# Compiled one-tensor SR casts by specialization (see ``round_one``).
_ONE: dict[tuple, object] = {}


def round_one(
    x: torch.Tensor, out: torch.Tensor, key: int | None, offset: int, rows: tuple[int, int] | None = None
) -> None:
    """One contiguous FP32 tensor into a contiguous BF16 one of as many elements; ``key`` signed
    64-bit or None (nearest).

    This is every public ``stochastic_round`` call on a GPU, so its host work is kept to what a
    torch operator costs: after the first call of a specialization (the launch shape, the
    device, each pointer's 16-byte alignment, each integer's width: Triton's own rule), the
    compiled kernel is launched directly with raw addresses, no tensor views and no argument
    binding."""
    n = x.numel()
    if n == 0:
        return
    keyed = key is not None
    if rows is not None and keyed:
        check_device([x, out])
        launcher(tk.sr_rows_kernel)(
            triton_cdiv(n, SR_BLOCK),
            x.view(torch.int32),
            out.view(torch.int16),
            n,
            offset,
            key,
            rows[0],
            rows[1],
            KEYED=True,
            BLOCK=SR_BLOCK,
            num_warps=SR_WARPS,
        )
        return
    xp, op = x.data_ptr(), out.data_ptr()
    k = key if keyed else 0
    x16, o16 = xp % ALIGN_BYTES == 0, op % ALIGN_BYTES == 0
    aligned = x16 and o16 and offset % 4 == 0
    block = SR_BLOCK
    device = x.get_device()
    spec = (block, SR_WARPS, device, keyed, aligned, x16, o16, n < 1 << 31, offset < 1 << 31, -(1 << 31) <= k < 1 << 31)
    kernel = _ONE.get(spec)
    grid = -(-(n if aligned else n + offset % 4) // block)
    if (
        kernel is not None
        and out.get_device() == device
        and x.is_contiguous()
        and out.is_contiguous()
        and run_compiled(kernel, grid, device, (xp, op, n, offset, k, keyed, aligned, block))
    ):
        return
    check_device([x, out])
    compiled = tk.sr_one_kernel[(grid,)](
        x.view(torch.int32),
        out.view(torch.int16),
        n,
        offset,
        k,
        KEYED=keyed,
        ALIGNED=aligned,
        BLOCK=SR_BLOCK,
        num_warps=SR_WARPS,
    )
    if not interpreting() and _DIRECT[0]:
        _ONE[spec] = compiled


class SRLaunch:
    """Rounding of a fixed list of flat tensors, ready to run at any key: the tables are built
    (or found in the cache) here; a call uploads the keys and launches, once per alignment group."""

    def __init__(self, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], offsets: Sequence[int]):
        self.live = [i for i, x in enumerate(xs) if x.numel()]
        self.single = None
        self.groups: list[tuple[bool, list[int], TensorTable]] = []
        if len(self.live) == 1:
            i = self.live[0]
            self.single = (xs[i], outs[i], offsets[i], i)
            return
        if not self.live:
            return
        self.device = check_device([xs[i] for i in self.live] + [outs[i] for i in self.live])
        xa = [xs[i].data_ptr() for i in self.live]
        oa = [outs[i].data_ptr() for i in self.live]
        ns = [xs[i].numel() for i in self.live]
        g0 = [offsets[i] for i in self.live]
        for aligned, idx in _split_by_alignment(len(self.live), (xa, oa), g0):
            fields = ([xa[i] for i in idx], [oa[i] for i in idx], [ns[i] for i in idx], [g0[i] for i in idx])
            signature = ("sr", SR_BLOCK, self.device, aligned, *map(tuple, fields))
            table = TABLES.table(
                signature, lambda: _make_table(fields, fields[2], fields[3], SR_BLOCK, aligned, self.device)
            )
            self.groups.append((aligned, [self.live[i] for i in idx], table))

    def __call__(
        self,
        keys: np.ndarray | None,
        device_step: DeviceStep | None = None,
        names: Sequence[str] | None = None,
        key_step: KeyStep | None = None,
    ) -> None:
        """``keys``: int64 stream keys, one per tensor given at construction; None: nearest.
        With ``device_step`` (and the tensors' ``names``) the keys are derived on the device; with
        ``key_step`` (and ``names``) too, from that step, uploaded (``keys`` is then ignored)."""
        if device_step is not None:
            self._run_device(device_step, names)
            return
        if self.single is not None:
            x, out, offset, i = self.single
            if key_step is not None:  # one key: one hash here, passed as a kernel argument
                key = stream_key(seed=key_step.seed, step=key_step.step, param=names[i], mode=key_step.mode)
                round_one(x, out, signed64(key), offset)
                return
            round_one(x, out, None if keys is None else int(keys[i]), offset)
            return
        if key_step is not None:
            counter = upload(np.asarray([key_step.counter()], dtype=np.int64), self.device)
            for aligned, rows, table in self.groups:
                key_dev = torch.empty(len(rows), dtype=torch.int64, device=self.device)
                self._key_templates(rows, names, key_step.seed, key_step.mode).run(counter, key_dev)
                launcher(tk.sr_many_kernel)(
                    table.grid,
                    table.meta,
                    table.bmap,
                    key_dev,
                    table.count,
                    KEYED=True,
                    ALIGNED=aligned,
                    BLOCK=SR_BLOCK,
                    num_warps=SR_WARPS,
                )
            return
        keyed = keys is not None
        for aligned, rows, table in self.groups:
            key_dev = upload(keys[rows], self.device) if keyed else table.meta
            launcher(tk.sr_many_kernel)(
                table.grid,
                table.meta,
                table.bmap,
                key_dev,
                table.count,
                KEYED=keyed,
                ALIGNED=aligned,
                BLOCK=SR_BLOCK,
                num_warps=SR_WARPS,
            )

    def _key_templates(self, rows: list[int], names: Sequence[str], seed: int, mode: str) -> KeyTemplates:
        cache = self.__dict__.setdefault("_eager_templates", {})
        key = (tuple(rows), seed, mode)
        tmpl = cache.get(key)
        if tmpl is None:
            tmpl = cache[key] = KeyTemplates([names[r] for r in rows], seed, mode, self.device)
        return tmpl

    def _run_device(self, step: DeviceStep, names: Sequence[str]) -> None:
        if self.single is not None:  # one table like any other, so the key stays on the device
            x, out, offset, i = self.single
            self.device = x.device
            signature = ("sr", SR_BLOCK, x.device, False, (x.data_ptr(),), (out.data_ptr(),), (x.numel(),), (offset,))
            fields = ([x.data_ptr()], [out.data_ptr()], [x.numel()], [offset])
            self.groups = [
                (
                    False,
                    [i],
                    TABLES.table(
                        signature, lambda: _make_table(fields, fields[2], fields[3], SR_BLOCK, False, x.device)
                    ),
                )
            ]
            self.single = None
        templates = getattr(self, "_templates", None)
        if templates is None:
            templates = self._templates = [
                KeyTemplates([names[r] for r in rows], step.seed, step.mode, self.device) for _, rows, _ in self.groups
            ]
        for (aligned, rows, table), tmpl in zip(self.groups, templates):
            keys = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            tmpl.run(step.counter, keys)
            launcher(tk.sr_many_kernel)(
                table.grid,
                table.meta,
                table.bmap,
                keys,
                table.count,
                KEYED=True,
                ALIGNED=aligned,
                BLOCK=SR_BLOCK,
                num_warps=SR_WARPS,
            )


def round_many(
    xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], keys: np.ndarray | None, offsets: Sequence[int]
) -> None:
    """Flat FP32 tensors into flat BF16 tensors, one launch for all (two if some are misaligned).

    ``keys``: int64 array of stream keys (one per tensor), or None for round-to-nearest-even.
    """
    SRLaunch(xs, outs, offsets)(keys)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- fused AdamW ----------------------------------------------------------------------------------


class AdamWLaunch:
    """Fused AdamW over a fixed list of flat tensors (see ``triton_kernels.adamw_many_kernel``):
    the tables are built here; a step uploads its keys, gradient addresses and constants in one
    copy and launches once per (alignment, gradient dtype) group, normally once.

    ``params``/``exp_avgs``/``exp_avg_sqs``: flat contiguous tensors; ``outs``: the BF16 working
    tensors of FP32 shadows, or None for BF16 parameters updated in place (``pure``);
    ``offsets``: each piece's global index.
    """

    def __init__(
        self,
        params,
        exp_avgs,
        exp_avg_sqs,
        outs,
        offsets,
        *,
        pure: bool,
        moment_bf16: bool,
        names: Sequence[Sequence[str]] | None = None,
    ):
        self.pure, self.moment_bf16 = pure, moment_bf16
        self.names = names  # [param names, exp_avg names, exp_avg_sq names], for keys derived on the device
        self._templates: dict = {}
        self._uploaded: dict = {}
        outs = outs if outs is not None else params
        self.device = check_device([t for ts in (params, exp_avgs, exp_avg_sqs, outs) for t in ts])
        self.live = [i for i, p in enumerate(params) if p.numel()]
        self.addresses = [[ts[i].data_ptr() for i in self.live] for ts in (params, exp_avgs, exp_avg_sqs, outs)]
        self.ns = [params[i].numel() for i in self.live]
        self.g0 = [offsets[i] for i in self.live]
        self._tables: dict[tuple[bool, tuple[int, ...]], TensorTable] = {}
        # which pieces may take the 16-byte path, gradients aside (checked per step)
        self._static_aligned = np.asarray(
            [
                self.g0[k] % 4 == 0 and all(a[k] % ALIGN_BYTES == 0 for a in self.addresses)
                for k in range(len(self.live))
            ],
            dtype=bool,
        )
        self._everything, self._live = tuple(range(len(self.live))), tuple(self.live)  # hashed per step: no copies

    def _table(self, aligned: bool, idx: list[int]) -> TensorTable:
        key = (ADAMW_BLOCK, aligned, tuple(idx))
        table = self._tables.get(key)
        if table is None:
            fields = tuple(tuple(a[i] for i in idx) for a in (*self.addresses, self.ns, self.g0))
            table = _make_table(fields, fields[4], fields[5], ADAMW_BLOCK, aligned, self.device)
            self._tables[key] = table
        return table

    def __call__(
        self,
        grads: Sequence[torch.Tensor],
        keys: np.ndarray | None,
        slots: Sequence[int],
        consts: np.ndarray,
        scale: torch.Tensor,
        device_step: DeviceStep | None = None,
        hyper: np.ndarray | None = None,
        key_step: KeyStep | None = None,
        dtypes: set | None = None,
    ) -> None:
        """``grads``: one per tensor given at construction (contiguous, float32 or bfloat16, the
        tensor's numel and device: ``fused.AdamWPlan`` checks them); ``keys``: int64 ``[3, T]``
        (param, exp_avg, exp_avg_sq keys) or None for nearest; ``slots``: each tensor's row of
        ``consts`` (float32 ``[S, 8]``, ``triton_kernels.ADAMW_CONSTS``); ``scale``: a one-element
        FP32 device tensor multiplying the gradients.

        With ``device_step``, keys and constants of step ``counter + 1`` are derived on the
        device instead (``hyper``: float64 ``[S, 5]`` = lr, beta1, beta2, eps, weight decay;
        ``keys`` and ``consts`` are ignored), so the step replays correctly from a CUDA graph.
        With ``key_step`` the keys of that (seed, step, mode) are derived on the device from the
        step, uploaded with the gradient addresses and constants (``keys`` is ignored): no
        per-name hashing on the host. ``dtypes``: the gradients' dtypes, if the caller has them."""
        if not self.live:
            return
        live = self.live
        slots = np.asarray(slots, dtype=np.int64)
        if len(live) != len(grads):  # some tensors are empty
            grads, slots = [grads[i] for i in live], slots[live]
        # C-level passes over the gradients, no Python loop per tensor (``grads`` is a step's
        # every gradient: this is most of a step's host work); their dtype, numel, device and
        # contiguity were checked by the caller (``fused.AdamWPlan``)
        ga = np.asarray(list(map(torch.Tensor.data_ptr, grads)), dtype=np.int64)
        if dtypes is None:
            dtypes = set(map(_DTYPE, grads))
        ok = self._static_aligned & (ga % ALIGN_BYTES == 0)
        consts = np.ascontiguousarray(consts if consts is not None else np.zeros(8), dtype=np.float32).reshape(-1, 8)
        keyed = keys is not None or key_step is not None
        if len(dtypes) == 1 and ok.all():  # the usual case: one launch
            groups = [(True, torch.bfloat16 in dtypes, None)]
        else:
            bf16 = np.asarray([g.dtype == torch.bfloat16 for g in grads])
            groups = [
                (aligned, grad_bf16, np.flatnonzero((ok == aligned) & (bf16 == grad_bf16)).tolist())
                for aligned in (True, False)
                for grad_bf16 in (True, False)
            ]
        for aligned, grad_bf16, sel in groups:
            if sel is None:  # every tensor
                sel, rows, t = self._everything, self._live, len(live)
                step_rows = np.concatenate([ga, slots])
            elif not sel:
                continue
            else:
                rows, t = [live[k] for k in sel], len(sel)
                step_rows = np.concatenate([ga[sel], slots[sel]])
            table = self._table(aligned, sel)
            if device_step is not None:
                hyper64 = np.ascontiguousarray(hyper, dtype=np.float64).reshape(-1, 5)
                step = self._static_upload(
                    (aligned, grad_bf16), np.concatenate([step_rows, hyper64.view(np.int64).reshape(-1)])
                )
                key_dev = torch.empty(3 * t, dtype=torch.int64, device=self.device)
                const_dev = torch.empty(hyper64.shape[0] * 8, dtype=torch.float32, device=self.device)
                self._templates_for(aligned, rows, device_step).run(
                    device_step.counter, key_dev, step[2 * t :].view(torch.float64), const_dev, hyper64.shape[0]
                )
                keyed = True
            elif key_step is not None:
                step = upload(
                    np.concatenate(
                        [np.asarray([key_step.counter()], np.int64), step_rows, consts.view(np.int64).reshape(-1)]
                    ),
                    self.device,
                )
                lanes = 3 if self.moment_bf16 else 1  # FP32 moments are not rounded: the parameters' keys only
                key_dev = torch.empty(3 * t, dtype=torch.int64, device=self.device)
                self._templates_for(aligned, rows, DeviceStep(step, key_step.seed, key_step.mode), lanes).run(
                    step[:1], key_dev
                )
                step = step[1:]
                const_dev = step[2 * t :].view(torch.float32)
            else:
                key_rows = keys[:, rows] if keyed else np.zeros((3, t), dtype=np.int64)
                step = upload(
                    np.concatenate(
                        [key_rows.astype(np.int64).reshape(-1), step_rows, consts.view(np.int64).reshape(-1)]
                    ),
                    self.device,
                )
                key_dev, step = step[: 3 * t], step[3 * t :]
                const_dev = step[2 * t :].view(torch.float32)
            launcher(tk.adamw_many_kernel)(
                table.grid,
                table.meta,
                table.bmap,
                key_dev,
                step[: 2 * t],
                const_dev,
                scale,
                table.count,
                KEYED=keyed,
                ALIGNED=aligned,
                GRAD_BF16=grad_bf16,
                PURE=self.pure,
                MOMENT_BF16=self.moment_bf16,
                BLOCK=ADAMW_BLOCK,
                num_warps=ADAMW_WARPS,
                **_fp_options(),
            )

    def _static_upload(self, group, array: np.ndarray) -> torch.Tensor:
        """The device copy of a capturable step's data (gradient addresses, slots, hyper-parameters),
        uploaded again only when it changed: a captured loop's steady state uploads nothing, and a
        capture never allocates pinned memory."""
        content = array.tobytes()
        cached = self._uploaded.get(group)
        if cached is None or cached[0] != content:
            cached = self._uploaded[group] = (content, upload(array, self.device))
        return cached[1]

    def _templates_for(self, aligned: bool, rows: list[int], step: DeviceStep, kinds: int = 3) -> KeyTemplates:
        key = (aligned, tuple(rows), step.seed, step.mode, kinds)
        tmpl = self._templates.get(key)
        if tmpl is None:
            if self.names is None:
                raise ValueError("keys derived on the device need the tensors' names (AdamWLaunch(names=...))")
            # lanes: the params' names, then their moments' (the kernel reads keys[3, T])
            lanes = [self.names[r][i] for r in range(kinds) for i in rows]
            tmpl = self._templates[key] = KeyTemplates(lanes, step.seed, step.mode, self.device)
        return tmpl


_SCALES: dict[tuple[float, torch.device], torch.Tensor] = {}


def scale_tensor(value: float, device: torch.device) -> torch.Tensor:
    """A cached one-element FP32 device tensor (made once per value and device, so no per-step upload)."""
    t = _SCALES.get((value, device))
    if t is None:
        t = torch.full((1,), value, dtype=torch.float32, device=device)
        _SCALES[(value, device)] = t
    return t


# ---- the host side alone, on a machine without a GPU ---------------------------------------------


@dataclass
class DryRun:
    """What ``dry_run`` recorded: each launch as (kernel name, grid, arguments), ``jit`` the ones
    that went through Triton's JIT (a specialization's first call), the others launched directly."""

    launches: list = field(default_factory=list)
    jit: list = field(default_factory=list)


class _DryKernel:
    """Stands in for a compiled kernel: ``run`` records the launch."""

    def __init__(self, name: str, record: DryRun):
        self.name, self.record = name, record
        self.function = self.packed_metadata = None

    def run(self, grid, _y, _z, _stream, _function, _metadata, _hook_meta, _enter, _exit, *args):
        self.record.launches.append((self.name, grid, args))


class _DryJIT:
    """Stands in for a ``triton.jit`` function: a launch records itself and returns a ``_DryKernel``."""

    def __init__(self, fn, record: DryRun):
        self.arg_names, self.name, self.record = fn.arg_names, fn.__name__, record

    def __getitem__(self, grid):
        def launch(*args, num_warps=None, **kw):
            full = args + tuple(kw[n] for n in self.arg_names[len(args) :] if n in kw)  # as a direct launch lists them
            self.record.launches.append((self.name, grid[0], full))
            self.record.jit.append(self.name)
            return _DryKernel(self.name, self.record)

        return launch


@contextlib.contextmanager
def dry_run() -> Iterator[DryRun]:
    """Run the launch path's host side on CPU tensors with every device launch recorded instead
    of run: what a call costs the host, and which launches it makes with which arguments, measured
    and tested without a GPU (bench/host_cost.py, tests/numerics/test_triton.py). Everything is
    as on a GPU (specializations compiled once, then launched directly with raw addresses; cached
    tables) except that nothing runs on a device; the caches are emptied before and after."""
    record = DryRun()
    kernels = {m: {n: getattr(m, n) for n in dir(m) if n.endswith("_kernel")} for m in (tk, triton_keys)}
    names = ("interpreting", "check_device", "current_device", "raw_stream")
    g = globals()
    saved = {n: g[n] for n in names}

    def reset() -> None:
        _ONE.clear()
        _LAUNCHERS.clear()
        TABLES.clear()
        _SCALES.clear()

    reset()
    try:
        for m, fns in kernels.items():
            for n, fn in fns.items():
                setattr(m, n, _DryJIT(fn, record))
        g.update(
            interpreting=lambda: False,
            check_device=lambda tensors: tensors[0].device,
            current_device=lambda: -1,  # a CPU tensor's get_device()
            raw_stream=lambda device: 0,
        )
        yield record
    finally:
        for m, fns in kernels.items():
            for n, fn in fns.items():
                setattr(m, n, fn)
        g.update(saved)
        reset()
