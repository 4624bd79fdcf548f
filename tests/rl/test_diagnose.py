"""``dist-sr diagnose`` on a tiny checkpoint: real AdamW steps under round-to-nearest and under
SR from its BF16 cast, per parameter group, ending with the one-line verdict."""

import json
import re

import pytest

from dist_sr.launch.cli import main
from dist_sr.rl.diagnose import group_of

LAST = re.compile(
    r"^diagnose: RTN moves (\S+)% of BF16 weights per step, SR (\S+)%; (\S+)% of the update reaches BF16 "
    r"under RTN, (\S+)% under SR$"
)


@pytest.mark.parametrize(
    "name, group",
    [
        ("model.embed_tokens.weight", "embeddings"),
        ("model.layers.3.self_attn.q_proj.weight", "attention"),
        ("model.layers.3.mlp.down_proj.weight", "mlp"),
        ("model.layers.3.input_layernorm.weight", "norms"),
        ("model.norm.weight", "norms"),
        ("lm_head.weight", "head"),
        ("transformer.h.0.attn.c_attn.weight", "attention"),
    ],
)
def test_parameters_fall_into_their_groups(name, group):
    assert group_of(name) == group


def test_diagnose_on_a_tiny_checkpoint_shows_rtn_dropping_what_sr_carries(tmp_path, capsys):
    """A small lr next to weights of ~0.1 (half a BF16 spacing ~2e-4 against a step of ~1e-5): round-
    to-nearest from the grid moves only the smallest weights and carries a small share of the FP32
    update; SR carries it in expectation. Over ~80k weights SR's share has a relative spread of about
    sqrt(spacing / update / n) ~ 2%, so [0.8, 1.2] is a wide margin."""
    pytest.importorskip("gguf", reason="the gguf package (bash scripts/setup.sh rl smollm2 dev)")
    from .gguf_files import tiny_llama, write_gguf

    path = write_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    samples = tmp_path / "samples.jsonl"
    samples.write_text(
        "".join(json.dumps({"prompt": f"What is {a} + {b}?", "completion": str(a + b)}) + "\n" for a, b in [(3, 4)] * 4)
        + json.dumps({"prompt": "What is 9 + 9?", "completion": "18"})
        + "\n"
    )
    out = tmp_path / "out"
    args = [str(path), "--lr", "1e-5", "--steps", "3", "--batch", "4", "--samples", str(samples)]
    rc = main(["diagnose", *args, "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out.strip().splitlines()
    m = LAST.match(printed[-1])
    assert m, printed[-1]
    rtn_moved, sr_moved, rtn_reach, sr_reach = (float(v) for v in m.groups())
    assert rtn_moved < sr_moved and rtn_reach < 50 and 80 < sr_reach < 120
    assert any(line.startswith("advice: ") for line in printed)
    data = json.loads((out / "diagnose.json").read_text())
    assert data["last_line"] == printed[-1] and data["steps"] == 3
    assert set(data["groups"]) == {"embeddings", "attention", "mlp", "norms", "head"}
    total = sum(g["params"] for g in data["groups"].values())
    assert total == data["overall"]["params"] == sum(p.numel() for p in tiny_llama().parameters())
    for g in data["groups"].values():
        assert len(g["moved_by_step"]["rtn"]) == 3
        assert g["rtn_moved_once"] >= max(g["moved_by_step"]["rtn"])  # moved in a step: moved at least once
    assert data["overall"]["rtn_steps_to_move_median"] > 3  # the median weight has not moved in 3 steps
    assert (out / "diagnose.png").stat().st_size > 0


def test_diagnose_refuses_samples_that_are_not_prompt_completion_lines(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello"}\n')
    args = ["--samples", str(bad), "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    assert main(["diagnose", "smollm2", "--lr", "1e-6", *args]) == 2  # before any loading
    assert "line 1 is not a JSON object" in capsys.readouterr().err
