"""How a dist-sr vLLM engine is served, in one place: the ``vllm serve`` flags and environment
that Kubernetes pods (``launch/k8s_vllm.py``), engines a run starts on its host (``local.py``)
and the tests' engines all use.

- ``--weight-transfer-config '{"backend": "dist_sr"}'``: the trainer's signed, verified sync
  (``plugin.DistSRWeightTransferEngine``);
- ``--middleware ...SyncAuthMiddleware``: the weight routes answer only signed requests;
- ``VLLM_SERVER_DEV_MODE=1``: vLLM exposes the weight routes at all.

No worker extension is named: the plugin gives every worker dist-sr's RPCs itself.
"""

from __future__ import annotations

import json

BACKEND = "dist_sr"
MIDDLEWARE = "dist_sr.rollout.vllm.auth.SyncAuthMiddleware"
ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def serve_flags() -> list[str]:
    """dist-sr's flags for ``vllm serve`` (after the model and vLLM's own options)."""
    return ["--weight-transfer-config", json.dumps({"backend": BACKEND}), "--middleware", MIDDLEWARE]
