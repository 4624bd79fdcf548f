"""The control plane's HTTP calls against engines that answer badly (``tests/bad_engines.py``:
real sockets): every reply that is not an answer is a ``MalformedReply`` naming the engine's URL
and what was wrong, never a raw ``http.client``, ``UnicodeDecodeError`` or ``KeyError``."""

import re

import pytest

from dist_sr.rollout.vllm.control import VLLMControl, http
from dist_sr.rollout.vllm.native import SignedClient
from dist_sr.weightsync.control import EngineError, MalformedReply
from tests.bad_engines import REPLIES, BadEngine

SECRET = b"s" * 32


@pytest.mark.parametrize("kind", sorted(REPLIES))
def test_every_reply_that_is_not_an_answer_names_the_engine_and_what_was_wrong(kind):
    bad = BadEngine(kind)
    control, client = VLLMControl(bad.url, 5, SECRET), SignedClient(bad.url, SECRET, timeout_s=5)
    calls = {
        "world_size": control.world_size,
        "report": control.report,
        "signed world_size": client.world_size,
        "held weights": client.held_weights,
    }
    if kind != "wrong-json":  # a JSON object these routes do not read is still an answer to them
        calls.update(health=control.health, pause=control.pause)
        calls["init"] = lambda: client.init_weight_transfer_engine({"master_address": "127.0.0.1", "rank_offset": 1})
        calls.update(  # every route of vLLM's client protocol
            start=client.start_weight_update,
            update=lambda: client.update_weights({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}),
            finish=lambda: client.finish_weight_update("7"),
            shutdown=client.shutdown_weight_transfer_engine,
        )
    try:
        for what, call in calls.items():
            with pytest.raises(MalformedReply) as refused:
                call()
            message = str(refused.value)
            assert message.startswith(bad.url) and re.search(bad.expect, message), (what, message)
    finally:
        bad.close()


def test_an_engine_that_hangs_up_is_an_engine_error_naming_it():
    from tests.bad_engines import HANG_UP

    bad = BadEngine("banner")
    bad.reply = HANG_UP
    try:
        with pytest.raises(EngineError, match=re.escape(bad.url)) as refused:
            http(bad.url, "/health", timeout=5)
        assert not isinstance(refused.value, MalformedReply)
    finally:
        bad.close()
