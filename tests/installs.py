"""dist-sr installed the ways users install it, in fresh virtual environments: the wheel pip
builds from the source tree, and environments that see this suite's third-party packages (torch,
DeepSpeed, transformers, ...) without installing them again (that would cost minutes and
gigabytes): a directory of links to them (``suite_packages``) that the new environment reads as a
plain path entry, so no ``.pth`` file of this suite's runs there and dist-sr is never among them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.dist_utils import REPO

# never linked: this suite's own dist-sr (editable finder, hook, metadata) and every .pth file
OWN = ("dist_sr", "__editable__", "dist_sr_deepspeed_hook")


def build_wheel(out: Path) -> Path:
    """The wheel pip builds from a copy of the source tree (as from the sdist: no venvs, no runs)."""
    src = out / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".venv*", ".git", "runs", "build", "dist", "*.egg-info", "__pycache__", ".*cache"
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("dist_sr-*.whl")
    return wheel


def suite_packages(path: Path, hide: tuple[str, ...] = ()) -> Path:
    """A directory of links to this suite's installed packages, less dist-sr, every ``.pth`` file,
    and the distributions named in ``hide`` (their packages and metadata)."""
    path.mkdir(parents=True)
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name.lower()
        if entry.suffix == ".pth" or name.startswith(OWN) or any(name.split("-")[0] == h for h in hide):
            continue
        (path / entry.name).symlink_to(entry)
    return path


def fresh_venv(path: Path, hide: tuple[str, ...] = ()) -> Path:
    """A new virtual environment (no pip) that sees this suite's packages less ``hide`` through a
    plain path entry (``suite_packages`` beside it); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    Path(site_packages(python), "suite_packages.pth").write_text(
        str(suite_packages(path.parent / f"{path.name}-suite-packages", hide)) + "\n"
    )
    return python


def site_packages(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def pip(python: Path, *args: str) -> None:
    """pip from this suite's environment acting on ``python``'s (no index: nothing is fetched)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), *args, "-q", "--no-index"],
        check=True,
        capture_output=True,
        timeout=300,
    )
