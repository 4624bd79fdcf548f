"""What a peer test observed of the held-weights check inside the peer's own engines, for
``scripts/peer_stacks.sh`` to print: each case the test runs is ``record``ed into the JSON file
``DIST_SR_PEER_RESULTS`` names (nothing when it is unset), and

    python3 -m tests.peers.results FILE PEER

prints, from that file only, the lines

    peer-stack: <peer> <version>: engine check through <extension> (load format <fmt>): passed (<cases>)
    peer-stack: <peer> <version>: FP32 master pushed for <tensor> (<how>): caught (<cases>)

and exits non-zero when the file is missing or a case lacks either observation."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV = "DIST_SR_PEER_RESULTS"


def record(peer: str, case: str, **observed) -> None:
    """Add what ``case`` observed: ``version``, ``extension`` (the worker extension the engine
    ran, in words), ``load_format`` (the engine's start), ``passed`` (the check's summary on the
    keyed bits), ``caught`` (the tensor pushed as its FP32 master that the check named) and
    ``pushed_as`` (how that master went out, e.g. rounded to nearest)."""
    target = os.environ.get(ENV)
    if not target:
        return
    path = Path(target)
    data = json.loads(path.read_text()) if path.is_file() and path.stat().st_size else {"peer": peer, "cases": {}}
    data["cases"][case] = observed
    path.write_text(json.dumps(data, indent=1))


def lines(path: str, peer: str) -> tuple[list[str], bool]:
    """The lines to print for ``peer``, and whether every recorded case saw both observations."""
    file = Path(path)
    cases = json.loads(file.read_text())["cases"] if file.is_file() and file.stat().st_size else {}
    if not cases:
        return [f"peer-stack: {peer}: engine check: NOT OBSERVED (its loop test did not pass)"], False
    found = list(cases.values())
    version = found[0].get("version", "?")
    names = ", ".join(cases)
    out, ok = [], True
    passed = {(r.get("extension"), r.get("load_format")) for r in found if r.get("passed")}
    if len(passed) == 1 and all(r.get("passed") for r in found):
        extension, fmt = passed.pop()
        out.append(
            f"peer-stack: {peer} {version}: engine check through {extension} (load format {fmt}): passed ({names})"
        )
    else:
        ok = False
        out.append(f"peer-stack: {peer} {version}: engine check: FAILED ({names}: {sorted(map(str, passed))})")
    caught = {r.get("caught") for r in found}
    if None in caught:
        ok = False
        out.append(f"peer-stack: {peer} {version}: FP32 master pushed: NOT CAUGHT in every case")
    else:
        for tensor in sorted(caught):
            hits = [case for case, r in cases.items() if r["caught"] == tensor]
            how = "; ".join(sorted({cases[c]["pushed_as"] for c in hits if cases[c].get("pushed_as")}))
            out.append(
                f"peer-stack: {peer} {version}: FP32 master pushed for {tensor}{f' ({how})' if how else ''}: "
                f"caught ({', '.join(hits)})"
            )
    return out, ok


if __name__ == "__main__":
    printed, all_ok = lines(sys.argv[1], sys.argv[2])
    print("\n".join(printed))
    sys.exit(0 if all_ok else 1)
