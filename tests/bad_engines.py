"""Engines that answer badly, over real sockets: what a trainer must survive from an engine that
is killed mid-answer, is not an HTTP server at all, or answers in the wrong encoding or shape.
A test harness: it lives with the tests, not in the package."""

from __future__ import annotations

import http.client
import socket
import threading


def _reply(body: bytes, *, length: int | None = None, status: bytes = b"200 OK") -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (len(body) if length is None else length)
    return head + body


# kind -> (the raw bytes sent back, what the trainer's error must say)
REPLIES = {
    "banner": (b"SSH-2.0-OpenSSH_9.6\r\n", "BadStatusLine"),
    "not-utf8": (_reply(b'{"world_size": "\xff\xfe"}'), "not UTF-8"),
    "cut-short": (_reply(b'{"world_size": 1, "resu', length=400), "IncompleteRead"),
    "not-json": (_reply(b"<html>engine restarting</html>"), "not JSON"),
    "json-list": (_reply(b"[1, 2, 3]"), "not an object"),
    "wrong-json": (
        _reply(b'{"world_size": "two", "results": {"rank": 0}}'),
        "not a worker count|not reports|not records",
    ),
}
HANG_UP = b""  # closes without a word: a connection error, not a malformed reply


class BadEngine:
    """A listening socket that answers every request whose path starts with ``on`` (every request
    when None) with ``REPLIES[kind]`` and closes. Other requests are passed to ``upstream`` (a
    real engine or receiver, by ``host:port``) and its answer relayed, or answered well-formed
    (``/get_world_size``: one worker; anything else: ``{}``)."""

    def __init__(self, kind: str, on: str | None = None, upstream: str | None = None):
        self.reply, self.expect = REPLIES[kind]
        self.on, self.upstream = on, upstream
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
            length = int(headers.get("Content-Length", headers.get("content-length", "0")))
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            self.requests.append(path)
            if self.on is None or path.startswith(self.on):
                if self.upstream is not None:  # the engine did the work; its answer is what breaks
                    self._relay(method, path, headers, body)
                conn.sendall(self.reply)
            elif self.upstream is not None:
                conn.sendall(self._relay(method, path, headers, body))
            else:
                conn.sendall(_reply(b'{"world_size": 1}' if path.startswith("/get_world_size") else b"{}"))

    def _relay(self, method: str, path: str, headers: dict, body: bytes) -> bytes:
        c = http.client.HTTPConnection(self.upstream, timeout=600)
        keep = {k: v for k, v in headers.items() if k.lower() not in ("host", "connection")}
        c.request(method, path, body=body or None, headers=keep)
        r = c.getresponse()
        data = r.read()
        c.close()
        return _reply(data, status=f"{r.status} {r.reason}".encode())

    def close(self) -> None:
        self.sock.close()
