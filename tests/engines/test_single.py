"""The one-process engine's checkpoints: verified on load, never replaced by a bad state, and
read without unpickling code."""

import pytest
import torch

from dist_sr.engines.base import TrainSettings
from dist_sr.engines.checkpoints import CheckpointCorrupt
from dist_sr.engines.config import DistributedConfig
from dist_sr.engines.single import SingleEngine
from dist_sr.precision import PrecisionConfig
from tests.engines.models import tiny_qwen2


def engine(precision="bf16-sr"):
    return SingleEngine(
        TrainSettings(precision=PrecisionConfig(precision, seed=3), distributed=DistributedConfig(), lr=1e-2),
        tiny_qwen2(),
    )


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


def _tamper(path, edit, fix_digest):
    from dist_sr.engines.checkpoints import state_digest

    state = torch.load(path, weights_only=True)
    edit(state)
    if fix_digest:
        state.pop("content_sha256")
        state["content_sha256"] = state_digest(state)
    torch.save(state, path)


def _flip_moment(state):
    inner = state["precision"]["optimizer"]["inner"]["state"]
    next(iter(inner.values()))["exp_avg_sq"].view(torch.int32).view(-1)[3] ^= 1 << 30


def _flip_shadow(state):
    state["precision"]["optimizer"]["shadows"]["lm_head.weight"].view(torch.int32).view(-1)[4] ^= 1 << 20


def test_a_flipped_bit_anywhere_in_the_state_is_refused(tmp_path):
    """An optimizer moment is not part of the weights' digest; the content digest covers it."""
    trained().save(tmp_path, 2)
    _tamper(tmp_path / "checkpoint.pt", _flip_moment, fix_digest=False)
    with pytest.raises(CheckpointCorrupt, match="checkpoint.pt: content digest differs"):
        engine().load(tmp_path)


def test_shadows_that_do_not_round_to_the_saved_weights_are_refused(tmp_path):
    """A consistent-looking file (its content digest recomputed) whose shadows were changed."""
    trained().save(tmp_path, 2)
    _tamper(tmp_path / "checkpoint.pt", _flip_shadow, fix_digest=True)
    with pytest.raises(CheckpointCorrupt, match="working weights re-derived from the shadows differ"):
        engine().load(tmp_path)


def test_a_corrupted_latest_falls_back_to_the_previous_checkpoint_and_says_so(tmp_path):
    eng = trained(2)
    eng.save(tmp_path, 2)
    ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(8))
    eng.backward(eng.module(input_ids=ids, labels=ids).loss)
    eng.step()
    eng.save(tmp_path, 3)
    assert (tmp_path / "checkpoint.prev.pt").exists()
    _tamper(tmp_path / "checkpoint.pt", _flip_moment, fix_digest=False)
    again = engine()
    with pytest.warns(
        RuntimeWarning,
        match=r"resuming from .*checkpoint.prev.pt \(step 2\); refused newer .*: "
        r"checkpoint.pt: .*content digest differs",
    ):
        assert again.load(tmp_path) == 2
    assert again.digest() == again.expected_digest()


def test_a_non_finite_state_is_never_saved(tmp_path):
    eng = trained()
    eng.save(tmp_path, 2)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    with torch.no_grad():
        next(iter(eng.precision.optimizer.inner.state.values()))["exp_avg"].view(-1)[0] = float("nan")
    with pytest.raises(RuntimeError, match="not saving step 3: non-finite values in"):
        eng.save(tmp_path, 3)
    assert (tmp_path / "checkpoint.pt").read_bytes() == before


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
    with pytest.raises(CheckpointCorrupt, match="Weights only load failed"):
        engine().load(tmp_path)
    assert not marker.exists()


class Exploit:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
