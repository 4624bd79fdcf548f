"""Only the trainer may change what a rollout engine serves: a shared secret per job authenticates
every control request and names the weight-transfer groups' store keys.

The secret comes from ``DIST_SR_SYNC_SECRET`` (the value) or ``DIST_SR_SYNC_SECRET_FILE`` (a file
holding it, e.g. a mounted Kubernetes Secret); ``dist-sr k8s`` generates one per rendered job.
Trainer and engines must hold the same secret; nothing that changes weights runs without it.

- **HTTP control requests** carry ``X-Dist-SR-Time``, ``X-Dist-SR-Nonce`` and
  ``X-Dist-SR-Signature`` = HMAC-SHA256 over method, path (with query), time, nonce and the body's
  SHA-256. A receiver accepts a request only with a valid signature, a time within ``WINDOW_S`` of
  its clock and a nonce it has not seen in that window (no replay); the compare is constant-time.
- **Transfer payloads** (``init_info``, the sync plan) carry their own signature, checked where the
  weights are loaded (the vLLM worker), so they hold even behind a server without the HTTP check.
- **The store's keys** live under a prefix derived from the secret: a process that reaches the
  trainer's store port without the secret cannot find or write the groups' keys. The bytes of the
  groups themselves are checked end to end: the trainer compares each engine's digest of what it
  loaded with its own before the engine serves (``sync.WeightSync._verify``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time

from .. import secret

ENV = "DIST_SR_SYNC_SECRET"
ENV_FILE = "DIST_SR_SYNC_SECRET_FILE"
MIN_BYTES = secret.MIN_BYTES  # shortest secret accepted
SecretMissing = secret.SecretMissing  # this process has no sync secret but needs one
WINDOW_S = 300.0  # a signed request is valid this long either side of the receiver's clock
MAX_BODY_BYTES = 64 * 2**20  # control bodies (a plan is ~100 bytes per tensor)
HEADER_TIME, HEADER_NONCE, HEADER_SIG = "X-Dist-SR-Time", "X-Dist-SR-Nonce", "X-Dist-SR-Signature"


class AuthError(PermissionError):
    """A control request or payload without a valid signature (HTTP 401)."""


def generate() -> str:
    """A fresh secret (64 hex characters)."""
    return secrets.token_hex(32)


def load(env=None, *, required: bool = True) -> bytes | None:
    """The sync secret from ``DIST_SR_SYNC_SECRET`` or ``DIST_SR_SYNC_SECRET_FILE``."""
    found = secret.read(ENV, what="sync secret", env=env)
    if found is None:
        if not required:
            return None
        raise SecretMissing(
            f"no sync secret: trainer and rollout engines authenticate weight pushes with a shared secret; set "
            f"{ENV} (e.g. export {ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))')) or "
            f"{ENV_FILE} to the same value for the trainer and every engine (dist-sr k8s renders a Secret)"
        )
    return found[0]


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"\n".join(parts), hashlib.sha256).hexdigest()


def store_prefix(secret: bytes) -> str:
    """The weight-transfer groups' key prefix in the trainer's store."""
    return "dist_sr/" + _mac(secret, b"dist-sr store prefix")[:32]


# ---- HTTP requests ------------------------------------------------------------------------------
def sign_request(secret: bytes, method: str, path: str, body: bytes) -> dict[str, str]:
    """Headers that authenticate one request (``path`` with its query string)."""
    t, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    sig = _mac(
        secret,
        b"http",
        method.upper().encode(),
        path.encode(),
        t.encode(),
        nonce.encode(),
        hashlib.sha256(body).hexdigest().encode(),
    )
    return {HEADER_TIME: t, HEADER_NONCE: nonce, HEADER_SIG: sig}


class Verifier:
    """Checks signed requests and payloads (thread-safe; one per receiving process)."""

    def __init__(self, secret: bytes, window_s: float = WINDOW_S, clock=time.time):
        self.secret, self.window_s, self.clock = secret, window_s, clock
        self._seen: dict[str, float] = {}  # nonce -> its time, while inside the window
        self._lock = threading.Lock()

    def _fresh(self, t: str, nonce: str) -> None:
        try:
            when = float(t)
        except (TypeError, ValueError):
            raise AuthError("missing or malformed signature time") from None
        now = self.clock()
        if abs(now - when) > self.window_s:
            raise AuthError(
                f"signature time is {now - when:+.0f}s from this engine's clock (allowed ±{self.window_s:.0f}s); "
                "sync the clocks (NTP) or re-sign"
            )
        if not isinstance(nonce, str) or not 16 <= len(nonce) <= 128:
            raise AuthError("missing or malformed nonce")
        with self._lock:
            for n, w in list(self._seen.items()):
                if abs(now - w) > self.window_s:
                    del self._seen[n]
            if nonce in self._seen:
                raise AuthError("replayed request (nonce already used)")
            self._seen[nonce] = when

    def request(self, method: str, path: str, body: bytes, headers) -> None:
        """Raise ``AuthError`` unless ``headers`` sign this request."""
        h = {str(k).lower(): v for k, v in headers.items()}
        t, nonce, sig = h.get(HEADER_TIME.lower()), h.get(HEADER_NONCE.lower()), h.get(HEADER_SIG.lower())
        if not sig:
            raise AuthError(f"unauthenticated: this route needs the {HEADER_SIG} header (the trainer's sync secret)")
        expected = _mac(
            self.secret,
            b"http",
            method.upper().encode(),
            path.encode(),
            str(t).encode(),
            str(nonce).encode(),
            hashlib.sha256(body).hexdigest().encode(),
        )
        if not hmac.compare_digest(expected, str(sig)):
            raise AuthError("bad signature: the request was not signed with this engine's sync secret")
        self._fresh(t, nonce)

    def payload(self, kind: str, fields: dict, auth) -> None:
        """Raise ``AuthError`` unless ``auth`` (from ``sign_payload``) signs ``fields``."""
        if not isinstance(auth, dict) or not auth.get("sig"):
            raise AuthError(f"unauthenticated {kind}: it carries no signature from the trainer's sync secret")
        expected = _mac(
            self.secret,
            b"payload",
            kind.encode(),
            str(auth.get("t")).encode(),
            str(auth.get("nonce")).encode(),
            _canonical(fields),
        )
        if not hmac.compare_digest(expected, str(auth["sig"])):
            raise AuthError(f"bad signature on {kind}: not signed with this engine's sync secret")
        self._fresh(auth.get("t"), auth.get("nonce"))


# ---- payloads (checked in the process that loads weights) -------------------------------------
def _canonical(fields: dict) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign_payload(secret: bytes, kind: str, fields: dict) -> dict:
    t, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    return {
        "t": t,
        "nonce": nonce,
        "sig": _mac(secret, b"payload", kind.encode(), t.encode(), nonce.encode(), _canonical(fields)),
    }
