"""DeepSpeed's own multi-node launcher (``deepspeed --hostfile``, its pdsh runner over ssh) on two
"nodes": two sshd servers on loopback, reached as ``node-a`` and ``node-b``, each giving its logins
an environment of its own (sshd's ``SetEnv``: what a node's shell profile would set), so a node can
be set up differently. The launcher starts one rank per node with only what it exports; the job's
switch (``DIST_SR_SEED``) is set only where the user launches.

- the seed reaches every rank, both ranks train keyed with it (dist-sr's hook in the launcher adds
  the switch to what the runner exports; the sync secret is never on the command line);
- a node without dist-sr's start-up hook (its ``.pth`` hidden from node-b's logins by a bind mount
  in the sshd's own mount namespace) stops the job before the first step, naming rank 1;
- a node whose environment lacks the variable while the other's has it does too.

Needs root, ``pdsh``, ``sshd`` and ``unshare`` (Debian's pdsh and openssh-server; ``.ci/run``
installs them)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_sr import startup_check
from tests.dist_utils import free_port, launcher_env

pytestmark = pytest.mark.slow
pytest.importorskip("deepspeed")
SEED = 4242
SSHD = "/usr/sbin/sshd"

JOB = """
import argparse, json, os, torch, deepspeed
from tests.engines.models import tiny_qwen2

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=-1)
ap.add_argument("--out")
args = ap.parse_args()
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
model = tiny_qwen2()
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(7))
for _ in range(2):
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()

# the test's check: are this rank's BF16 weights the keyed SR of its masters, with the launcher's seed?
from dist_sr import stochastic_round
from tests.engines.test_deepspeed import working_and_master
seed = os.environ.get("DIST_SR_SEED")
state = working_and_master(engine)
keyed = seed is not None and all(
    torch.equal(w.view(torch.int16),
                stochastic_round(m, seed=int(seed), step=engine.global_steps, param=n).view(torch.int16))
    for n, (w, m) in state.items())
with open(f"{args.out}.{engine.global_rank}", "w") as f:
    json.dump({"node": os.environ["NODE"], "seed": seed, "attached": hasattr(engine, "dist_sr"), "keyed": keyed}, f)
torch.distributed.barrier()
"""


class Nodes:
    """Two ssh "nodes" on loopback; ``start`` (re)starts them with the given per-node setup."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        for key in ("host_key", "id"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / key)], check=True)
        (tmp / "authorized_keys").write_text((tmp / "id.pub").read_text())
        self.ports = {"node-a": free_port(), "node-b": free_port()}
        hosts = "".join(f"Host {n}\n  HostName 127.0.0.1\n  Port {p}\n" for n, p in self.ports.items())
        (tmp / "ssh_config").write_text(
            hosts + f"Host *\n  User root\n  IdentityFile {tmp / 'id'}\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
        )
        (tmp / "hostfile").write_text("node-a slots=1\nnode-b slots=1\n")
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation directory

    def start(self, env: dict[str, dict], without_hook: tuple[str, ...] = ()) -> None:
        self.stop()
        for node, port in self.ports.items():
            setenv = " ".join(
                f"{k}={v}" for k, v in {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **env[node]}.items()
            )
            config = self.tmp / f"sshd_{node}.conf"
            config.write_text(
                f"Port {port}\nListenAddress 127.0.0.1\nHostKey {self.tmp / 'host_key'}\n"
                f"PidFile {self.tmp / node}.pid\nAuthorizedKeysFile {self.tmp / 'authorized_keys'}\n"
                "StrictModes no\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                f"PermitRootLogin prohibit-password\nSetEnv NODE={node} {setenv}\n"
            )
            cmd = [SSHD, "-D", "-e", "-f", str(config)]
            if node in without_hook:  # this node's processes see no dist-sr start-up hook
                cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       'mount --bind /dev/null "$0" && exec "$@"', startup_check.pth_path(), *cmd]  # fmt: skip
            self.procs[node] = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=open(self.tmp / f"{node}.log", "a")
            )
        for node, port in self.ports.items():
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert self.procs[node].poll() is None, (self.tmp / f"{node}.log").read_text()
                    assert time.monotonic() < deadline, f"{node}'s sshd did not listen"
                    time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
            proc.wait(timeout=10)
        self.procs.clear()
        # a job that hung (ranks in mismatched collectives) outlives its ssh sessions: end the
        # processes this test started, found by this test's own directory on their command line
        for pid in _pids_naming(self.tmp):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def launch(self, env_extra: dict) -> tuple[subprocess.CompletedProcess, list[dict]]:
        """``deepspeed --hostfile`` from this shell, as a user types it; the ranks' results."""
        out = self.tmp / "result"
        for old in self.tmp.glob("result.*"):
            old.unlink()
        env = {k: v for k, v in launcher_env().items() if not k.startswith("DIST_SR_") or k == "DIST_SR_SYNC_SECRET"}
        env.update(PDSH_SSH_ARGS_APPEND=f"-F {self.tmp / 'ssh_config'}", DIST_SR_AGREE_TIMEOUT="10", **env_extra)
        r = subprocess.run(
            [str(Path(sys.executable).parent / "deepspeed"), "--hostfile", "hostfile", "--no_ssh_check",
             "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "job.py", "--out", str(out)],
            cwd=self.tmp, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        results = [json.loads(p.read_text()) for p in sorted(self.tmp.glob("result.*"))]
        return r, results


def _pids_naming(path: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if str(path).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


@pytest.fixture
def nodes(tmp_path):
    missing = [tool for tool in ("pdsh", SSHD, "ssh-keygen", "unshare") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        pytest.skip(f"needs root with pdsh, sshd, ssh-keygen and unshare (missing: {missing}): .ci/run installs them")
    assert os.path.exists(startup_check.pth_path()), "dist-sr's start-up hook must be installed (scripts/setup.sh)"
    (tmp_path / "job.py").write_text(JOB)
    n = Nodes(tmp_path)
    yield n
    n.stop()


def _said(r: subprocess.CompletedProcess) -> str:
    return r.stdout + r.stderr


def test_the_seed_set_where_the_user_launches_keys_every_node(nodes):
    nodes.start({"node-a": {}, "node-b": {}})
    r, results = nodes.launch({"DIST_SR_SEED": str(SEED)})
    assert r.returncode == 0, _said(r)[-4000:]
    assert results == [
        {"node": node, "seed": str(SEED), "attached": True, "keyed": True} for node in ("node-a", "node-b")
    ], _said(r)[-3000:]
    command = next(line for line in _said(r).splitlines() if "cmd = pdsh" in line)
    assert f"export DIST_SR_SEED={SEED};" in command
    assert "DIST_SR_SYNC_SECRET" not in command  # exports travel on the command line: never a secret


def test_a_node_without_dist_sr_stops_the_job_before_the_first_step_naming_its_rank(nodes):
    nodes.start({"node-a": {}, "node-b": {}}, without_hook=("node-b",))
    r, results = nodes.launch({"DIST_SR_SEED": str(SEED)})
    assert r.returncode != 0 and results == [], _said(r)[-4000:]
    said = _said(r)
    assert "rank 0 (host" in said and f"SR seed {SEED}" in said, said[-4000:]
    assert "rank 1: posted nothing within 10 s" in said and "dist-sr doctor" in said, said[-4000:]


def test_a_node_whose_environment_lacks_the_variable_stops_the_job_naming_its_rank(nodes):
    # the user's launch shell has no DIST_SR_SEED; node-a's own environment does, node-b's does not
    nodes.start({"node-a": {"DIST_SR_SEED": str(SEED)}, "node-b": {}})
    r, results = nodes.launch({})
    assert r.returncode != 0 and results == [], _said(r)[-4000:]
    said = _said(r)
    assert f"rank 0 (host {socket.gethostname()}): SR seed {SEED}" in said, said[-4000:]
    assert f"rank 1 (host {socket.gethostname()}): no SR asked" in said, said[-4000:]
    assert f"DIST_SR_SEED={SEED} in the .deepspeed_env" in said
