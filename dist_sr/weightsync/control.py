"""How a weight sync drives one rollout engine: the ``ControlPlane`` protocol, and its errors.

A sync never talks to an engine directly: each engine comes with a control plane (for vLLM, HTTP
calls to its weight-transfer routes: ``dist_sr.rollout.vllm.control``). Another rollout engine
(SGLang, a bare receiver) is one more implementation of these methods.
"""

from __future__ import annotations

from typing import Protocol

from ..config import Refusal

GROUP_PORT = 29600  # trainer rank 0 hosts the weight-transfer groups' store here by default
TIMEOUT_S = 120.0  # default per collective and per control call
MAX_TIMEOUT_S = 3600.0  # the longest per-call timeout an engine accepts


class EngineError(RuntimeError):
    """An engine failed a control call or a collective (the message starts with its name)."""


class MalformedReply(EngineError):
    """An engine's reply that is not an answer: a broken HTTP status line or headers, a body cut
    short or not UTF-8, JSON that is not what the route returns (the message starts with its name
    and says what was wrong). The engine is treated as down."""


class NoReadyEngineError(Refusal, RuntimeError):
    """No rollout engine holds the trainer's verified weights (the message names them and why)."""

    what = "no rollout engine"


class ControlPlane(Protocol):
    """How a weight sync drives one rollout engine (a vLLM server over HTTP, a bare receiver):
    the four-phase weight update plus health, pause/resume and the workers' reports. Each method
    raises ``EngineError`` (its message starting with ``name``) when the engine fails it, and
    ``MalformedReply`` when what came back is not an answer. (``WeightSync`` treats any other
    exception from a control plane as that engine failing, naming the exception's type.)

    Methods:
        health(); world_size(): workers that join the transfer groups;
        init_transfer(info): join the groups ``info`` describes (``receiver.InitInfo`` fields);
        pause(); start_update(); update(plan, timeout): receive every bucket of ``plan``;
        finish(version); reset_cache(); report(): each worker's report; held_problem(entries):
        what the workers hold, read back, against the trainer's digests; resume().
    """

    name: str  # a stable name for logs and errors (vLLM: the engine's base URL)

    def health(self) -> None:
        """Raise ``EngineError`` unless the engine answers."""

    def world_size(self) -> int:
        """Workers of the engine that join the transfer groups (TP * PP * DP)."""

    def init_transfer(self, info: dict) -> None:
        """Join the transfer groups described by ``info`` (``receiver.InitInfo`` fields)."""

    def pause(self) -> None: ...

    def start_update(self) -> None: ...

    def update(self, plan: dict, timeout: float) -> None:
        """Receive every bucket of ``plan`` (``SyncPlan.to_json``); returns when loaded."""

    def finish(self, version: int) -> None: ...

    def reset_cache(self) -> None: ...

    def report(self) -> list[dict]:
        """Each worker's ``WeightReceiver.report()``: version, completeness and digests."""

    def held_problem(self, entries: dict) -> str | None:
        """What the engine's workers hold now, read back from their parameters, against the
        trainer's digest entries (``{name: (dtype, shape, sum)}``): None if every worker of the
        engine answered and holds them, else what is wrong, naming tensors and workers."""

    def resume(self) -> None: ...
