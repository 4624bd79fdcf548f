"""``cpu_matmul: fp32-accumulate``: a BF16/FP16 product on the CPU is the FP32 GEMM of its widened
operands rounded once to the working dtype, forward and backward, and nothing else changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_sr.rl.config import ConfigError, load_experiment
from dist_sr.rl.cpu_math import cpu_matmul

from .conftest import EASY


def _rounded(a: torch.Tensor, b: torch.Tensor, dtype) -> torch.Tensor:
    return (a.float() @ b.float()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_product_is_the_fp32_gemm_rounded_once_and_so_are_its_gradients(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).to(dtype).requires_grad_()
    w = torch.randn(48, 64, generator=g).to(dtype).requires_grad_()
    b = torch.randn(48, generator=g).to(dtype).requires_grad_()
    up = torch.randn(3, 5, 48, generator=g).to(dtype)
    with cpu_matmul("fp32-accumulate"):
        y = F.linear(x, w, b)
        y.backward(up)
    assert y.dtype == dtype
    assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).to(dtype))
    flat_x, flat_up = x.detach().reshape(-1, 64), up.reshape(-1, 48)
    assert torch.equal(x.grad, _rounded(flat_up, w.detach(), dtype).reshape(x.shape))
    assert torch.equal(w.grad, _rounded(flat_up.T, flat_x, dtype))
    with cpu_matmul("fp32-accumulate"):  # batched products and attention as well
        q, k, v = (torch.randn(2, 3, 7, 16, generator=g).to(dtype) for _ in range(3))
        assert torch.equal(q @ k.transpose(-1, -2), (q.float() @ k.float().transpose(-1, -2)).to(dtype))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(dtype)
        assert att.dtype == dtype and torch.equal(att, want)


def test_fp32_products_and_the_native_setting_are_left_alone():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=g), torch.randn(64, 16, generator=g)
    with cpu_matmul("fp32-accumulate"):
        assert torch.equal(a @ b, torch.mm(a, b))
    lo, hi = a.bfloat16(), b.bfloat16()
    with cpu_matmul("native"):
        native = lo @ hi
    assert torch.equal(native, torch.mm(lo, hi))


def test_an_unknown_setting_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"cpu_matmul must be one of \['native', 'fp32-accumulate'\]"):
        load_experiment({**EASY, "cpu_matmul": "fast"})


def test_a_run_trains_with_it_and_records_it(easy, tmp_path):
    from dist_sr.rl.trainer import train

    cfg = easy(**{"precision": "bf16-sr", "grpo.steps": 2, "eval.every": 2, "cpu_matmul": "fp32-accumulate"})
    metrics = train(cfg, progress=False)
    assert "cpu_matmul: fp32-accumulate" in (metrics.parent / "config.yaml").read_text()
    assert metrics.read_text().count('"step"') == 3
    native = easy(**{"precision": "bf16-sr", "grpo.steps": 2, "eval.every": 2, "output_dir": str(tmp_path / "n")})
    with pytest.raises(ConfigError, match="cpu_matmul"):  # a resume may not change how products round
        train(load_experiment({**_as_dict(native), "output_dir": str(metrics.parent)}), progress=False, resume=True)


def _as_dict(cfg):
    import yaml

    from dist_sr.rl.config import to_dict

    return yaml.safe_load(yaml.safe_dump(to_dict(cfg)))
