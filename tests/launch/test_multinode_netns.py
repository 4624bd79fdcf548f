"""Two "nodes" as Linux network namespaces joined by a veth pair, each running the trainer pod's
container command from the rendered Job, rendezvousing through the headless Service's name.

Like a pod, each node has its own network stack (only the veth link joins them), its own hostname
(the Job's pod hostname ``<job>-<index>``, set in a UTS namespace) and an /etc/hosts in which the
Service's per-pod names resolve (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` mounts over
/etc/hosts). Kubernetes' ``$(VAR)`` expansion is applied to the command with the pod's env, the
ConfigMap's files stand in for the config volume, and a shared directory for the PVC.
"""

import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from dist_sr.launch import k8s
from tests.launch.conftest import REPO, write_experiment

pytestmark = pytest.mark.slow
SUBNET = "10.231.77"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_nodes():
    """Namespaces ns0/ns1 with eth0 = SUBNET.1 / SUBNET.2; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs root with iproute2 and unshare to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    names = [f"dsr{tag}n{i}" for i in range(2)]
    created = []
    try:
        for ns in names:
            r = _ip("netns", "add", ns, check=False)
            if r.returncode:
                pytest.skip(f"the kernel refuses network namespaces: {r.stderr.strip()}")
            created.append(ns)
        _ip("link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
        for i, (ns, dev) in enumerate(zip(names, (f"v{tag}a", f"v{tag}b"))):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "link", "set", dev, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for ns in created:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _expand(arg: str, env: dict) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def test_two_namespaced_nodes_train_over_gloo_through_the_service_name(two_nodes, tmp_path, launch_env, warmup_cache):
    exp = write_experiment(
        tmp_path / "exp.yaml",
        distributed={"engine": "fsdp2"},
        cluster={"name": "dsr-test", "nnodes": 2, "nproc_per_node": 1, "data_dir": str(tmp_path / "data")},
    )
    files = k8s.render(_load(exp))
    job = files["trainer-job.yaml"][0]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_dir = tmp_path / "configmap"
    config_dir.mkdir()
    for name, text in files["configmap.yaml"][0]["data"].items():
        (config_dir / name).write_text(text.replace(k8s.CONFIG_MOUNT, str(config_dir)))
    # the warm-up cache on the shared volume, pre-filled from this session's cache
    shutil.copytree(warmup_cache, tmp_path / "data" / "cache", dirs_exist_ok=True)

    job_name, service = job["metadata"]["name"], pod["subdomain"]
    hosts = "127.0.0.1 localhost\n" + "".join(
        f"{SUBNET}.{i + 1} {job_name}-{i}.{service} {job_name}-{i}\n" for i in range(2)
    )
    procs = []
    try:
        for index, ns in enumerate(two_nodes):
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(hosts)
            env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
            env["NODE_RANK"] = str(index)  # the completion-index annotation's value on pod <index>
            command = [_expand(a, env).replace(k8s.CONFIG_MOUNT, str(config_dir)) for a in container["command"]]
            hostname = f"{job_name}-{index}"
            wrapped = [
                "ip",
                "netns",
                "exec",
                ns,
                "unshare",
                "--uts",
                "sh",
                "-c",
                f'hostname {hostname} && exec "$@"',
                "sh",
                *command,
            ]
            log = open(tmp_path / f"node{index}.log", "w")
            procs.append(
                (
                    subprocess.Popen(
                        wrapped, cwd=REPO, env={**launch_env, **env}, stdout=log, stderr=subprocess.STDOUT
                    ),
                    log,
                )
            )
        for p, log in procs:
            p.wait(timeout=600)
            log.close()
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
    assert [p.returncode for p, _ in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "engine=fsdp2 backend=gloo world=2 rank=0" in logs[0]
    run_dir = yaml.safe_load((config_dir / "experiment.yaml").read_text())["output_dir"]
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # digests checked every step across both nodes


def _load(exp: Path):
    from dist_sr.launch.planner import build_parser

    return k8s.load_for_cluster(build_parser().parse_args(["--config", str(exp)]))
