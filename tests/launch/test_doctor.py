"""``dist-sr doctor`` gives the right answer in each way dist-sr gets installed, each a real virtual
environment with the project's wheel (``tests/installs.py``), and the integrations' own plug points
refuse where the hook did not run:

- the wheel installed by pip, beside an editable DeepSpeed (served by setuptools' editable finder,
  not ``PathFinder``): the hook is in force and DeepSpeed is patched through that finder;
- ``pip install --target`` plus ``PYTHONPATH``, a Ray ``working_dir``-style directory on
  ``sys.path``, a zipapp, ``python -S``: no ``.pth`` runs, the doctor names which of these it is,
  DeepSpeed would not attach, the exit status says so, and verl's ``external_lib`` and OpenRLHF's
  start-up refuse once DeepSpeed was imported unpatched; registering the hook in the program (the
  fix the doctor gives) makes DeepSpeed attach there.

One environment with the wheel installed, one without (the other installs need dist-sr absent
from site-packages), shared by every case."""

from __future__ import annotations

import os
import shutil
import subprocess
import zipapp
from pathlib import Path

import pytest

from tests.installs import build_wheel, fresh_venv, pip

pytestmark = pytest.mark.slow
pytest.importorskip("deepspeed")
DOCTOR = "from dist_sr.launch.cli import main; raise SystemExit(main(['doctor']))"


@pytest.fixture(scope="module")
def installs(tmp_path_factory):
    root = tmp_path_factory.mktemp("installs")
    wheel = build_wheel(root)
    # the wheel installed by pip, and DeepSpeed as an editable install of its own sources
    site = fresh_venv(root / "site", hide=("deepspeed",))
    pip(site, "install", str(wheel))
    import deepspeed

    src = root / "deepspeed-src"
    shutil.copytree(Path(deepspeed.__file__).parent, src / "deepspeed", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "deepspeed"\nversion = "{deepspeed.__version__}"\n'
        '[tool.setuptools.packages.find]\ninclude = ["deepspeed*"]\n'
    )
    pip(site, "install", "--no-deps", "--no-build-isolation", "-e", str(src))
    # dist-sr nowhere in site-packages: pip install --target, and a zipapp of the same files
    bare = fresh_venv(root / "bare")
    target = root / "target"
    pip(bare, "install", "--no-deps", "--target", str(target), str(wheel))
    app_src = root / "app"
    shutil.copytree(target, app_src)
    (app_src / "__main__.py").write_text("import sys\nfrom dist_sr.launch.cli import main\nsys.exit(main())\n")
    zipapp.create_archive(app_src, root / "app.pyz")
    return {"root": root, "site": site, "bare": bare, "target": target, "app": root / "app.pyz"}


def _run(python, args, cwd, **env_extra) -> tuple[int, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DIST_SR_", "PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))
    }
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **env_extra)
    r = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def _line(out: str, start: str) -> str:
    return next((line for line in out.splitlines() if line.startswith(start)), f"<no {start!r} line in>\n{out}")


def test_the_wheel_beside_an_editable_deepspeed_attaches_through_setuptools_finder(installs):
    rc, out = _run(installs["site"].parent / "dist-sr", ["doctor"], installs["root"], DIST_SR_SEED="5")
    assert rc == 0, out
    assert _line(out, "start-up hook:").startswith("start-up hook: in force: "), out
    assert "dist_sr_deepspeed_hook.pth, processed at start-up" in out
    deepspeed = _line(out, "deepspeed ")
    assert deepspeed.startswith("deepspeed attaches:") and "deepspeed.initialize is dist-sr's" in deepspeed, out
    assert "__editable__" in deepspeed  # served by setuptools' editable finder, patched all the same
    assert _line(out, "switch:").startswith("switch: DIST_SR_SEED=5, DIST_SR_MODE=stochastic"), out
    assert "exports DIST_SR_SEED, DIST_SR_MODE" in _line(out, "multi-node:"), out
    assert _line(out, "fsdp2 ").startswith("fsdp2     attaches"), out


def _refused(out: str, *why: str) -> None:
    hook = _line(out, "start-up hook:")
    assert hook.startswith("start-up hook: NOT in force: "), out
    assert all(w in hook for w in why), hook
    assert "dist_sr_deepspeed_hook.register()" in hook  # the fix
    assert _line(out, "deepspeed ").startswith("deepspeed does NOT attach:"), out
    assert "DeepSpeed's own" in _line(out, "deepspeed "), out
    assert "would NOT reach the other nodes" in _line(out, "multi-node:"), out
    assert "fix the lines above" in _line(out, "verdict:"), out


def test_pip_install_target_with_PYTHONPATH_is_named_and_refused(installs):
    target = str(installs["target"])
    rc, out = _run(installs["bare"], ["-m", "dist_sr.launch.cli", "doctor"], installs["root"], PYTHONPATH=target)
    assert rc == 1, out
    _refused(out, f"imported from {target}, through PYTHONPATH, which is not a site directory")


def test_a_ray_working_dir_on_sys_path_is_named_and_refused(installs):
    # Ray's working_dir / py_modules: the job's directory is put on sys.path, never a site directory
    rc, out = _run(installs["bare"], ["-c", DOCTOR], installs["target"])
    assert rc == 1, out
    _refused(out, f"imported from {installs['target']}, put on sys.path at run time")


def test_a_zipapp_is_named_and_refused(installs):
    rc, out = _run(installs["bare"], [str(installs["app"]), "doctor"], installs["root"])
    assert rc == 1, out
    _refused(out, f"from the archive {installs['app']} (a zipapp)")


def test_python_dash_S_is_named_and_refused(installs):
    packages = installs["root"] / "bare-suite-packages"  # without site, its path entry is not read either
    rc, out = _run(
        installs["bare"],
        ["-S", "-m", "dist_sr.launch.cli", "doctor"],
        installs["root"],
        PYTHONPATH=f"{installs['target']}{os.pathsep}{packages}",
    )
    assert rc == 1, out
    _refused(out, "python -S: the site module is off")


def test_registering_the_hook_in_the_program_is_the_fix_the_doctor_gives(installs):
    code = "import dist_sr_deepspeed_hook as h; h.register(); " + DOCTOR
    rc, out = _run(installs["bare"], ["-c", code], installs["root"], PYTHONPATH=str(installs["target"]))
    assert _line(out, "start-up hook:") == "start-up hook: in force: registered by the program itself", out
    assert _line(out, "deepspeed ").startswith("deepspeed attaches:"), out
    assert rc == 0, out


@pytest.mark.parametrize(
    "plug_point, code, words",
    [
        ("verl's external_lib", "import dist_sr.integrations.verl", "external_lib=dist_sr.integrations.verl asks"),
        ("OpenRLHF's start-up", "from dist_sr.integrations import openrlhf; openrlhf.enable()", "DIST_SR_SEED"),
    ],
)
def test_the_integrations_plug_points_refuse_when_deepspeed_was_imported_unpatched(installs, plug_point, code, words):
    rc, out = _run(
        installs["bare"], ["-c", f"import deepspeed; {code}"], installs["root"], PYTHONPATH=str(installs["target"]),
        DIST_SR_SEED="5",
    )  # fmt: skip
    assert rc != 0, out
    assert "DeepSpeedUnpatched" in out and words in out and "deepspeed.initialize is DeepSpeed's own" in out, out
    assert "through PYTHONPATH, which is not a site directory" in out, out  # why, as the doctor says it
