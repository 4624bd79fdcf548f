"""The DeepSpeed versions whose internals (copy sites, fragment mappings) dist-sr was tested with;
any other version is refused before anything is patched."""

from __future__ import annotations

from ...config import Refusal

TESTED = ((0, 19, 5), (0, 20, 0))  # [low, high): the DeepSpeed versions whose internals were tested
# Older DeepSpeed reloads universal checkpoints of unevenly sharded parameters with other FP32
# masters than were saved (tested: test_universal_checkpoint_reloads_at_another_world_size...)
UNIVERSAL_RELOAD = (0, 19, 7)


class UnsupportedDeepSpeed(Refusal, RuntimeError):
    what = "unsupported DeepSpeed"


def version_tuple(version: str | None = None) -> tuple[int, ...]:
    """``(major, minor, patch)`` of ``version`` (default: the installed DeepSpeed); () if unreadable."""
    if version is None:
        import deepspeed  # an optional dependency: imported only when a DeepSpeed engine is used

        version = deepspeed.__version__
    try:
        return tuple(int(p) for p in version.split("+")[0].split(".")[:3])
    except ValueError:
        return ()


def check_universal_reload() -> None:
    """Refuse to load a universal checkpoint on a DeepSpeed whose reload was found to change the
    FP32 masters: the keyed BF16 weights would follow the wrong masters without a word."""
    if version_tuple() < UNIVERSAL_RELOAD:
        import deepspeed

        raise UnsupportedDeepSpeed(
            f"DeepSpeed {deepspeed.__version__} reloads universal checkpoints of unevenly sharded parameters "
            f"with other FP32 masters than were saved (tested); load the normal checkpoint at the same world size, "
            f"or convert and load with DeepSpeed >={'.'.join(map(str, UNIVERSAL_RELOAD))}"
        )


def check_version(version: str | None = None) -> None:
    """Refuse a DeepSpeed whose internals (copy sites, fragment mappings) were not tested."""
    if version is None:
        import deepspeed  # an optional dependency: imported only when a DeepSpeed engine is used

        version = deepspeed.__version__
    parts = version_tuple(version)
    low, high = TESTED
    if not (len(parts) == 3 and low <= parts < high):
        window = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
        raise UnsupportedDeepSpeed(
            f"dist_sr patches DeepSpeed's FP32->BF16 copy sites, tested with DeepSpeed {window}; this is DeepSpeed "
            f"{version}. Install a tested version (pip install 'deepspeed{window}'); dist_sr will not fall back to "
            "round-to-nearest silently"
        )
