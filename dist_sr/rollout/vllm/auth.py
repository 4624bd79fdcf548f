"""An ASGI middleware for ``vllm serve`` that lets only the trainer reach the routes that change
what the engine serves: ``--middleware dist_sr.rollout.vllm.auth.SyncAuthMiddleware``.

vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``, needed for the weight routes) also opens
``/collective_rpc``, ``/sleep``, ``/reset_prefix_cache`` and more, none of them authenticated.
This middleware refuses every route outside the inference API unless the request is signed with
the job's sync secret (``weightsync.auth``): 401 with the reason, and the request never reaches
vLLM. Inference (``/v1/...`` except LoRA loading), health and metrics stay as vLLM serves them
(protect inference with vLLM's own ``--api-key`` if it needs it). The engine refuses to start
without a secret.
"""

from __future__ import annotations

import json

from ...weightsync import auth

PUBLIC_PREFIXES = ("/v1/", "/v2/", "/inference/", "/cohere/")
PUBLIC_PATHS = frozenset(
    {
        "/health",
        "/ping",
        "/version",
        "/metrics",
        "/load",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/docs",
        "/redoc",
        "/openapi.json",
    }
)
GUARDED_PUBLIC = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})  # change the served weights


def is_public(path: str) -> bool:
    path = "/" + path.lstrip("/")
    if path in GUARDED_PUBLIC:
        return False
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


class SyncAuthMiddleware:
    def __init__(self, app, secret: bytes | None = None):
        self.app = app
        self.verifier = auth.Verifier(secret if secret is not None else auth.load())

    async def _reply(self, send, code: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] not in ("http", "websocket")
            or scope.get("method") == "OPTIONS"
            or is_public(scope.get("path", ""))
        ):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # no control route is a websocket
            return await send({"type": "websocket.close", "code": 1008})
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > auth.MAX_BODY_BYTES:
                return await self._reply(send, 413, f"control request body over {auth.MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        raw = scope.get("raw_path") or scope["path"].encode()
        path = raw.decode("latin-1") + (
            ("?" + scope["query_string"].decode("latin-1")) if scope.get("query_string") else ""
        )
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            self.verifier.request(scope["method"], path, body, headers)
        except auth.AuthError as exc:
            return await self._reply(send, 401, str(exc))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
