"""``dist-sr deepspeed-hook``: an unmodified script that calls ``deepspeed.initialize`` itself gets
keyed SR from the JSON's ``"stochastic_rounding"`` block alone."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from dist_sr import startup_check
from dist_sr.integrations import startup as hook
from tests.dist_utils import REPO, free_port, launcher_env

deepspeed = pytest.importorskip("deepspeed")
from dist_sr.engines.deepspeed.hook import take_sr_block  # noqa: E402

SR = {"enabled": True, "seed": 77, "mode": "stochastic"}
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 10_000,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}


def test_a_config_without_the_block_passes_through_untouched(tmp_path, monkeypatch):
    monkeypatch.delenv("DIST_SR_SEED", raising=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASE))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    call = ((args,), {"model": "m"})
    sr, a, kw = take_sr_block(*call)
    assert sr is None and a[0] is args and kw == {"model": "m"}
    assert take_sr_block((), {"config": dict(BASE)})[0] is None
    assert take_sr_block((), {"model": "m"}) == (None, (), {"model": "m"})


@pytest.mark.parametrize("where", ["config", "config_params", "args", "args-keyword", "deepscale_config"])
def test_the_block_is_found_wherever_deepspeed_looks_and_removed(where, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "stochastic_rounding": SR}))
    args = argparse.Namespace(deepspeed_config=None, local_rank=0)
    if where == "deepscale_config":
        args.deepscale_config = str(path)
    elif where.startswith("args"):
        args.deepspeed_config = str(path)
    pos, kw = ((), {"args": args}) if where == "args-keyword" else ((args,), {})
    if where in ("config", "config_params"):
        kw[where] = str(path)
    sr, pos, kw = take_sr_block(pos, kw)
    assert (sr.seed, sr.mode) == (77, "stochastic")
    assert kw["config"] == BASE and "config_params" not in kw  # the rest, as DeepSpeed would read it
    new_args = kw.get("args", pos[0] if pos else None)
    assert getattr(new_args, "deepspeed_config", None) is None and getattr(new_args, "deepscale_config", None) is None
    assert args.deepspeed_config is None or args.deepspeed_config == str(path)  # the caller's args are not mutated


def test_the_jobs_environment_turns_sr_on_for_a_config_without_the_block(tmp_path, monkeypatch):
    """Frameworks that build the DeepSpeed config themselves (OpenRLHF) get SR from DIST_SR_SEED."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASE))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    monkeypatch.setenv("DIST_SR_SEED", "77")
    sr, a, kw = take_sr_block((args,), {"model": "m"})
    assert (sr.seed, sr.mode) == (77, "stochastic") and a[0] is args and kw == {"model": "m"}  # the call as it was
    monkeypatch.setenv("DIST_SR_MODE", "dither")
    assert take_sr_block((), {"config": dict(BASE)})[0].mode == "dither"
    monkeypatch.delenv("DIST_SR_MODE")
    # the block and the environment may both be given only if they agree
    assert take_sr_block((), {"config": {**BASE, "stochastic_rounding": SR}})[0].seed == 77
    for block in ({**SR, "seed": 78}, {**SR, "enabled": False}):
        with pytest.raises(ValueError, match="DIST_SR_SEED=77.*make them agree"):
            take_sr_block((), {"config": {**BASE, "stochastic_rounding": block}})
    for bad, words in (("x", "DIST_SR_SEED='x' is not an integer"), ("-3", "DIST_SR_SEED/DIST_SR_MODE: seed")):
        monkeypatch.setenv("DIST_SR_SEED", bad)
        with pytest.raises(ValueError, match=words):
            take_sr_block((), {"config": dict(BASE)})
    monkeypatch.setenv("DIST_SR_SEED", "5")
    monkeypatch.setenv("DIST_SR_MODE", "sometimes")
    with pytest.raises(ValueError, match="DIST_SR_MODE"):
        take_sr_block((), {"config": dict(BASE)})


def test_a_config_given_twice_is_left_to_deepspeeds_own_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "stochastic_rounding": SR}))
    call = ((argparse.Namespace(deepspeed_config=str(path)),), {"config": str(path)})
    assert take_sr_block(*call) == (None, *call)


def test_a_disabled_block_is_removed_and_nothing_attached():
    sr, _, kw = take_sr_block((), {"config": {**BASE, "stochastic_rounding": {**SR, "enabled": False}}})
    assert sr is None and kw["config"] == BASE


def _python(code: str, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", **env}
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


def test_the_pth_line_patches_deepspeed_at_import_and_tolerates_a_missing_package(tmp_path):
    hook.install(str(tmp_path))
    # (the environment's own .pth may have registered the hook already: start from none)
    probe = (
        "import site, sys; sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_Finder']; "
        "{pre}site.addsitedir({d!r}); import deepspeed; "
        "print('hooked' if getattr(deepspeed.initialize, '__dist_sr_hook__', False) else "
        "'guarded' if getattr(deepspeed.initialize, '__dist_sr_guard__', False) else 'plain')"
    )
    r = _python(probe.format(d=str(tmp_path), pre=""))
    assert r.stdout.strip().splitlines()[-1] == "hooked", r.stderr
    # off: only the guard that refuses a job still asking for SR (tests/engines/test_wheel_install.py)
    r = _python(probe.format(d=str(tmp_path), pre=""), DIST_SR_DEEPSPEED_HOOK="0")
    assert r.stdout.strip().splitlines()[-1] == "guarded", r.stderr
    # dist-sr uninstalled but the .pth left behind: start-up must still work, silently
    r = _python(probe.format(d=str(tmp_path), pre="sys.modules['dist_sr_deepspeed_hook'] = None; "))
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "plain" and "Error processing" not in r.stderr
    assert (
        hook.uninstall(str(tmp_path)) == str(tmp_path / startup_check.PTH_NAME)
        and hook.uninstall(str(tmp_path)) is None
    )


USER_SCRIPT = """
import argparse, json
import deepspeed, torch
from tests.engines.models import tiny_qwen2

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=-1)
ap.add_argument("--out")
ap = deepspeed.add_config_arguments(ap)
args = ap.parse_args()
model = tiny_qwen2()
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(7))
for _ in range(3):
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()

# the test's check (not part of a user's script): are the BF16 weights keyed SR of the masters?
from dist_sr import stochastic_round
from tests.engines.test_deepspeed import working_and_master
state = working_and_master(engine)
keyed = all(torch.equal(w.view(torch.int16), stochastic_round(m, seed=77, step=engine.global_steps,
                                                               param=n).view(torch.int16))
            for n, (w, m) in state.items())
rtn = all(torch.equal(w, m.to(torch.bfloat16)) for w, m in state.values())
if engine.global_rank == 0:
    json.dump({"attached": hasattr(engine, "dist_sr"), "keyed": keyed, "rtn": rtn}, open(args.out, "w"))
"""


@pytest.fixture
def installed_hook():
    """The hook installed in this environment's site-packages, as `dist-sr deepspeed-hook install`
    (run by scripts/setup.sh) leaves it; removed again if this test put it there."""
    there = os.path.exists(startup_check.pth_path())
    if not there:
        hook.install()
    yield
    if not there:
        hook.uninstall()


@pytest.mark.slow
def test_an_unmodified_deepspeed_script_gets_keyed_sr_from_its_json(tmp_path, installed_hook):
    (tmp_path / "train.py").write_text(USER_SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps({**BASE, "stochastic_rounding": SR}))
    (tmp_path / "plain.json").write_text(json.dumps(BASE))
    env = {k: v for k, v in launcher_env().items() if k not in ("DIST_SR_SEED", "DIST_SR_MODE")}
    results = {}
    # the block in the JSON; no block but the job's DIST_SR_SEED (OpenRLHF's switch); the hook off
    for label, config, extra in (
        ("hook", "ds.json", {"DIST_SR_DEEPSPEED_HOOK": "1"}),
        ("env", "plain.json", {"DIST_SR_SEED": "77"}),
        ("off", "ds.json", {"DIST_SR_DEEPSPEED_HOOK": "0"}),
    ):
        out = tmp_path / f"{label}.json"
        r = subprocess.run(
            [
                "deepspeed",
                "--num_gpus=2",
                f"--master_port={free_port()}",
                "train.py",
                "--deepspeed",
                "--deepspeed_config",
                config,
                "--out",
                str(out),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**env, **extra},
        )
        if label == "off":
            # DeepSpeed alone would ignore the block and train round-to-nearest: refused instead
            assert r.returncode != 0 and not out.exists()
            assert "DIST_SR_DEEPSPEED_HOOK='0'" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
            continue
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        results[label] = json.loads(out.read_text())
    assert results["hook"] == results["env"] == {"attached": True, "keyed": True, "rtn": False}


HF_SCRIPT = """
import json, os, sys, torch
from transformers import Trainer, TrainingArguments
from tests.engines.models import tiny_qwen2

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 3, (9,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}

args = TrainingArguments(output_dir="out", per_device_train_batch_size=2, max_steps=3, bf16=True, deepspeed="ds.json",
                         report_to=[], save_strategy="no", use_cpu=True, learning_rate=1e-3)
trainer = Trainer(model=tiny_qwen2(), args=args, train_dataset=Data())
trainer.train()

# the test's check (not part of a user's script)
from dist_sr import stochastic_round
from tests.engines.test_deepspeed import working_and_master
engine = trainer.model_wrapped
state = working_and_master(engine)
keyed = all(torch.equal(w.view(torch.int16), stochastic_round(m, seed=77, step=engine.global_steps,
                                                               param=n).view(torch.int16))
            for n, (w, m) in state.items())
if engine.global_rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"attached": hasattr(engine, "dist_sr"), "steps": engine.global_steps, "keyed": keyed}, f)
# Skip interpreter finalisation (as tests/dist_utils.py does): tearing down the store while the
# peer's connection is still closing can abort a process whose work is done.
torch.distributed.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_the_hugging_face_trainer_with_deepspeed_gets_keyed_sr_from_its_json(tmp_path, installed_hook):
    """transformers' Trainer (which TRL's trainers build on) hands DeepSpeed the JSON through
    accelerate; with the hook, the block in it is honoured: HF's "auto" values and all."""
    pytest.importorskip("accelerate")
    (tmp_path / "train.py").write_text(HF_SCRIPT)
    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "bf16": {"enabled": "auto"},
                "zero_optimization": {"stage": 2},
                "gradient_clipping": "auto",
                "stochastic_rounding": SR,
            }
        )
    )
    env = launcher_env()
    r = subprocess.run(
        ["torchrun", "--nproc-per-node", "2", f"--master-port={free_port()}", "train.py", "result.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((tmp_path / "result.json").read_text()) == {"attached": True, "steps": 3, "keyed": True}


def test_a_broken_dist_sr_install_fails_the_deepspeed_import_with_the_fix(tmp_path):
    """With the hook on, deepspeed must not come up without SR support (RTN for SR configs)."""
    hook.install(str(tmp_path))
    code = (
        "import site, sys; sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_Finder']; "
        f"site.addsitedir({str(tmp_path)!r}); sys.modules['dist_sr.engines.deepspeed.hook'] = None; "
        "import deepspeed"
    )
    r = _python(code)
    assert r.returncode != 0 and "could not import dist_sr" in r.stderr and "deepspeed-hook uninstall" in r.stderr
    assert _python(code, DIST_SR_DEEPSPEED_HOOK="0").returncode == 0


def _reference_model_worker(rank, world, out):
    """What TRL does with ``beta > 0``: a second, optimizer-less engine built from the policy's
    config (SR block included), next to a ZeRO-2 and a ZeRO-3 policy."""
    import logging

    import torch

    from dist_sr.engines.deepspeed.hook import hooked_initialize
    from tests.engines.models import tiny_qwen2

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("dist_sr.deepspeed").addHandler(handler)
    init = hooked_initialize(deepspeed.initialize)
    result = {}
    for stage in (2, 3):
        config = {**BASE, "zero_optimization": {"stage": stage}, "stochastic_rounding": SR}
        policy = tiny_qwen2()
        engine, *_ = init(model=policy, model_parameters=policy.parameters(), config=config)
        loaded = {n: p.detach().to(torch.bfloat16).clone() for n, p in tiny_qwen2().named_parameters()}
        # as TRL's prepare_deepspeed builds it: no optimizer, ZeRO-3 kept, any other stage made 0
        ref_config = {k: v for k, v in config.items() if k != "optimizer"}
        ref_config["zero_optimization"] = {"stage": 3 if stage == 3 else 0}
        ref, *_ = init(model=tiny_qwen2(), config=ref_config)
        with deepspeed.zero.GatheredParameters(list(ref.module.parameters()), enabled=stage == 3):
            as_loaded = all(
                torch.equal(p.detach().to(torch.bfloat16), loaded[n]) for n, p in ref.module.named_parameters()
            )
        result[stage] = {"policy": hasattr(engine, "dist_sr"), "ref": hasattr(ref, "dist_sr"), "as_loaded": as_loaded}
    result["log"] = seen
    with open(out, "w") as f:
        json.dump(result, f)


@pytest.mark.slow
def test_reference_models_built_from_the_training_config_are_left_alone_and_logged(tmp_path):
    from tests.dist_utils import run_workers

    run_workers(_reference_model_worker, 1, str(tmp_path / "r.json"))
    r = json.loads((tmp_path / "r.json").read_text())
    for stage in ("2", "3"):
        assert r[stage] == {"policy": True, "ref": False, "as_loaded": True}, (stage, r)
    attached = [m for m in r["log"] if "keyed SR attached" in m]
    skipped = [m for m in r["log"] if "no SR for DeepSpeed engine" in m]
    assert len(attached) == 2 and "ZeRO stage 2" in attached[0] and "ZeRO stage 3" in attached[1]
    assert len(skipped) == 2 and all("Qwen2ForCausalLM" in m and "no optimizer" in m for m in skipped)


def test_the_finder_wraps_a_module_that_another_meta_path_finder_serves(tmp_path, monkeypatch):
    """A watched module served by setuptools' editable-install finder (a meta-path finder, not
    PathFinder: an editable DeepSpeed) is still patched at import."""
    from setuptools.command.editable_wheel import _finder_template  # the finder setuptools writes

    (tmp_path / "src" / "dsr_probe_pkg").mkdir(parents=True)
    (tmp_path / "src" / "dsr_probe_pkg" / "__init__.py").write_text("value = 1\n")
    source = _finder_template("dsr-probe", {"dsr_probe_pkg": str(tmp_path / "src" / "dsr_probe_pkg")}, {})
    (tmp_path / "dsr_probe_finder.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    import dsr_probe_finder

    seen = []
    finder = hook._Finder({"dsr_probe_pkg": seen.append})
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path, dsr_probe_finder._EditableFinder])
    monkeypatch.delitem(sys.modules, "dsr_probe_pkg", raising=False)
    import dsr_probe_pkg

    assert [m.__name__ for m in seen] == ["dsr_probe_pkg"] and dsr_probe_pkg.value == 1


def test_the_deepspeed_launcher_exports_the_switch_to_every_node_and_no_secret():
    """DeepSpeed's multi-node runners export only EXPORT_ENVS' prefixes (and .deepspeed_env): the
    hook adds the switch (tests/launch/test_multinode_deepspeed.py launches with it)."""
    from deepspeed.launcher import runner

    assert startup_check.active(), "this environment's hook (scripts/setup.sh) must be in force"
    assert {"DIST_SR_SEED", "DIST_SR_MODE", "DIST_SR_DEEPSPEED_HOOK"} <= set(runner.EXPORT_ENVS)
    assert not any("DIST_SR_SYNC_SECRET".startswith(prefix) for prefix in runner.EXPORT_ENVS)
