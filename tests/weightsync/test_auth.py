"""Only the holder of the job's sync secret can change what a receiver holds: signed requests and
payloads, on real bare-receiver processes (real HTTP, real gloo); a bad request is a 4xx that
changes nothing; the trainer's store listens on its configured address only."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from dist_sr.numerics.digest import combine, tensor_sums
from dist_sr.rollout.vllm.control import VLLMControl, controls
from dist_sr.sources import ReplicatedSource
from dist_sr.testing.vllm_engines import REPO, free_port, start_receiver
from dist_sr.weightsync import auth
from dist_sr.weightsync.control import EngineError
from dist_sr.weightsync.trainer.sync import WeightSync
from dist_sr.weightsync.transport import open_store

SECRET = os.environ["DIST_SR_SYNC_SECRET"].encode()  # tests/conftest.py: this session's
OTHER = b"an-attacker-who-guessed-wrong-0123456789"


# ---- the signature scheme -----------------------------------------------------------------------
def test_a_signed_request_verifies_once_and_any_change_is_refused():
    v = auth.Verifier(SECRET)
    body = b'{"init_info": {}}'
    v.request("POST", "/update_weights", body, auth.sign_request(SECRET, "POST", "/update_weights", body))
    headers = auth.sign_request(SECRET, "POST", "/pause?mode=abort", body)
    for method, path, data, why in [
        ("POST", "/pause?mode=abort", body + b" ", "bad signature"),
        ("POST", "/pause?mode=keep", body, "bad signature"),
        ("PUT", "/pause?mode=abort", body, "bad signature"),
    ]:
        with pytest.raises(auth.AuthError, match=why):
            v.request(method, path, data, headers)
    v.request("POST", "/pause?mode=abort", body, headers)
    with pytest.raises(auth.AuthError, match="replayed"):
        v.request("POST", "/pause?mode=abort", body, headers)
    with pytest.raises(auth.AuthError, match="bad signature"):
        v.request("POST", "/x", b"", auth.sign_request(OTHER, "POST", "/x", b""))
    with pytest.raises(auth.AuthError, match="unauthenticated"):
        v.request("POST", "/x", b"", {})
    late = auth.Verifier(SECRET, clock=lambda: time.time() + 2 * auth.WINDOW_S)
    with pytest.raises(auth.AuthError, match="from this engine's clock"):
        late.request("POST", "/x", b"", auth.sign_request(SECRET, "POST", "/x", b""))


def test_payload_signatures_bind_every_field():
    v = auth.Verifier(SECRET)
    fields = {"master_address": "10.0.0.1", "master_port": 29600, "timeout_s": 30.0}
    sig = auth.sign_payload(SECRET, "init_info", fields)
    with pytest.raises(auth.AuthError, match="bad signature on init_info"):
        v.payload("init_info", {**fields, "master_address": "10.6.6.6"}, sig)
    with pytest.raises(auth.AuthError, match="bad signature on plan"):
        v.payload("plan", fields, sig)  # a signature is for one kind of payload
    with pytest.raises(auth.AuthError, match="unauthenticated init_info"):
        v.payload("init_info", fields, None)
    v.payload("init_info", fields, sig)
    with pytest.raises(auth.AuthError, match="replayed"):
        v.payload("init_info", fields, sig)


def test_the_secret_comes_from_env_or_file_and_is_never_optional(tmp_path, monkeypatch):
    with pytest.raises(auth.SecretMissing, match="DIST_SR_SYNC_SECRET"):
        auth.load({})
    with pytest.raises(auth.SecretMissing, match="at least 16"):
        auth.load({auth.ENV: "short"})
    f = tmp_path / "secret"
    f.write_text(auth.generate() + "\n")
    assert auth.load({auth.ENV_FILE: str(f)}) == f.read_text().strip().encode()
    with pytest.raises(auth.SecretMissing, match="cannot read"):
        auth.load({auth.ENV_FILE: str(tmp_path / "missing")})
    monkeypatch.delenv(auth.ENV)
    with pytest.raises(auth.SecretMissing, match="for the trainer and every engine"):
        controls(["http://127.0.0.1:1"])  # a trainer without the secret cannot drive a fleet


# ---- a real receiver ----------------------------------------------------------------------------
@pytest.fixture
def receiver():
    procs = []

    def start(*extra):
        p, url = start_receiver(*extra)
        procs.append(p)
        return p, url

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7)).to(torch.bfloat16)


def _raw(url, path, body: bytes, headers=None, method="POST"):
    req = urllib.request.Request(url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_without_the_secret_nobody_can_push_weights_and_what_the_receiver_holds_is_unchanged(receiver):
    """The issue's attack: a process that reaches the receiver's port points it at its own store
    and pushes weights. Every variant is refused with 401, and the receiver keeps reporting the
    trainer's version and digests."""
    _, url = receiver()
    model = _model()
    ws = WeightSync(ReplicatedSource(model), controls([url], 10), bucket_mb=0.002, timeout_s=10, group_port=free_port())
    assert ws.sync(1).ready == [url]
    before = VLLMControl(url, 10).report()
    assert before[0]["version"] == 1 and combine(tensor_sums(dict(model.named_parameters()))) == ws.last.digest

    attacker_port = free_port()
    store = open_store("127.0.0.1", attacker_port, is_master=True, timeout_s=5)  # the attacker's rendezvous
    init = {
        "master_address": "127.0.0.1",
        "master_port": attacker_port,
        "rank_offset": 1,
        "world_size": 2,
        "senders": 1,
        "generation": 1,
        "timeout_s": 5,
    }
    plan = ws.plan(999).to_json()
    for path, body in [
        ("/init_weight_transfer_engine", {"init_info": init}),
        ("/start_weight_update", {}),
        ("/update_weights", {"update_info": {"plan": plan}}),
        ("/finish_weight_update", {"weight_version": "999"}),
        ("/pause", {}),
        ("/collective_rpc", {"method": "dist_sr_weight_report"}),
    ]:
        code, reply = _raw(url, path, json.dumps(body).encode(), {"content-type": "application/json"})
        assert code == 401 and "unauthenticated" in reply["error"], (path, code, reply)
    with pytest.raises(EngineError, match="HTTP 401.*bad signature"):  # a wrong secret is no better
        VLLMControl(url, 10, secret=OTHER).init_transfer(init)
    # a captured, correctly signed request cannot be replayed
    body = json.dumps({"method": "dist_sr_weight_report"}).encode()
    headers = {"content-type": "application/json", **auth.sign_request(SECRET, "POST", "/collective_rpc", body)}
    assert _raw(url, "/collective_rpc", body, headers)[0] == 200
    code, reply = _raw(url, "/collective_rpc", body, headers)
    assert code == 401 and "replayed" in reply["error"]
    # a holder of the HTTP signature still needs the payload's own: an unsigned init_info is refused
    code, reply = _raw(
        url,
        "/init_weight_transfer_engine",
        json.dumps({"init_info": init}).encode(),
        auth.sign_request(SECRET, "POST", "/init_weight_transfer_engine", json.dumps({"init_info": init}).encode()),
    )
    assert code == 401 and "unauthenticated init_info" in reply["error"]
    assert VLLMControl(url, 10).report() == before
    assert store.num_keys() <= 1  # nobody came to the attacker's store
    # and the trainer's next sync still goes through the groups it built
    model[0].weight.data.add_(1)
    assert ws.sync(2).ready == [url] and VLLMControl(url, 10).report()[0]["version"] == 2


def test_bad_requests_get_a_4xx_naming_the_problem_and_change_nothing(receiver):
    _, url = receiver("--max-mb", "0.05", "--request-timeout", "1")
    model = _model()
    ws = WeightSync(ReplicatedSource(model), controls([url], 10), bucket_mb=0.002, timeout_s=10, group_port=free_port())
    assert ws.sync(1).ready == [url]
    before = VLLMControl(url, 10).report()

    def signed(path, body: bytes):
        return _raw(url, path, body, auth.sign_request(SECRET, "POST", path, body))

    assert signed("/start_weight_update", b"{not json")[0] == 400
    # an init the receiver cannot act on is refused, and its groups stay (the next sync works)
    c = VLLMControl(url, 10)
    init = {
        "master_address": "127.0.0.1",
        "master_port": ws.group_port,
        "rank_offset": 1,
        "world_size": 2,
        "senders": 1,
        "generation": 7,
        "timeout_s": 86400,
    }
    with pytest.raises(EngineError, match=r"HTTP 400.*timeout_s=86400.*\(0, 3600\]"):
        c.init_transfer(init)
    with pytest.raises(EngineError, match=r"HTTP 400.*rank_offset"):
        c.init_transfer({**init, "timeout_s": 5, "rank_offset": 2})
    # a plan beyond the receiver's budget is refused before anything is allocated
    big = {"version": 3, "senders": 1, "digest": True, "buckets": [[["w", "bfloat16", [2**40], [[0, 0, 2**40]]]]]}
    with pytest.raises(EngineError, match=r"HTTP 400.*2199023255552 bytes, over this engine's limit"):
        c.update(big, 10)
    with pytest.raises(EngineError, match=r"HTTP 400.*dtype 'int64'"):
        c.update({**big, "buckets": [[["w", "int64", [4], [[0, 0, 4]]]]]}, 10)
    # an oversized body is refused from its header, without being read
    code, reply = _raw(url, "/update_weights", b"{}", {"content-length": str(auth.MAX_BODY_BYTES + 1)})
    assert code == 413 and "limit" in reply["error"]
    # a client that stops mid-request is cut off after the request timeout; others are served meanwhile
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(b"POST /update_weights HTTP/1.1\r\nHost: x\r\n")
        assert urllib.request.urlopen(url + "/health", timeout=5).status == 200
        t0 = time.monotonic()
        assert s.recv(1024) == b"" and time.monotonic() - t0 < 5
    assert c.report() == before
    model[0].weight.data.add_(1)
    r = ws.sync(2)
    assert r.ready == [url] and r.attempts == 1  # through the groups it had: no rebuild was needed


def test_a_receiver_without_a_secret_does_not_start(receiver):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIST_SR_SYNC_SECRET")}
    p = subprocess.run(
        [sys.executable, "-m", "dist_sr.weightsync.engine.cli", "--port", str(free_port())],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0 and "no sync secret" in p.stderr and "DIST_SR_SYNC_SECRET" in p.stderr


def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp: hex IPv4, state 0A = LISTEN)."""
    out = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        ip, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            out.append(socket.inet_ntoa(bytes.fromhex(ip)[::-1]))
    return out


def test_the_weight_group_store_listens_on_the_configured_host_only():
    port = free_port()
    store = open_store("127.0.0.1", port, is_master=True, timeout_s=5)
    assert _listeners(port) == ["127.0.0.1"]
    client = open_store("127.0.0.1", port, is_master=False, timeout_s=5)
    client.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(RuntimeError, match="cannot listen on 10.255.255.1"):
        open_store("10.255.255.1", free_port(), is_master=True, timeout_s=5)  # not an address of this machine


def test_the_trainer_sees_an_engine_that_changed_after_it_was_verified(receiver):
    """Rollouts are trusted only from engines exactly as verified: a control event since the sync
    (even one signed with the secret) or a restart on the same address is reported by name."""
    _, a = receiver()
    pb, b = receiver()
    model = _model()
    ws = WeightSync(
        ReplicatedSource(model), controls([a, b], 10), bucket_mb=0.002, timeout_s=10, group_port=free_port()
    )
    assert ws.sync(1).ready == [a, b]
    assert ws.changed([a, b]) == []
    VLLMControl(a, 10).start_update()  # weights now partly open for loading
    (problem,) = ws.changed([a, b])
    assert problem.startswith(a) and "after weight sync 1 was verified" in problem
    port = int(b.rsplit(":", 1)[1])
    pb.kill()
    pb.wait()
    assert any(p.startswith(b) for p in ws.changed([b]))  # gone
    again, _ = start_receiver(port=port)
    try:
        (problem,) = ws.changed([b])  # back, but not the engine that was verified
        assert "restarted or changed" in problem
        r = ws.sync(2)  # the restarted one holds no groups: its update fails, it rejoins, both verified
        assert r.ready == [a, b] and r.attempts == 2 and any(b in p for p in r.problems)
        assert ws.changed([a, b]) == []
    finally:
        again.kill()
        again.wait()
