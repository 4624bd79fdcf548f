"""The one-process engine's checkpoints: verified on load, never replaced by a bad state, and
read without unpickling code."""

import pytest
import torch

from dist_sr.engines.base import TrainSettings
from dist_sr.engines.config import DistributedConfig
from dist_sr.engines.single import SingleEngine
from dist_sr.precision import PrecisionConfig
from tests.engines.models import tiny_qwen2


def engine(precision="bf16-sr"):
    return SingleEngine(TrainSettings(precision=PrecisionConfig(precision, seed=3), distributed=DistributedConfig(),
                                      lr=1e-2), tiny_qwen2())


def trained(steps=2):
    eng = engine()
    ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(7))
    for _ in range(steps):
        eng.backward(eng.module(input_ids=ids, labels=ids).loss)
        eng.step()
    return eng


def test_a_checkpoint_loads_back_to_the_same_bits(tmp_path):
    eng = trained()
    eng.save(tmp_path, 2)
    again = engine()
    assert again.load(tmp_path) == 2
    assert again.digest() == again.expected_digest() == eng.digest()


def test_a_tampered_shadow_in_the_checkpoint_is_refused(tmp_path):
    """A flipped bit in a stored FP32 shadow re-derives other working weights than were saved."""
    trained().save(tmp_path, 2)
    path = tmp_path / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    shadow = state["precision"]["optimizer"]["shadows"]["lm_head.weight"]
    shadow.view(torch.int32).view(-1)[4] ^= 1 << 20
    torch.save(state, path)
    with pytest.raises(RuntimeError, match="checkpoint.pt: working weights re-derived from the shadows differ"):
        engine().load(tmp_path)


def test_a_state_whose_weights_left_their_shadows_is_not_saved(tmp_path):
    eng = trained()
    eng.save(tmp_path, 2)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    with torch.no_grad():
        eng.module.lm_head.weight.view(torch.int16)[0, 0] ^= 1
    assert eng.digest() != eng.expected_digest()
    with pytest.raises(RuntimeError, match="not saving step 3: the working weights .* are not the keyed rounding"):
        eng.save(tmp_path, 3)
    assert (tmp_path / "checkpoint.pt").read_bytes() == before and not (tmp_path / "checkpoint.pt.tmp").exists()


def test_a_checkpoint_that_would_run_code_on_load_is_refused(tmp_path):
    """``weights_only``: a pickle carrying a callable is rejected, never executed."""
    marker = tmp_path / "ran"
    torch.save({"step": 1, "payload": Exploit(str(marker))}, tmp_path / "checkpoint.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        engine().load(tmp_path)
    assert not marker.exists()


class Exploit:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
