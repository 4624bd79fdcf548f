"""Grid-step deltas between two versions of 16-bit weights (BF16, or FP16): what a delta sync
sends instead of the dense tensor.

Under stochastic rounding about a quarter of the BF16 working weights change per step, too many
for (index, value) pairs, but almost every change is one step of the 16-bit grid: the new weight
is the other BF16 neighbour of an FP32 shadow that barely moved, so its code differs by +1 or -1
(in magnitude, whatever the exponent). A delta therefore holds:

- where the changes are: a bitmap of ``numel`` bits (``layout="bitmap"``), or, when few elements
  changed, the LEB128-coded gaps between changed indices (``layout="gaps"``; the gap before the
  change at ``i`` after the one at ``p`` is ``i - p - 1``, with ``p = -1`` before the first);
  the encoder picks whichever is smaller;
- one sign bit per change, in order (1: the code went down, 0: up), which moves it one step;
- escapes: every change of more than one step on the raw code (read as a signed 16-bit step ``s``:
  a small weight that an Adam step moves several grid steps, a sign change, NaN payloads) as two
  LEB128 numbers: the gap from the previous escape's index, and the rest ``r = s - sign(s)``
  zigzag-coded minus one (a jump of two or three steps costs two bytes).

When that would be larger than the tensor itself (most weights moving several grid steps: a large
learning rate), the delta is the new codes (``layout="dense"``), so a delta never costs more than
the dense tensor plus its header.

The coding is on raw codes modulo 2^16, so it is exact for every bit pattern (NaN, Inf, -0,
subnormals): ``apply_(old.clone(), encode(old, new))`` equals ``new`` bitwise. ``encode`` and
``apply_`` run the C++ kernel on CPU tensors (``csrc/delta_cpu.cpp``) and the torch reference
below (the specification; same bytes) elsewhere or without a compiler. ``Delta.to_bytes`` /
``Delta.from_bytes`` are the wire form (a 56-byte header, then the fields); ``from_bytes`` and
``apply_`` refuse a structurally damaged delta (``DeltaError``), and one damaged inside its fields
but still well-formed yields other weights, which a sync's digest catches.
"""

from __future__ import annotations

import importlib.util
import struct
from dataclasses import dataclass

import torch

from ..config import Refusal

LAYOUTS = ("bitmap", "gaps", "dense")
MAGIC = b"DSRD"
_HEADER = struct.Struct("<4sBBxxQQQQQQ")  # magic, format version, layout, numel, changed, escapes,
HEADER_BYTES = _HEADER.size  # position bytes, sign bytes, escape bytes
_FORMAT = 1


class DeltaError(Refusal, ValueError):
    """A delta that cannot be made (versions of another dtype or size) or applied (wrong size,
    damaged structure, unknown layout)."""

    what = "delta refused"


@dataclass(frozen=True)
class Delta:
    """Version t+1 of a flat 16-bit tensor of ``numel`` elements, coded against version t."""

    numel: int
    layout: str
    changed: int
    escapes: int
    positions: torch.Tensor  # uint8: the bitmap or the gaps
    signs: torch.Tensor  # uint8: ceil(changed / 8) bytes, bit j of the stream = change j
    escape_bytes: torch.Tensor  # uint8: (gap, rest) varint pairs

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (``len(self.to_bytes())``)."""
        return HEADER_BYTES + self.positions.numel() + self.signs.numel() + self.escape_bytes.numel()

    def to_bytes(self) -> bytes:
        head = _HEADER.pack(
            MAGIC,
            _FORMAT,
            LAYOUTS.index(self.layout),
            self.numel,
            self.changed,
            self.escapes,
            self.positions.numel(),
            self.signs.numel(),
            self.escape_bytes.numel(),
        )
        return b"".join([head, _raw(self.positions), _raw(self.signs), _raw(self.escape_bytes)])

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Delta:
        data = memoryview(data)
        if len(data) < HEADER_BYTES:
            raise DeltaError(f"a delta of {len(data)} bytes is shorter than its {HEADER_BYTES}-byte header")
        magic, fmt, layout, numel, changed, escapes, npos, nsign, nesc = _HEADER.unpack_from(data)
        if magic != MAGIC or fmt != _FORMAT or layout >= len(LAYOUTS):
            raise DeltaError(
                f"not a dist-sr delta of format {_FORMAT} (magic {bytes(magic)!r}, format {fmt}, layout {layout})"
            )
        expect = HEADER_BYTES + npos + nsign + nesc
        if (
            len(data) != expect
            or nsign != (changed + 7) // 8
            or escapes > changed
            or changed > numel
            or not 2 * escapes <= nesc <= 13 * escapes
        ):
            raise DeltaError(
                f"damaged delta: {len(data)} bytes where its header implies {expect} "
                f"({changed} changes of {numel}, {escapes} escapes)"
            )
        buf = (
            torch.frombuffer(bytearray(data[HEADER_BYTES:]), dtype=torch.uint8)
            if expect > HEADER_BYTES
            else torch.empty(0, dtype=torch.uint8)
        )
        pos, sig, esc = torch.split(buf, [npos, nsign, nesc])
        return cls(numel, LAYOUTS[layout], changed, escapes, pos.clone(), sig.clone(), esc.clone())


def read_delta(buffer: torch.Tensor, offset: int) -> tuple[Delta, int]:
    """The delta starting at byte ``offset`` of a uint8 buffer holding several back to back, and
    the offset after it."""
    head = buffer[offset : offset + HEADER_BYTES]
    if head.numel() < HEADER_BYTES:
        raise DeltaError(
            f"damaged delta stream: {head.numel()} bytes left where a {HEADER_BYTES}-byte header was expected"
        )
    fields = _HEADER.unpack(head.numpy().tobytes())
    end = offset + HEADER_BYTES + sum(fields[-3:])
    if end > buffer.numel():
        raise DeltaError(
            f"damaged delta stream: a delta of {end - offset} bytes where {buffer.numel() - offset} are left"
        )
    return Delta.from_bytes(buffer[offset:end].numpy().tobytes()), end


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _codes(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.element_size() != 2 or t.dtype.is_complex:
        raise DeltaError(f"{what}: grid-step deltas code 16-bit weights (bfloat16, float16), not {t.dtype}")
    return t.detach().reshape(-1).view(torch.int16)


def _kernel():
    """The C++ kernel if this process has it built (``backends.cpu.warm_up_in_background`` or
    ``load_delta`` builds it); never waits for a compile: until then the reference runs."""
    from .backends import cpu

    return cpu.loaded_delta()


def _use_triton(t: torch.Tensor, triton: bool | None) -> bool:
    """The Triton passes for CUDA tensors when Triton is installed (``triton=None``; torch ops on
    the device otherwise), or wherever asked (``TRITON_INTERPRET=1`` runs them on CPU tensors)."""
    if triton is None:
        return t.device.type == "cuda" and importlib.util.find_spec("triton") is not None
    return triton


def encode(
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    layout: str | None = None,
    reference: bool = False,
    triton: bool | None = None,
) -> Delta:
    """``new`` coded against ``old`` (same number of 16-bit elements; shapes are the caller's);
    ``layout`` forces one of ``LAYOUTS`` (default: the smaller). CPU tensors take the C++ kernel,
    CUDA tensors the Triton passes (``triton=False``: torch ops), ``reference=True`` the torch
    reference; all give the same bytes."""
    a, b = _codes(old, "the old version"), _codes(new, "the new version")
    if old.dtype != new.dtype:
        raise DeltaError(
            f"the versions differ in dtype: old {old.dtype}, new {new.dtype}; a delta steps one 16-bit grid, "
            "so the weights' dtype changed between versions: send this version dense"
        )
    if a.numel() != b.numel():
        raise DeltaError(f"the versions differ in size: {a.numel()} vs {b.numel()} elements")
    if layout is not None and layout not in LAYOUTS:
        raise DeltaError(f"unknown delta layout {layout!r}; choose one of {LAYOUTS}")
    if layout == "dense":
        return _dense(b)
    force = -1 if layout is None else LAYOUTS.index(layout)
    kernel = None if reference or a.device.type != "cpu" else _kernel()
    if not reference and _use_triton(a, triton):
        d = _encode_triton(a.contiguous(), b.contiguous(), force)
    elif kernel is None:
        d = _encode_reference(a, b, force)
    else:
        pos, sig, esc, lay, changed, escapes = kernel.encode(a.contiguous(), b.contiguous(), force)
        d = Delta(a.numel(), LAYOUTS[lay], int(changed), int(escapes), pos, sig, esc)
    return _dense(b) if layout is None and d.nbytes > HEADER_BYTES + 2 * a.numel() else d


def _dense(b: torch.Tensor) -> Delta:
    empty = torch.empty(0, dtype=torch.uint8)
    return Delta(b.numel(), "dense", 0, 0, b.contiguous().view(torch.uint8).cpu().clone(), empty, empty)


def apply_(held: torch.Tensor, delta: Delta, *, reference: bool = False, triton: bool | None = None) -> torch.Tensor:
    """``held`` (version t, contiguous) becomes version t+1 in place; returns it. After a
    ``DeltaError`` ``held`` may be partly changed: the holder needs a dense copy again. The
    backends as in ``encode``."""
    if not held.is_contiguous():
        raise DeltaError("a delta is applied to a contiguous tensor")
    h = _codes(held, "the held version")
    if h.numel() != delta.numel:
        raise DeltaError(f"a delta for {delta.numel} elements does not apply to a tensor of {h.numel()}")
    if delta.layout == "dense":
        if delta.positions.numel() != 2 * h.numel() or delta.changed or delta.escapes:
            raise DeltaError(
                f"damaged delta: a dense delta of {delta.positions.numel()} bytes for {h.numel()} 16-bit elements"
            )
        h.copy_(delta.positions.to(h.device).view(torch.int16))
        return held
    kernel = None if reference or h.device.type != "cpu" else _kernel()
    if not reference and _use_triton(h, triton) and delta.layout == "bitmap":
        _apply_triton(h, delta)
    elif kernel is None:
        _apply_reference(h, delta)
    else:
        try:
            kernel.apply(
                h,
                LAYOUTS.index(delta.layout),
                delta.positions,
                delta.signs,
                delta.escape_bytes,
                delta.changed,
                delta.escapes,
            )
        except RuntimeError as exc:
            raise DeltaError(str(exc).splitlines()[0]) from None
    return held


# ---- the reference (plain torch) -------------------------------------------------------------
_BIT = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _packbits(flags: torch.Tensor) -> torch.Tensor:
    n = flags.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=flags.device)
    padded[:n] = flags.to(torch.uint8)
    return (padded.view(-1, 8) * _BIT.to(flags.device)).sum(1, dtype=torch.uint8)


def _unpackbits(data: torch.Tensor, n: int) -> torch.Tensor:
    return ((data.view(-1, 1) & _BIT.to(data.device)) != 0).reshape(-1)[:n]


def _varints(values: torch.Tensor) -> torch.Tensor:
    """LEB128 bytes of non-negative int64 values, concatenated."""
    if values.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    lengths = torch.ones_like(values)
    for s in range(7, 64, 7):
        lengths += (values >> s) != 0
    ends = torch.cumsum(lengths, 0)
    out = torch.empty(int(ends[-1]), dtype=torch.uint8, device=values.device)
    for t in range(int(lengths.max())):
        sel = lengths > t
        byte = (values[sel] >> (7 * t)) & 0x7F
        byte |= (lengths[sel] > t + 1).to(torch.int64) << 7
        out[(ends - lengths)[sel] + t] = byte.to(torch.uint8)
    return out


def _unvarints(data: torch.Tensor) -> torch.Tensor:
    if data.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    b = data.to(torch.int64)
    last = (b & 0x80) == 0
    if not bool(last[-1]):
        raise DeltaError("damaged delta: a truncated gap")
    group = torch.cumsum(last.to(torch.int64), 0) - last.to(torch.int64)  # the varint each byte belongs to
    first = torch.ones_like(last)
    first[1:] = last[:-1]
    starts = torch.nonzero(first).reshape(-1)
    place = torch.arange(b.numel(), device=data.device) - starts[group]
    if bool((place > 9).any()):
        raise DeltaError("damaged delta: an overlong gap")
    out = torch.zeros(starts.numel(), dtype=torch.int64, device=data.device)
    out.index_add_(0, group, (b & 0x7F) << (7 * place))
    return out


def _encode_reference(a: torch.Tensor, b: torch.Tensor, force: int) -> Delta:
    d = (b.to(torch.int32) - a.to(torch.int32)) & 0xFFFF
    step = d - ((d >> 15) << 16)  # the signed step s
    changed = step != 0
    escape = changed & (step.abs() != 1)
    idx = torch.nonzero(changed).reshape(-1)
    esc = torch.nonzero(escape).reshape(-1)
    return _compose(a.numel(), force, idx, lambda: _packbits(changed), _packbits(step[idx] < 0), esc, step[esc])


def _encode_triton(a: torch.Tensor, b: torch.Tensor, force: int) -> Delta:
    from .backends.triton import delta_launch

    n = a.numel()
    below = {-1: -(-n // 8), 0: 0, 1: n + 1}[force]  # the gaps layout needs the changed indices
    c = delta_launch.changes(a, b, indices_below=below)
    idx = c.indices if c.indices is not None else torch.empty(0, dtype=torch.int64, device=a.device)
    return _compose(n, force, idx, lambda: c.bitmap, c.signs, c.escape_indices, c.escape_steps, changed=c.changed)


def _compose(n: int, force: int, idx, bitmap, signs, esc, esc_step, changed: int | None = None) -> Delta:
    """A delta from where the changes are (``idx``, or ``bitmap()``), their signs and the escapes:
    the smaller layout unless ``force`` (0 bitmap, 1 gaps) says which."""
    k = idx.numel() if changed is None else changed
    bitmap_bytes = -(-n // 8)
    gaps = None
    if force == 1 or (force < 0 and k < bitmap_bytes):
        gaps = _varints(idx - torch.cat([idx.new_full((1,), -1), idx[:-1]]) - 1)
    use_gaps = force == 1 or (force < 0 and gaps is not None and gaps.numel() < bitmap_bytes)
    positions = gaps if use_gaps and gaps is not None else bitmap()  # gaps exist when used
    rest = esc_step.to(torch.int64) - torch.sign(esc_step).to(torch.int64)
    pairs = torch.stack(
        [esc - torch.cat([esc.new_full((1,), -1), esc[:-1]]) - 1, ((rest << 1) ^ (rest >> 63)) - 1], 1
    ).reshape(-1)
    return Delta(n, LAYOUTS[int(use_gaps)], k, esc.numel(), positions.cpu(), signs.cpu(), _varints(pairs).cpu())


def _apply_reference(h: torch.Tensor, delta: Delta) -> None:
    n, k = delta.numel, delta.changed
    _check_signs(delta)
    if delta.layout == "bitmap":
        _check_bitmap(delta)
        bits = _unpackbits(delta.positions, -(-n // 8) * 8)
        idx = torch.nonzero(bits[:n]).reshape(-1)
    else:
        gaps = _unvarints(delta.positions)
        idx = torch.cumsum(gaps + 1, 0) - 1
        if idx.numel() and (int(gaps.min()) < 0 or int(gaps.max()) >= n or int(idx[-1]) >= n):
            raise DeltaError("damaged delta: a change past the last element")
    if idx.numel() != k:
        raise DeltaError(f"damaged delta: {idx.numel()} changes where the header says {k}")
    esc, rest = _escapes(delta)
    signs = _unpackbits(delta.signs, 8 * delta.signs.numel())
    _add(h, idx.to(h.device), torch.where(signs[:k], -1, 1).to(h.device))
    _add(h, esc.to(h.device), rest.to(h.device))


def _apply_triton(h: torch.Tensor, delta: Delta) -> None:
    """The bitmap layout with the Triton passes (the escapes in torch ops): checked like the
    reference before anything is written."""
    from .backends.triton import delta_launch

    _check_signs(delta)
    _check_bitmap(delta)
    bitmap, signs = delta.positions.to(h.device), delta.signs.to(h.device)
    starts, k = delta_launch.bitmap_starts(bitmap, delta.numel)
    if k != delta.changed:
        raise DeltaError(f"damaged delta: {k} changes where the header says {delta.changed}")
    esc, rest = _escapes(delta)
    delta_launch.bitmap_step(h, bitmap, signs, starts)
    _add(h, esc.to(h.device), rest.to(h.device))


def _check_signs(delta: Delta) -> None:
    k = delta.changed
    if delta.signs.numel() != (k + 7) // 8:
        raise DeltaError(f"damaged delta: {delta.signs.numel()} sign bytes for {k} changes")
    if k % 8 and int(delta.signs[-1]) >> (k % 8):
        raise DeltaError("damaged delta: sign bits past the last change")


def _check_bitmap(delta: Delta) -> None:
    n = delta.numel
    if delta.positions.numel() != -(-n // 8):
        raise DeltaError(f"damaged delta: a bitmap of {delta.positions.numel()} bytes for {n} elements")
    if n % 8 and int(delta.positions[-1]) >> (n % 8):
        raise DeltaError("damaged delta: bitmap bits past the last element")


def _escapes(delta: Delta) -> tuple[torch.Tensor, torch.Tensor]:
    """The escapes' indices and the rest of their steps (beyond the sign bit's one step)."""
    n = delta.numel
    pairs = _unvarints(delta.escape_bytes)
    if pairs.numel() != 2 * delta.escapes:
        raise DeltaError(f"damaged delta: {pairs.numel()} escape numbers for {delta.escapes} escapes")
    pairs = pairs.view(-1, 2)
    esc = torch.cumsum(pairs[:, 0] + 1, 0) - 1
    z = pairs[:, 1] + 1
    if esc.numel() and (
        int(pairs[:, 0].min()) < 0
        or int(pairs[:, 0].max()) >= n
        or int(esc[-1]) >= n
        or int(z.min()) < 1
        or int(z.max()) > 0xFFFF
    ):
        raise DeltaError("damaged delta: an escape out of range")
    return esc, (z >> 1) ^ -(z & 1)


def _add(h: torch.Tensor, idx: torch.Tensor, steps: torch.Tensor) -> None:
    """h[idx] += steps on the raw codes, modulo 2^16 (as the kernel)."""
    code = (h[idx].to(torch.int64) + steps) & 0xFFFF
    h[idx] = (code - ((code >> 15) << 16)).to(torch.int16)
