"""What pyproject.toml cannot say.

The wheel ships the layout-free digest compiled (``dist_sr/numerics/csrc/digest.c``, Python's
stable ABI, no torch headers): every process that imports dist-sr digests weights at memory speed
without building anything at run time. Where no C compiler is at hand at install time the build is
skipped with a warning and the digest runs in torch (the same sums, slower).

The wheel also ships ``dist_sr_deepspeed_hook.pth`` at the
top of site-packages, so ``pip install dist-sr`` alone (a Ray ``runtime_env``, a container image,
a node set up by hand) makes ``DIST_SR_SEED`` and the DeepSpeed JSON's ``"stochastic_rounding"``
block work in a job that calls plain ``deepspeed.initialize``. Its one line is
``dist_sr.startup_check.PTH_LINE`` (stdlib only; it imports nothing heavy at start-up).
Editable installs get the file from ``dist-sr deepspeed-hook install`` (``scripts/setup.sh``)."""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _hook_module():
    spec = importlib.util.spec_from_file_location(
        "_dist_sr_hook_for_build", os.path.join(HERE, "dist_sr", "startup_check.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStartupHook(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        hook = _hook_module()
        path = os.path.join(self.build_lib, hook.PTH_NAME)
        with open(path, "w") as f:
            f.write(hook.PTH_LINE)

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            outputs.append(os.path.join(self.build_lib, _hook_module().PTH_NAME))
        return outputs


DIGEST = Extension(
    "dist_sr.numerics.digest_c",
    sources=["dist_sr/numerics/csrc/digest.c"],
    extra_compile_args=["-O3", "-pthread"],
    extra_link_args=["-pthread"],
    py_limited_api=True,
    optional=True,  # no compiler: the torch digest instead (numerics.digest says which runs)
)

setup(
    cmdclass={"build_py": BuildPyWithStartupHook},
    ext_modules=[DIGEST],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
