"""verl's Ray calls on one machine, without a Ray cluster: stand-ins for Ray itself only;
everything they reach is verl's own code (its ``vLLMHttpServer`` methods, its workers).

- ``runtime_context(job_id)``: ``ray.get_runtime_context()`` (verl's ``ServerAdapter`` reads the
  job id from it; the real one starts a local Ray cluster).
- ``ActorHandle(instance, actor_loop)``: ``handle.method.remote(...)`` runs the instance's method
  as Ray runs an async actor's, apart from the caller (a Ray actor is another process): an
  ``async def`` on the actor's own event loop (``actor_loop``, a thread here), anything else
  (``__ray_call__`` included: ``fn(instance, *args)``) in a thread beside that loop; it starts at
  once and the caller awaits it (Ray's ``ObjectRef``). Ray itself was checked to run a plain
  ``__ray_call__`` of an async actor off its event-loop thread (ray 2.60).
- ``vllm_server(address, authkey, replica)``: verl's own ``vLLMHttpServer`` (built with
  ``__new__``: its constructor and ``launch_server`` start vLLM in Ray's placement group) on its
  own event loop, over ``EngineClient``, the vLLM engine its ``launch_server`` would build
  (``AsyncLLM``), here a real vLLM engine in another process (``tests.peers.vllm_engine``) reached
  over its connection. ``_server_task`` stands for the uvicorn task ``launch_server`` starts on
  the actor's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from multiprocessing.connection import Client


class runtime_context:
    def __init__(self, job_id: str):
        self.job_id = job_id

    def get_job_id(self) -> str:
        return self.job_id


class ActorLoop:
    """An actor's event loop, running in a thread of its own."""

    def __init__(self):
        self.closers: list = []  # what the actor holds, closed with it
        self.loop = asyncio.new_event_loop()
        self.threads = concurrent.futures.ThreadPoolExecutor(4)  # Ray's threads for plain methods
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        """Run ``coro`` on the actor's loop from outside it; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        for close in self.closers:
            close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.threads.shutdown()


class _Method:
    def __init__(self, instance, actor: ActorLoop, name: str):
        self.instance, self.actor, self.name = instance, actor, name

    def remote(self, *args, **kwargs):
        if self.name == "__ray_call__":  # Ray's: return fn(self, *args, **kwargs)
            fn, *args = args
            return asyncio.wrap_future(self.actor.threads.submit(fn, self.instance, *args, **kwargs))
        method = getattr(self.instance, self.name)
        if inspect.iscoroutinefunction(method):
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(method(*args, **kwargs), self.actor.loop))
        return asyncio.wrap_future(self.actor.threads.submit(method, *args, **kwargs))


class ActorHandle:
    def __init__(self, instance, actor: ActorLoop):
        self._instance, self._actor = instance, actor

    def __getattr__(self, name: str) -> _Method:
        return _Method(self._instance, self._actor, name)


class EngineClient:
    """The part of vLLM's ``AsyncLLM`` verl's server calls: ``collective_rpc`` (returning every
    worker's answer) forwarded to the engine process; the cache resets, which a sync asks for
    after loading, are no-ops (the engine served no request before the syncs of these tests)."""

    def __init__(self, address, authkey: bytes):
        self.conn = Client(tuple(address), authkey=authkey)
        self.lock = threading.Lock()

    def _call(self, *cmd):
        with self.lock:
            self.conn.send(cmd)
            status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine: {value}")
        return value

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return await asyncio.to_thread(self._call, "rpc", method, tuple(args), kwargs or {})

    async def reset_prefix_cache(self, *args, **kwargs):
        return True

    async def reset_mm_cache(self):
        pass

    async def reset_encoder_cache(self):
        pass

    def close(self) -> None:
        self.conn.close()


def vllm_server(address, authkey: bytes, replica_rank: int = 0) -> tuple[ActorHandle, ActorLoop]:
    """A Ray handle of verl's ``vLLMHttpServer`` for one replica, and the actor's loop (closing it
    closes the engine connection: the engine serves one client at a time)."""
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    async def build():
        server = vLLMHttpServer.__new__(vLLMHttpServer)
        server.engine = EngineClient(address, authkey)
        server.replica_rank, server.node_rank, server.global_steps = replica_rank, 0, None
        server._server_task = asyncio.ensure_future(asyncio.Event().wait())  # uvicorn's, on the actor's loop
        return server

    actor = ActorLoop()
    server = actor.run(build())
    actor.closers.append(server.engine.close)
    return ActorHandle(server, actor), actor
