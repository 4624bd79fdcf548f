"""Asking the vLLM engines a framework runs inside its own async Ray actors (OpenRLHF's
``RolloutRayActor``) for a worker RPC that the actor class does not expose.

Such an actor's Ray methods are fixed when ``@ray.remote`` decorates its class, and none of them
is a generic ``collective_rpc``. Every Ray actor answers ``handle.__ray_call__.remote(fn, *args)``,
which runs ``fn(instance, *args)`` in the actor (``fn`` travels by reference: a module-level
function of dist-sr, which is installed on every node). On an async actor Ray runs that call
synchronously, and not on the actor's event loop (Ray 2.55 runs it on another thread, with no
running loop there), while the engine, ``instance.llm`` (vLLM's ``AsyncLLM``), lives on the loop.
So one call hands ``instance.llm.collective_rpc(method)`` to the loop
(``asyncio.run_coroutine_threadsafe``) and returns at once; further calls ask whether it is done,
until a deadline that names the engine. Nothing blocks the loop, so the same two steps would work
on a Ray that runs the call on the loop itself.

What this assumes, in this module only, each refused with the missing piece named:
- Ray: actor handles have ``__ray_call__`` (``require_ray_call``);
- the actor: its engine at ``.llm``, with ``collective_rpc``, whose event loop is the running one
  or the loop of its ``output_handler`` task (vLLM's ``AsyncLLM`` starts that task when it is
  built inside a running loop, as OpenRLHF's async ``__init__`` builds it; ``engine_loop``).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from ..config import Refusal

PENDING = "_dist_sr_pending_rpcs"  # on the actor instance: token -> concurrent.futures.Future


class EngineUnreachable(Refusal, RuntimeError):
    """A rollout engine could not be asked (Ray or the actor lacks what is needed, the actor died,
    or it did not answer in time); the message names the engine and why."""

    what = "engine not reachable"


def require_ray_call(handle, name: str) -> None:
    """Refuse a Ray actor handle without ``__ray_call__`` (naming the engine and the Ray version)."""
    if not hasattr(handle, "__ray_call__"):
        import ray

        raise EngineUnreachable(
            f"{name}: this Ray ({getattr(ray, '__version__', '?')}) gives actor handles no __ray_call__, which "
            "dist-sr uses to ask the engine's workers what they hold; use Ray 2.x (OpenRLHF 0.11 pins 2.55), or "
            "set DIST_SR_VERIFY=warn to train on unchecked"
        )


def collective_rpc(handles: list, method: str, *, names: list[str], timeout_s: float = 300.0) -> list[list]:
    """``method``'s answers from every worker of every engine (``handles``: Ray actor handles of
    actors with an ``AsyncLLM`` at ``.llm``), one list per engine; all engines are asked at once.
    Raises ``EngineUnreachable`` naming the engine that could not be asked or did not answer."""
    for handle, name in zip(handles, names):
        require_ray_call(handle, name)
    tokens = [_get(handle.__ray_call__.remote(start_rpc, method), name) for handle, name in zip(handles, names)]
    answers: dict[int, list] = {}
    deadline, wait = time.monotonic() + timeout_s, 0.02
    while len(answers) < len(handles):
        asked = {
            i: handles[i].__ray_call__.remote(poll_rpc, tokens[i]) for i in range(len(handles)) if i not in answers
        }
        for i, ref in asked.items():
            done, value = _get(ref, names[i])
            if done:
                answers[i] = value
        if len(answers) == len(handles):
            break
        if time.monotonic() > deadline:
            late = [names[i] for i in asked if i not in answers]
            for i in asked:
                if i not in answers:
                    handles[i].__ray_call__.remote(cancel_rpc, tokens[i])  # no answer awaited
            raise EngineUnreachable(
                f"{', '.join(late)}: no answer to {method} within {timeout_s:.0f} s (the engine is busy, hung "
                "or its workers died); look at the engine's log, or set DIST_SR_VERIFY=warn to train on unchecked"
            )
        time.sleep(wait)
        wait = min(2 * wait, 0.5)
    return [answers[i] for i in range(len(handles))]


def _get(ref, name: str):
    import ray

    try:
        return ray.get(ref)
    except Exception as exc:  # RayTaskError (the call raised), RayActorError (the actor died), ...
        cause = getattr(exc, "cause", None) or exc
        raise EngineUnreachable(f"{name}: {type(cause).__name__}: {cause}") from exc


# Run inside the engine's actor by __ray_call__ (module-level, so they travel by reference).


def engine_loop(actor) -> asyncio.AbstractEventLoop:
    """The event loop ``actor.llm`` lives on."""
    llm = getattr(actor, "llm", None)
    if llm is None or not hasattr(llm, "collective_rpc"):
        raise EngineUnreachable(
            f"the actor {type(actor).__name__} has no vLLM engine with collective_rpc at .llm (OpenRLHF's "
            "RolloutRayActor keeps its AsyncLLMEngine there); dist-sr cannot ask its workers"
        )
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # Ray runs __ray_call__ off the loop: find the engine's own
        pass
    handler = getattr(llm, "output_handler", None)
    if not isinstance(handler, asyncio.Task):
        raise EngineUnreachable(
            f"the vLLM engine of {type(actor).__name__} has no output_handler task to find its event loop by "
            "(vLLM's AsyncLLM starts one when built inside a running loop); dist-sr cannot ask its workers"
        )
    if handler.done():
        raise EngineUnreachable(
            f"the vLLM engine of {type(actor).__name__} has stopped (its output handler ended): the engine died"
        )
    return handler.get_loop()


def start_rpc(actor, method: str) -> str:
    """Hand ``actor.llm.collective_rpc(method)`` to the engine's loop; a token for ``poll_rpc``."""
    loop = engine_loop(actor)  # first: it names what the actor lacks
    future = asyncio.run_coroutine_threadsafe(actor.llm.collective_rpc(method), loop)
    token = uuid.uuid4().hex
    actor.__dict__.setdefault(PENDING, {})[token] = future
    return token


def poll_rpc(actor, token: str) -> tuple[bool, list | None]:
    """``(True, answers)`` once the RPC ``token`` names is done (its error raised here, so Ray
    carries it back), ``(False, None)`` before."""
    pending = actor.__dict__.get(PENDING, {})
    future = pending.get(token)
    if future is None:
        raise EngineUnreachable(f"no dist-sr RPC {token} is pending on this engine (the actor restarted?)")
    if not future.done():
        return False, None
    del pending[token]
    return True, future.result()


def cancel_rpc(actor, token: str) -> None:
    future = actor.__dict__.get(PENDING, {}).pop(token, None)
    if future is not None:
        future.cancel()
