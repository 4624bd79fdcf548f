"""What a peer test observed of the held-weights check inside the peer's own engines, for
``scripts/peer_stacks.sh`` to print: each case the test runs is ``record``ed into the JSON file
``DIST_SR_PEER_RESULTS`` names (nothing when it is unset), and

    python3 -m tests.peers.results FILE PEER

prints, from the values in that file only, for each case

    peer-stack: <peer> <version> [<case>]: engine check through <extension> (load format <fmt>):
        passed (<verified>/<engines> engines verified, <tensors> tensors each: <read_back> read back,
        <as_loaded> only as loaded)
    peer-stack: <peer> <version> [<case>]: FP32 master pushed for <tensor> (<how>): caught

(each on one line; ``[<case>]`` where the file holds several), where ``<extension>`` is the
worker extension the engine reported it runs and "passed" / "caught" are decided from the counts
and names recorded, never from the file's existence: FAILED / NOT CAUGHT, saying what the values
show, otherwise. Exits non-zero when the file is missing or empty, a case lacks a value, or any
case FAILED or was NOT CAUGHT."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV = "DIST_SR_PEER_RESULTS"
# what each case must record (``record``'s docstring says what each holds)
FIELDS = ("version", "extension", "load_format", "engines", "verified", "tensors", "read_back", "as_loaded")
MASTER_FIELDS = ("pushed", "caught")


def record(peer: str, case: str, **observed) -> None:
    """Add what ``case`` observed: ``version`` (the peer's), ``extension`` (the worker extension
    the engine reported, ``module.Class`` then the classes it derives from: the held-weights
    answer's ``worker.extension``), ``load_format`` (the engine's start), ``engines`` (engines
    checked after the sync), ``verified`` (how many of them passed), ``tensors`` (what the trainer
    holds), ``read_back`` / ``as_loaded`` (an engine's tensors verified by reading its parameters
    back / only as handed to ``load_weights``), ``pushed`` (the tensor pushed as its FP32 master),
    ``caught`` (the tensors the check named then) and ``pushed_as`` (how that master went out)."""
    target = os.environ.get(ENV)
    if not target:
        return
    path = Path(target)
    data = json.loads(path.read_text()) if path.is_file() and path.stat().st_size else {"peer": peer, "cases": {}}
    data["cases"][case] = observed
    path.write_text(json.dumps(data, indent=1))


def extension_words(extension) -> str:
    """``A (from B)`` for the engine's report ``[A, B, ...]``; the report as it is otherwise."""
    if isinstance(extension, list) and extension and all(isinstance(e, str) for e in extension):
        return extension[0] + (f" (from {extension[1]})" if len(extension) > 1 else "")
    return f"no worker extension reported ({extension!r})"


def check_line(prefix: str, r: dict) -> tuple[str, bool]:
    """The engine-check line of one case, and whether its values show the check passed."""
    missing = [f for f in FIELDS if f not in r]
    if missing:
        return f"{prefix}: engine check: FAILED (not recorded: {', '.join(missing)})", False
    engines, verified, tensors = r["engines"], r["verified"], r["tensors"]
    read_back, as_loaded = r["read_back"], r["as_loaded"]
    counts = (
        f"{verified}/{engines} engines verified, {tensors} tensors each: {read_back} read back, "
        f"{as_loaded} only as loaded"
    )
    wrong = []
    if not (isinstance(engines, int) and engines > 0 and verified == engines):
        wrong.append("not every engine verified")
    if not (isinstance(tensors, int) and tensors > 0 and read_back + as_loaded == tensors):
        wrong.append("not every tensor checked")
    if not (isinstance(r["extension"], list) and r["extension"]):
        wrong.append("the engine did not say which extension it runs")
    ok = not wrong
    status = "passed" if ok else f"FAILED: {'; '.join(wrong)}"
    where = f"engine check through {extension_words(r['extension'])} (load format {r['load_format']})"
    return f"{prefix}: {where}: {status} ({counts})", ok


def master_line(prefix: str, r: dict) -> tuple[str, bool]:
    """The FP32-master line of one case, and whether the check named exactly the pushed tensor."""
    if any(f not in r for f in MASTER_FIELDS):
        return f"{prefix}: FP32 master pushed: NOT CAUGHT (not recorded: pushed, caught)", False
    pushed, caught = r["pushed"], r["caught"]
    how = f" ({r['pushed_as']})" if r.get("pushed_as") else ""
    if caught == [pushed]:
        return f"{prefix}: FP32 master pushed for {pushed}{how}: caught", True
    return f"{prefix}: FP32 master pushed for {pushed}{how}: NOT CAUGHT (the check named {caught})", False


def lines(path: str, peer: str) -> tuple[list[str], bool]:
    """The lines to print for ``peer``, and whether every recorded case's values show the check
    passing and the pushed master caught."""
    file = Path(path)
    cases = json.loads(file.read_text()).get("cases", {}) if file.is_file() and file.stat().st_size else {}
    if not cases:
        return [f"peer-stack: {peer}: engine check: NOT OBSERVED (its loop test did not pass)"], False
    out, ok = [], True
    for case, r in cases.items():
        prefix = f"peer-stack: {peer} {r.get('version', '?')}" + (f" [{case}]" if len(cases) > 1 else "")
        for line, good in (check_line(prefix, r), master_line(prefix, r)):
            out.append(line)
            ok = ok and good
    return out, ok


if __name__ == "__main__":
    printed, all_ok = lines(sys.argv[1], sys.argv[2])
    print("\n".join(printed))
    sys.exit(0 if all_ok else 1)
