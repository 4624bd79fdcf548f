"""What a peer test observed of the held-weights check inside the peer's own engines, for
``scripts/peer_stacks.sh`` to print: a test ``record``s one JSON file per case into the directory
``DIST_SR_PEER_RESULTS`` names (nothing when it is unset), and

    python -m tests.peers.results DIRECTORY PEER

prints, from those files only, the lines

    peer-stack: <peer> <version>: engine check through <extension> (load format <fmt>): passed (<cases>)
    peer-stack: <peer> <version>: FP32 master pushed for <tensor> (<how>): caught (<cases>)

and exits non-zero when a case is missing either observation (or none was recorded)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV = "DIST_SR_PEER_RESULTS"


def record(peer: str, case: str, **observed) -> None:
    """Write what ``case`` observed: ``version``, ``extension`` (the worker extension the engine
    ran, in words), ``load_format`` (the engine's start), ``passed`` (the check's summary on the
    keyed bits), ``caught`` (the tensor pushed as its FP32 master that the check named) and
    ``pushed_as`` (how that master went out, e.g. rounded to nearest)."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    path = Path(directory) / f"{peer}-{''.join(c if c.isalnum() else '-' for c in case)}.json"
    path.write_text(json.dumps({"peer": peer, "case": case, **observed}, indent=1))


def lines(directory: str, peer: str) -> tuple[list[str], bool]:
    """The lines to print for ``peer``, and whether every recorded case saw both observations."""
    found = [json.loads(p.read_text()) for p in sorted(Path(directory).glob(f"{peer}-*.json"))]
    if not found:
        return [f"peer-stack: {peer}: no engine check was recorded (FAILED)"], False
    version = found[0].get("version", "?")
    cases = ", ".join(r["case"] for r in found)
    out, ok = [], True
    passed = {(r.get("extension"), r.get("load_format")) for r in found if r.get("passed")}
    if len(passed) == 1 and all(r.get("passed") for r in found):
        extension, fmt = passed.pop()
        out.append(
            f"peer-stack: {peer} {version}: engine check through {extension} (load format {fmt}): passed ({cases})"
        )
    else:
        ok = False
        out.append(f"peer-stack: {peer} {version}: engine check: FAILED ({[r['case'] for r in found]}: {passed})")
    caught = {r.get("caught") for r in found}
    if None not in caught:
        for tensor in sorted(caught):
            hits = [r for r in found if r["caught"] == tensor]
            how = "; ".join(sorted({r["pushed_as"] for r in hits if r.get("pushed_as")}))
            which = ", ".join(r["case"] for r in hits)
            out.append(
                f"peer-stack: {peer} {version}: FP32 master pushed for {tensor}{f' ({how})' if how else ''}: "
                f"caught ({which})"
            )
    else:
        ok = False
        out.append(f"peer-stack: {peer} {version}: FP32 master pushed: not caught in every case (FAILED)")
    return out, ok


if __name__ == "__main__":
    printed, all_ok = lines(sys.argv[1], sys.argv[2])
    print("\n".join(printed))
    sys.exit(0 if all_ok else 1)
