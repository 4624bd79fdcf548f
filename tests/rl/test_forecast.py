"""``dist-sr diagnose --forecast``: the share of a checkpoint round-to-nearest would leave stuck,
predicted from the weights alone, streamed a block at a time, and bounding what a measured
diagnosis of the same checkpoint finds."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from dist_sr.launch.cli import main
from dist_sr.rl import forecast


def _exact(tensors: dict[str, torch.Tensor], lr: float, steps: int) -> tuple[float, float]:
    """The shares by definition, element by element: half the BF16 spacing at each BF16 weight."""
    w = torch.cat([t.reshape(-1).to(torch.bfloat16).double() for t in tensors.values()])
    e = torch.floor(torch.log2(w.abs().clamp(min=2.0**-126)))
    h = torch.exp2(e - 8)
    h = torch.where((w.abs() == torch.exp2(e)) & (e > -126), h / 2, h)  # a power of two: nearer below
    return float((h < lr).double().mean()), float((h < steps * lr).double().mean())


def test_a_streamed_forecast_equals_the_definition_whatever_the_block(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g) * 0.05,
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=g) * 0.5,
        "model.layers.0.input_layernorm.weight": 1 + 0.01 * torch.randn(64, generator=g),
        "model.norm.weight": torch.zeros(64),  # zeros always move: their spacing is the smallest
        "model.layers.0.post_attention_layernorm.weight": torch.ones(64),  # powers of two: half below
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for lr in (1e-4, 7e-4):  # 7e-4: the ones move down within 4 steps (2^-9 < 4 lr), not up (2^-8 > 4 lr)
        step1, within = _exact(tensors, lr, 4)
        for chunk in (256, 4096, 1 << 30):  # a row, a few rows, whole tensors
            f = forecast.forecast(tmp_path, lr=lr, steps=4, chunk_bytes=chunk, progress=False)
            assert math.isclose(f.overall.can_move_step1, step1, abs_tol=1e-12)
            assert math.isclose(f.overall.can_move_within, within, abs_tol=1e-12)
        assert f.overall.params == sum(t.numel() for t in tensors.values()) and f.tensors == 5
        assert set(f.groups) == {"embeddings", "mlp", "norms"}
    f = forecast.forecast(tmp_path, lr=1e-4, steps=4, progress=False)
    assert f.groups["norms"].can_move_within > f.groups["mlp"].can_move_within  # zeros, ~1, 1 vs ~0.5: mixed


def test_the_forecast_bounds_what_the_measured_diagnosis_finds(tmp_path, capsys):
    """On the same checkpoint, lr and steps: no more weights move in the first step than can move,
    no more move at least once than can move within the steps, and the median weight takes at
    least the predicted steps. Both are printed side by side."""
    pytest.importorskip("gguf", reason="the gguf package (bash scripts/setup.sh rl smollm2 dev)")
    from .gguf_files import tiny_llama, write_gguf

    path = write_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    args = [str(path), "--lr", "1e-5", "--steps", "3", "--batch", "4", "--forecast", "--compare"]
    assert main(["diagnose", *args, "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "measured RTN step 1" in printed and "measured moved once" in printed
    data = json.loads((out / "forecast.json").read_text())
    predicted, measured = data["forecast"]["overall"], data["measured"]["overall"]
    assert measured["moved_by_step"]["rtn"][0] <= predicted["can_move_step1"]
    assert measured["rtn_moved_once"] <= predicted["can_move_within"]
    assert measured["rtn_steps_to_move_median"] >= predicted["steps_to_move_median"] / 2  # exponent resolution
    for group, p in data["forecast"]["groups"].items():
        assert data["measured"]["groups"][group]["rtn_moved_once"] <= p["can_move_within"], group
    assert printed.strip().splitlines()[-1] == data["last_line"]


def test_forecast_refuses_a_file_that_is_not_safetensors(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(forecast.ConfigError, match="safetensors"):
        forecast.forecast(path, lr=1e-5)
