"""Builds Edge0's CPU kernels (src/edge0/backend/mlx/kernels/csrc, an MLX extension) when the project is
installed. The build is optional: where it fails (no compiler, no cmake, an MLX without its
CMake files), the install still succeeds and the engine runs on MLX's kernels
(``kernels=auto`` says so in one log line; ``kernels=edge0`` is a ConfigError).
``EDGE0_BUILD_KERNELS=0`` skips it."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = Path(__file__).resolve().parent / "src" / "edge0" / "backend" / "mlx" / "kernels" / "csrc"


class CMakeExtension(Extension):
    def __init__(self, name: str, source: Path):
        # optional: an editable install copies into the source tree only what was built
        super().__init__(name, sources=[], optional=True)
        self.source = source


class OptionalCMakeBuild(build_ext):
    def build_extension(self, ext):
        if os.environ.get("EDGE0_BUILD_KERNELS", "1") == "0":
            print("edge0: EDGE0_BUILD_KERNELS=0: the kernels are not built", file=sys.stderr)
            return
        try:
            self._cmake(ext)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"edge0: the kernels were not built ({e}); Edge0 runs on MLX's kernels", file=sys.stderr)

    def _cmake(self, ext):
        if shutil.which("cmake") is None:
            raise OSError("cmake is not on PATH")
        build = Path(self.build_temp).resolve() / "edge0_kernels"
        build.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cmake", "-S", str(ext.source), "-B", str(build),
                        f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"],
                       check=True)
        jobs = str(max(1, os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build), "-j", jobs], check=True)
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        built = build / f"_ext{suffix}"
        if not built.exists():
            raise OSError(f"cmake did not produce {built.name}")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)


setup(
    ext_modules=[CMakeExtension("edge0.backend.mlx.kernels._ext", SOURCE)],
    cmdclass={"build_ext": OptionalCMakeBuild},
)
