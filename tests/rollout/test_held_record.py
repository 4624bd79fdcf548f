"""The load record behind the ``dist_sr_held_weights`` RPC, on its own: every tensor handed to
``load_weights`` streams through unchanged and is digested as the engine stores it (its dtype,
round-to-nearest as vLLM's parameter copy casts). On a real engine: test_vllm_held_weights.py."""

import pytest
import torch

from dist_sr.numerics.digest import combine, tensor_sums
from dist_sr.rollout.vllm.held import load_record, record_loads, report


def test_the_record_digests_what_the_engine_stores_and_passes_the_tensors_on():
    g = torch.Generator().manual_seed(0)
    sent = {
        "model.embed_tokens.weight": torch.randn(5, 3, generator=g),
        "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
    }
    seen = []

    class Model(torch.nn.Module):
        def load_weights(self, weights):
            seen.extend(weights)
            return {n for n, _ in seen}

    model = Model()
    record = record_loads(model, torch.bfloat16)
    assert record_loads(model, torch.bfloat16) is record and load_record(model) is record  # installed once
    assert model.load_weights(iter(sent.items())) == set(sent)
    assert [(n, t) for n, t in seen] == list(sent.items()) and seen[0][1] is sent["model.embed_tokens.weight"]
    stored = {n: t.to(torch.bfloat16) for n, t in sent.items()}
    answer = report(model)
    assert answer["method"] == "recorded at load"
    assert answer["digests"] == {n: [d, list(shape), f"{v:016x}"] for n, (d, shape, v) in tensor_sums(stored).items()}
    assert answer["start"] == {"loader": None, "load_format": None, "pushes": 1}  # recorded outside a model loader
    assert answer["readback"] == {} and set(answer["unreadable"]) == set(sent)  # this model has no parameters
    # a later push of one tensor replaces that tensor's entry only
    update = torch.randn(5, 3, generator=g)
    model.load_weights([("model.embed_tokens.weight", update)])
    after = {**stored, "model.embed_tokens.weight": update.to(torch.bfloat16)}
    assert combine(record.entries) == combine(tensor_sums(after))

    def failing_load(weights):  # a load that raises part-way records nothing
        next(iter(weights))
        raise RuntimeError("the engine refused the weight")

    model.load_weights = record.wrap(failing_load)
    with pytest.raises(RuntimeError, match="refused"):
        model.load_weights([("model.norm.weight", torch.zeros(4))])
    assert combine(record.entries) == combine(tensor_sums(after))
