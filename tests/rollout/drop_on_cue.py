"""A faulty loader on cue, for the whole-fleet test (a module of its own: importing
``framework_extension`` would also mis-shard q/k/v)."""


class DropOnCueExtension:
    """A faulty loader on cue, for the whole-fleet test: once the file named by
    ``DIST_SR_TEST_DROP_CUE`` appears, the first worker to load after it claims it (an atomic
    rename, so exactly one worker of the engine does) and, while the file it took exists, never
    writes the tensor it names, below dist-sr's record (handed the tensor, the load drops it)."""

    def framework_ping(self) -> str:
        return "pong"


def _drop_on_cue() -> None:
    import os

    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    cue = os.environ.get("DIST_SR_TEST_DROP_CUE")
    if not cue or getattr(Qwen2ForCausalLM.load_weights, "_drops_on_cue", False):
        return
    real = Qwen2ForCausalLM.load_weights
    claimed: list[str] = []  # the cue file this worker took (deleting it stops the fault)

    def load_weights(self, weights):
        if not claimed:
            mine = f"{cue}.taken-{os.getpid()}"
            try:
                os.rename(cue, mine)
                claimed.append(mine)
            except FileNotFoundError:
                pass
        try:
            with open(claimed[0]) as f:
                drop = f.read().strip()
        except (IndexError, FileNotFoundError):
            drop = None
        if drop:
            weights = ((n, t) for n, t in weights if n != drop)
        return real(self, weights)

    load_weights._drops_on_cue = True
    Qwen2ForCausalLM.load_weights = load_weights


_drop_on_cue()
