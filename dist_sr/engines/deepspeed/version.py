"""The DeepSpeed versions whose internals (copy sites, fragment mappings) dist-sr was tested with;
any other version is refused before anything is patched."""

from __future__ import annotations

TESTED = ((0, 19, 8), (0, 20, 0))  # [low, high): the DeepSpeed versions whose internals were tested


class UnsupportedDeepSpeed(RuntimeError):
    pass


def check_version(version: str | None = None) -> None:
    """Refuse a DeepSpeed whose internals (copy sites, fragment mappings) were not tested."""
    if version is None:
        import deepspeed  # an optional dependency: imported only when a DeepSpeed engine is used

        version = deepspeed.__version__
    try:
        parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3])
    except ValueError:
        parts = ()
    low, high = TESTED
    if not (len(parts) == 3 and low <= parts < high):
        raise UnsupportedDeepSpeed(
            f"dist_sr patches DeepSpeed's FP32->BF16 copy sites, tested with DeepSpeed "
            f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}; this is DeepSpeed {version}. "
            "Install a tested version (pip install 'deepspeed>=0.19.8,<0.20'); dist_sr will not fall back to "
            "round-to-nearest silently"
        )
