"""Versioned snapshots: complete sharded checkpoints, switched atomically, old ones pruned."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dist_sr.sources import ReplicatedSource
from dist_sr.weightsync.snapshot import write_snapshot
from tests.vllm_engines import save_tiny_model


def test_a_snapshot_reloads_bit_for_bit_and_current_moves_atomically(tmp_path):
    model_dir = save_tiny_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(model_dir)
    root = tmp_path / "snapshots"
    for version in (0, 1, 2):
        with torch.no_grad():
            model.lm_head.weight.add_(0.125)
        path = write_snapshot(ReplicatedSource(model), root, version, config=model.config, tokenizer=tok, bucket_mb=0.1)
        assert (root / "current").resolve() == path.resolve() == (root / f"v{version}").resolve()
    assert sorted(p.name for p in root.iterdir()) == ["current", "v1", "v2"]  # keep=2, no partial left
    assert len(list((root / "v2").glob("model-*.safetensors"))) > 1  # bucket by bucket
    again = AutoModelForCausalLM.from_pretrained(root / "current")
    assert again.dtype == torch.bfloat16
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), n
    assert AutoTokenizer.from_pretrained(root / "current").get_vocab() == tok.get_vocab()
