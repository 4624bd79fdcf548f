"""``dist-sr diagnose CHECKPOINT --lr LR``: does round-to-nearest stick on this checkpoint at this
learning rate, and does stochastic rounding fix it? Measured, not modelled.

The checkpoint (a GGUF file, a Hugging Face directory, or ``smollm2``) is cast to BF16 as a run
would start from it (``checkpoint.bf16_start``). From that start the same batches train it twice
for ``steps`` real AdamW steps on FP32 shadows with the project's optimizer wrapper
(``ShadowAdamW``, one fused pass per step): once rounding as precision ``bf16`` does
(round-to-nearest) and once as ``bf16-sr`` does (the keyed stochastic rounding of
``dist_sr.numerics``). The batches are supervised targets: the built-in
task's right answers in the model's chat format, or the user's ``{"prompt", "completion"}`` lines.

Per parameter group (embeddings, attention, MLP, norms, head, other) and overall it reports:

- moved/step: the share of BF16 weights whose bits change in a step (mean over the steps);
- reaches BF16: the share of the FP32 shadows' net movement the BF16 weights follow,
  ``<dW, dS> / <dS, dS>`` after the last step (``StickingMeter``'s ``1 - unfollowed_frac``):
  ~100% is unbiased, ~0% is stuck;
- steps until round-to-nearest first moves the median weight: for each weight, half the BF16
  spacing at its start value over its net FP32 drift per step (``|S_k - S_0| / k``), the median
  over the group; a lower bound where updates change sign from step to step;
- moved at least once: the share of BF16 weights round-to-nearest changed in any of the steps.

Output: a table, ``diagnose.json``, ``diagnose.png``, and as the last line
``diagnose: RTN moves X% of BF16 weights per step, SR Y%; Z% of the update reaches BF16 under
RTN, W% under SR``.
"""

from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import ConfigError
from ..engines import training_device
from ..optim import ShadowAdamW
from ..optim.metrics import bf16_spacing
from ..precision import PRECISION_REGISTRY
from .checkpoint import bf16_start, source_note
from .grpo import sequence_logits, token_logprobs
from .model import load_pretrained
from .tasks import ChatArithmetic, chat_prompt

GROUPS = ("embeddings", "attention", "mlp", "norms", "head", "other")
MODES = (("rtn", "bf16"), ("sr", "bf16-sr"))  # (short name, precision)
LOG_BINS = 400  # histogram of log10(steps) over [0, 10): the median's resolution is 10^(10/400) ~ 6%


def group_of(name: str) -> str:
    """The parameter group of a parameter name (transformers naming: Llama, Qwen2, GPT-2 ...)."""
    n = name.lower()
    if "lm_head" in n or n.startswith("output.") or n == "output.weight":
        return "head"
    if "embed" in n or ".wte." in n or ".wpe." in n:
        return "embeddings"
    if "norm" in n or ".ln_" in n:
        return "norms"
    if "attn" in n or "attention" in n:
        return "attention"
    if "mlp" in n or "ffn" in n or "feed_forward" in n:
        return "mlp"
    return "other"


@dataclass
class GroupResult:
    params: int = 0
    median_abs_weight: float = 0.0
    moved_per_step: dict[str, float] = field(default_factory=dict)  # mode -> mean share per step
    moved_by_step: dict[str, list[float]] = field(default_factory=dict)  # mode -> share per step
    reaches_bf16: dict[str, float | None] = field(default_factory=dict)  # mode -> <dW,dS>/<dS,dS>
    rtn_moved_once: float = 0.0
    rtn_steps_to_move_median: float | None = None  # None: the median weight did not drift at all


@dataclass
class Diagnosis:
    checkpoint: str
    model: str
    lr: float
    steps: int
    batch: int
    data: str
    groups: dict[str, GroupResult]
    overall: GroupResult
    tied_head: bool
    advice: str

    def last_line(self) -> str:
        o = self.overall
        return (
            f"diagnose: RTN moves {pct(o.moved_per_step['rtn'])} of BF16 weights per step, SR "
            f"{pct(o.moved_per_step['sr'])}; {pct(o.reaches_bf16['rtn'])} of the update reaches BF16 under RTN, "
            f"{pct(o.reaches_bf16['sr'])} under SR"
        )


def pct(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.2f}%" if abs(v) < 0.1 else f"{100 * v:.1f}%"


def read_samples(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from a JSONL file of ``{"prompt": ..., "completion": ...}``."""
    rows = []
    p = Path(path)
    if not p.exists():
        raise ConfigError(f'--samples {p}: no such file; give a JSONL file of {{"prompt": ..., "completion": ...}}')
    for i, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((str(row["prompt"]), str(row["completion"])))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(
                f'--samples {p}: line {i + 1} is not a JSON object with "prompt" and "completion"'
            ) from None
    if not rows:
        raise ConfigError(f"--samples {p}: no samples")
    return rows


def make_batches(tokenizer, steps: int, batch: int, seed: int, samples: list[tuple[str, str]] | None):
    """``steps`` batches of (prompt, target) text: the user's samples (cycled, prompts put in the
    chat template when the tokenizer has one) or the built-in task's right answers."""
    rng = random.Random(seed)
    chat = bool(getattr(tokenizer, "chat_template", None))
    out = []
    for _ in range(steps):
        if samples is None:
            if not chat:
                raise ConfigError(
                    "the built-in task asks in the model's chat template and this tokenizer has none; "
                    "give --samples FILE.jsonl"
                )
            task = ChatArithmetic(1, tokenizer=tokenizer, question="What is {a} + {b}? Answer with the number only.")
            out.append([(e.prompt, e.answer) for e in (task.sample(rng) for _ in range(batch))])
        else:
            picked = [samples[rng.randrange(len(samples))] for _ in range(batch)]
            out.append([(chat_prompt(tokenizer, p) if chat else p, c) for p, c in picked])
    return out


def _encode(tokenizer, pairs: list[tuple[str, str]]):
    from ..rollout.base import encode_prompts
    from .warmup import encode_targets

    ids, mask = encode_prompts(tokenizer, [p for p, _ in pairs])
    tgt, tgt_mask = encode_targets(tokenizer, [c for _, c in pairs])
    return ids, mask, tgt, tgt_mask


def _loss(model, enc) -> torch.Tensor:
    ids, mask, tgt, tgt_mask = enc
    logp = token_logprobs(sequence_logits(model, ids, mask, tgt, tgt_mask), tgt)
    return -(logp * tgt_mask).sum() / tgt_mask.sum()


class _Histogram:
    """Counts of log10(steps) in LOG_BINS bins over [0, 10), and of weights that never move."""

    def __init__(self):
        self.counts = torch.zeros(LOG_BINS, dtype=torch.float64)
        self.never = 0

    def add(self, steps: torch.Tensor) -> None:
        finite = torch.isfinite(steps)
        self.never += int((~finite).sum())
        logs = steps[finite].clamp(1.0, 9.999e9).log10()
        self.counts += torch.histc(logs.double(), bins=LOG_BINS, min=0.0, max=10.0)

    def merge(self, other: _Histogram) -> None:
        self.counts += other.counts
        self.never += other.never

    def median(self) -> float | None:
        total = float(self.counts.sum()) + self.never
        cum = torch.cumsum(self.counts, 0)
        idx = int(torch.searchsorted(cum, torch.tensor(total / 2, dtype=torch.float64)))
        if idx >= LOG_BINS:
            return None  # more than half never drift
        return 10 ** ((idx + 0.5) * 10 / LOG_BINS)


@dataclass
class _ParamStats:
    """One parameter after a trajectory: what the report needs, not the tensors (so a large model's
    diagnosis holds one trajectory's state at a time)."""

    numel: int
    dot: float  # <W_k - W_0, S_k - S_0>
    norm2: float  # <S_k - S_0, S_k - S_0>
    moved: list[int]  # BF16 elements changed at each step
    moved_once: int  # elements changed at any step
    steps_to_move: _Histogram  # half the BF16 spacing at W_0 over the net FP32 drift per step


def _trajectory(model, precision: str, batches, lr: float, progress: bool, desc: str) -> dict[str, _ParamStats]:
    """Train a copy of ``model`` (FP32 values on the BF16 grid: W_0 = S_0) under ``precision`` on
    ``batches`` and reduce each parameter to ``_ParamStats``."""
    device = training_device()  # a GPU when there is one: the same code for a large checkpoint
    m = copy.deepcopy(model).to(device)  # BF16 working weights; their FP32 shadows start equal
    opt = ShadowAdamW(m.named_parameters(), lr=lr, weight_decay=0.0, mode=PRECISION_REGISTRY[precision].rounding)
    triples = opt.named_shadows()
    prev = [w.detach().clone() for _, w, _ in triples]
    ever = [torch.zeros(w.shape, dtype=torch.bool, device=w.device) for _, w, _ in triples]
    moved: list[list[int]] = [[] for _ in triples]
    for enc in tqdm(batches, desc=desc, disable=not progress, leave=False):
        loss = _loss(m, [t.to(device) for t in enc])
        opt.zero_grad()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        for i, (_, w, _) in enumerate(triples):
            changed = prev[i].view(torch.int16) != w.detach().view(torch.int16)
            moved[i].append(int(changed.sum()))
            ever[i] |= changed
            prev[i].copy_(w.detach())
    start = dict(model.named_parameters())
    out = {}
    steps = len(batches)
    with torch.no_grad():
        for i, (name, w, shadow) in enumerate(triples):
            w0 = start[name].detach().to(device, torch.float32)
            ds = (shadow - w0).double()
            h = _Histogram()
            drift = (shadow - w0).abs() / steps
            half = bf16_spacing(w0) / 2
            h.add(torch.where(drift > 0, half / drift, torch.full_like(drift, math.inf)).reshape(-1).cpu())
            out[name] = _ParamStats(
                numel=w0.numel(),
                dot=float((ds * (w.double() - w0.double())).sum()),
                norm2=float((ds * ds).sum()),
                moved=moved[i],
                moved_once=int(ever[i].sum()),
                steps_to_move=h,
            )
    del m, opt, triples, prev, ever
    return out


def diagnose(
    checkpoint: str,
    *,
    lr: float,
    steps: int = 4,
    batch: int = 16,
    seed: int = 0,
    samples: str | Path | None = None,
    cache_dir: str | Path = "runs/cache",
    progress: bool = True,
) -> Diagnosis:
    if not (lr > 0 and math.isfinite(lr)):
        raise ConfigError(f"--lr must be a positive learning rate, got {lr}")
    if steps < 1 or batch < 1:
        raise ConfigError(f"--steps and --batch must be >= 1, got {steps} and {batch}")
    pairs = read_samples(samples) if samples is not None else None  # refused before minutes of loading
    start = bf16_start(checkpoint, cache_dir)
    model, tokenizer = load_pretrained(start)
    model.to(torch.bfloat16).train()  # exact: the start is on the BF16 grid; each trajectory copies it
    batches = [_encode(tokenizer, b) for b in make_batches(tokenizer, steps, batch, seed, pairs)]
    runs = {
        short: _trajectory(model, precision, batches, lr, progress, f"diagnose {precision}")
        for short, precision in MODES
    }
    keys = [*GROUPS, "all"]
    groups = {g: GroupResult() for g in GROUPS}
    dot = {g: {"rtn": 0.0, "sr": 0.0} for g in keys}
    norm2 = {g: {"rtn": 0.0, "sr": 0.0} for g in keys}
    moved = {g: {"rtn": [0] * steps, "sr": [0] * steps} for g in keys}
    once = {g: 0 for g in keys}
    hist = {g: _Histogram() for g in keys}
    absw: dict[str, list[torch.Tensor]] = {g: [] for g in GROUPS}
    for name, p in model.named_parameters():
        g = group_of(name)
        groups[g].params += p.numel()
        for key in (g, "all"):
            for mode in ("rtn", "sr"):
                st = runs[mode][name]
                dot[key][mode] += st.dot
                norm2[key][mode] += st.norm2
                moved[key][mode] = [a + b for a, b in zip(moved[key][mode], st.moved)]
            once[key] += runs["rtn"][name].moved_once
            hist[key].merge(runs["rtn"][name].steps_to_move)
        flat = p.detach().float().abs().reshape(-1)
        absw[g].append(flat[:: max(1, flat.numel() // 200_000)])  # a strided sample for the median |w|
    total = sum(groups[g].params for g in GROUPS)

    def fill(r: GroupResult, key: str, n: int) -> None:
        r.moved_by_step = {mode: [c / n for c in moved[key][mode]] for mode in ("rtn", "sr")}
        r.moved_per_step = {mode: sum(v) / len(v) for mode, v in r.moved_by_step.items()}
        r.reaches_bf16 = {
            mode: (dot[key][mode] / norm2[key][mode] if norm2[key][mode] > 0 else None) for mode in ("rtn", "sr")
        }
        r.rtn_moved_once = once[key] / n
        r.rtn_steps_to_move_median = hist[key].median()

    for g in GROUPS:
        if groups[g].params:
            fill(groups[g], g, groups[g].params)
            groups[g].median_abs_weight = float(torch.cat(absw[g]).median())
    overall = GroupResult(params=total)
    fill(overall, "all", total)
    overall.median_abs_weight = float(torch.cat([torch.cat(v) for v in absw.values() if v]).median())
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) and groups["head"].params == 0
    return Diagnosis(
        checkpoint=str(checkpoint),
        model=source_note(checkpoint),
        lr=lr,
        steps=steps,
        batch=batch,
        data=f"{samples} ({len(pairs)} samples)" if pairs is not None else "the built-in chat-add task (right answers)",
        groups={g: r for g, r in groups.items() if r.params},
        overall=overall,
        tied_head=tied,
        advice=advice(overall, lr),
    )


def advice(o: GroupResult, lr: float) -> str:
    rtn, sr = o.reaches_bf16["rtn"], o.reaches_bf16["sr"]
    if rtn is None:
        return "advice: the update was zero (no gradient reached the weights); check the samples"
    if rtn < 0.5:
        return (
            f"advice: round-to-nearest drops most of the update at lr {lr:g} ({pct(rtn)} reaches BF16): train with "
            f"precision bf16-sr ({pct(sr)} reached BF16 here); raising the learning rate instead moves the "
            "weights but drifts further from the start"
        )
    if rtn < 0.9:
        return (
            f"advice: round-to-nearest delays part of the update at lr {lr:g} ({pct(rtn)} reaches BF16): "
            "precision bf16-sr removes the delay"
        )
    return f"advice: round-to-nearest keeps up at lr {lr:g} ({pct(rtn)} reaches BF16); SR is optional here"


def table(d: Diagnosis) -> str:
    """The terminal table."""
    head = (
        f"{'group':<11} {'params':>8} {'median|w|':>9} {'RTN moved/step':>14} {'SR moved/step':>13} "
        f"{'reaches BF16 RTN':>16} {'SR':>7} {'RTN moved once':>14} {'RTN steps to move median w':>26}"
    )
    lines = [
        f"diagnose: {d.model}",
        f"  lr {d.lr:g}, {d.steps} AdamW steps (FP32 shadows, weight decay 0, grad clip 1), {d.batch} samples "
        f"per step from {d.data}",
        "",
        head,
        "-" * len(head),
    ]
    rows = [*d.groups.items(), ("overall", d.overall)]
    for g, r in rows:
        steps = r.rtn_steps_to_move_median
        lines.append(
            f"{g:<11} {r.params / 1e6:>7.1f}M {r.median_abs_weight:>9.4f} {pct(r.moved_per_step['rtn']):>14} "
            f"{pct(r.moved_per_step['sr']):>13} {pct(r.reaches_bf16['rtn']):>16} {pct(r.reaches_bf16['sr']):>7} "
            f"{pct(r.rtn_moved_once):>14} {('~%.0f' % steps) if steps else 'never (no drift)':>26}"
        )
    if d.tied_head:
        lines.append("(head: tied to the embeddings, counted there)")
    lines += ["", d.advice]
    return "\n".join(lines)


def plot(d: Diagnosis, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*d.groups, "overall"]
    rows = [*d.groups.values(), d.overall]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    x = range(len(names))
    for off, mode, lab in ((-0.2, "rtn", "round-to-nearest"), (0.2, "sr", "stochastic rounding")):
        axes[0].bar([i + off for i in x], [100 * r.moved_per_step[mode] for r in rows], width=0.4, label=lab)
        axes[1].bar([i + off for i in x], [100 * (r.reaches_bf16[mode] or 0.0) for r in rows], width=0.4, label=lab)
        axes[2].plot(range(1, d.steps + 1), [100 * v for v in d.overall.moved_by_step[mode]], marker="o", label=lab)
    for ax in axes[:2]:
        ax.set_xticks(list(x), names, rotation=20)
    axes[0].set(title="BF16 weights that move per step", ylabel="% of the group's weights")
    axes[1].set(title="share of the FP32 update that reaches BF16", ylabel="%")
    axes[1].axhline(100, color="gray", lw=0.8, ls="--")
    axes[2].set(title="BF16 weights moved, per step (all)", xlabel="AdamW step", ylabel="%")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"dist-sr diagnose: {d.model}, lr {d.lr:g}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(d: Diagnosis, out_dir: str | Path) -> tuple[Path, Path]:
    """``diagnose.json`` and ``diagnose.png`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = asdict(d)
    data["last_line"] = d.last_line()
    (out / "diagnose.json").write_text(json.dumps(data, indent=1))
    plot(d, out / "diagnose.png")
    return out / "diagnose.json", out / "diagnose.png"
