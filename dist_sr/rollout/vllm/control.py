"""The control plane of a ``vllm serve`` engine: its weight-transfer routes over HTTP (vLLM's dev
mode, ``VLLM_SERVER_DEV_MODE=1``), for ``weightsync.trainer.sync.WeightSync``. The bare receiver
(``weightsync.engine.server``) serves the same routes.

Every control request is signed with the job's sync secret, and so are the transfer payloads
(``init_info``, the plan), which the loading worker checks itself (``weightsync.auth``)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from http.client import HTTPException

from ...weightsync import auth
from ...weightsync.control import TIMEOUT_S, EngineError, MalformedReply
from .check import check_engine

MAX_REPLY_BYTES = 256 << 20  # a fleet's largest answer (every worker's digests) is far smaller


def http(
    url: str,
    path: str,
    body: dict | None = None,
    *,
    timeout: float,
    method: str | None = None,
    secret: bytes | None = None,
) -> dict:
    """One JSON request; signed with ``secret`` when given (control routes). Returns the answer's
    JSON object (``{}`` for an empty body). Raises ``EngineError`` naming ``url`` for an HTTP error
    status, an engine that cannot be reached, closes the connection or times out, and
    ``MalformedReply`` for anything that is not an answer: a broken status line or headers, a body
    cut short, over ``MAX_REPLY_BYTES``, not UTF-8, not JSON or JSON other than an object."""
    data = None if body is None else json.dumps(body).encode()
    method = method or ("GET" if body is None else "POST")
    headers = {"content-type": "application/json"}
    if secret is not None:
        headers.update(auth.sign_request(secret, method, path, data or b""))
    where = f"{url.rstrip('/')}{path}"
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if resp.length is not None and resp.length > MAX_REPLY_BYTES:
                raise MalformedReply(f"{where}: an answer of {resp.length} bytes (the limit is {MAX_REPLY_BYTES})")
            raw = resp.read() if resp.length is not None else resp.read(MAX_REPLY_BYTES + 1)
    except urllib.error.HTTPError as exc:
        try:
            detail = exc.read().decode(errors="replace")[:2000]
        except (HTTPException, OSError, ValueError) as inner:
            detail = f"(its body cut short: {type(inner).__name__})"
        raise EngineError(f"{where}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, socket.timeout) as exc:
        raise EngineError(f"{where}: {getattr(exc, 'reason', exc)}") from None
    except (HTTPException, ValueError) as exc:  # BadStatusLine, IncompleteRead, LineTooLong, a bad chunk
        raise MalformedReply(f"{where}: not an HTTP answer: {type(exc).__name__}: {str(exc)[:200]}") from None
    except OSError as exc:
        raise EngineError(f"{where}: {exc}") from None
    if len(raw) > MAX_REPLY_BYTES:
        raise MalformedReply(f"{where}: an answer over {MAX_REPLY_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedReply(
            f"{where}: the answer is not UTF-8 ({exc.reason} at byte {exc.start} of {len(raw)})"
        ) from None
    if not text.strip():
        return {}
    try:
        answer = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedReply(f"{where}: the answer is not JSON ({exc.msg}): {text[:200]!r}") from None
    if not isinstance(answer, dict):
        raise MalformedReply(f"{where}: the answer is a JSON {type(answer).__name__}, not an object: {text[:200]!r}")
    return answer


HELD_FLOOR_BYTES_PER_S = 100e6  # the slowest read-back a worker may take (torch's digest under load)
_ITEM = {"bfloat16": 2, "float16": 2, "float32": 4}


def _bytes(entries: dict) -> int:
    total = 0
    for dtype, shape, _ in entries.values():
        n = _ITEM.get(dtype, 4)
        for d in shape:
            n *= int(d)
        total += n
    return total


def held_timeout(entries: dict, timeout_s: float) -> float:
    """Seconds the held-weights check of a model with digest ``entries`` may take: the control
    timeout, or the model's bytes at ``HELD_FLOOR_BYTES_PER_S`` (each worker reads its share back
    and digests it), whichever is longer."""
    return max(timeout_s, _bytes(entries) / HELD_FLOOR_BYTES_PER_S)


def worker_count(url: str, answer: dict) -> int:
    """``/get_world_size``'s answer as a worker count, or ``MalformedReply`` naming ``url``."""
    n = answer.get("world_size")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise MalformedReply(f"{url}/get_world_size answered {answer!r:.200}, not a worker count")
    return n


class VLLMControl:
    """``ControlPlane`` over one engine's base URL, signing with the sync secret (default: this
    process's, ``weightsync.auth.load``)."""

    def __init__(self, url: str, timeout_s: float = TIMEOUT_S, secret: bytes | None = None):
        self.name = url
        self.timeout_s = timeout_s
        self.secret = secret if secret is not None else auth.load()

    def _post(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        return http(
            self.name, path, body if body is not None else {}, timeout=timeout or self.timeout_s, secret=self.secret
        )

    def health(self) -> None:
        http(self.name, "/health", timeout=min(self.timeout_s, 10), method="GET")

    def world_size(self) -> int:
        return worker_count(self.name, http(self.name, "/get_world_size", timeout=self.timeout_s, secret=self.secret))

    def init_transfer(self, info: dict) -> None:
        info = {k: v for k, v in info.items() if k != "auth"}
        info["auth"] = auth.sign_payload(self.secret, "init_info", info)
        self._post("/init_weight_transfer_engine", {"init_info": info})

    def pause(self) -> None:
        self._post("/pause?mode=abort")

    def start_update(self) -> None:
        self._post("/start_weight_update")

    def update(self, plan: dict, timeout: float) -> None:
        signed = {"plan": plan, "auth": auth.sign_payload(self.secret, "plan", plan)}
        self._post("/update_weights", {"update_info": signed}, timeout=timeout)

    def finish(self, version: int) -> None:
        self._post("/finish_weight_update", {"weight_version": str(version)})

    def reset_cache(self) -> None:
        self._post("/reset_prefix_cache")

    def report(self) -> list[dict]:
        """Each worker's ``dist_sr_weight_report``; a worker that answers something else (vLLM
        passes on whatever the worker returned) is a ``MalformedReply``."""
        results = self._post("/collective_rpc", {"method": "dist_sr_weight_report"}).get("results")
        if not isinstance(results, list) or not all(
            isinstance(r, dict) and isinstance(r.get("digests", {}), dict) for r in results
        ):
            raise MalformedReply(
                f"{self.name}/collective_rpc: the workers' weight reports are {results!r:.300}, not "
                "reports (is the worker extension dist_sr.rollout.vllm.plugin.WorkerExtension?)"
            )
        return results

    def held(self, timeout: float | None = None) -> list[dict]:
        """Each worker's ``dist_sr_held_weights`` (``held.report``), every data-parallel engine's
        included; anything else is a ``MalformedReply``."""
        results = self._post("/collective_rpc", {"method": "dist_sr_held_weights"}, timeout).get("results")
        if not isinstance(results, list) or not all(isinstance(r, dict) and "digests" in r for r in results):
            raise MalformedReply(
                f"{self.name}/collective_rpc: the workers' held-weights records are {results!r:.300}, not records"
            )
        return results

    def held_problem(self, entries: dict) -> str | None:
        timeout = held_timeout(entries, self.timeout_s)
        try:
            answers = self.held(timeout)
        except EngineError as exc:
            raise type(exc)(
                f"{exc} (the held-weights check of {_bytes(entries) / 2**30:.2f} GiB had {timeout:.0f} s: "
                f"rollout.vllm.timeout_s or {HELD_FLOOR_BYTES_PER_S / 1e6:.0f} MB/s of the model's bytes, whichever "
                "is longer; raise rollout.vllm.timeout_s for an engine this busy)"
            ) from None
        check = check_engine(self.name, answers, entries)
        return None if check.ok else f"what its workers hold: {check.detail()}"

    def resume(self) -> None:
        self._post("/resume")


def controls(urls: list[str], timeout_s: float = TIMEOUT_S, secret: bytes | None = None) -> list[VLLMControl]:
    secret = secret if secret is not None else auth.load()
    return [VLLMControl(u, timeout_s, secret) for u in urls]
