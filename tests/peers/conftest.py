"""Tests on the peers' own packages at their own pins (verl, OpenRLHF), each in its own
environment: ``bash scripts/peer_stacks.sh`` builds those and runs these with
``DIST_SR_PEER_STACK`` naming the stack. The training environment has none of the peers, so the
suite (and CI) does not collect them."""

import os

STACK = os.environ.get("DIST_SR_PEER_STACK", "")
collect_ignore_glob = [] if STACK else ["test_*.py"]
