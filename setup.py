"""Builds the C++ attention engine (csrc/ -> hyper_parallel._C) at install time.

Every ``csrc/**/*.cpp`` is compiled into one extension registered through TORCH_LIBRARY.
Requires torch to be installed first (use ``pip install --no-build-isolation``).
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - install-time guard
    raise SystemExit(
        "hyper_parallel builds a C++ extension against torch: install torch first "
        "(pip install -c constraints.txt torch==2.13.0) and then install this package "
        "with --no-build-isolation."
    ) from exc



class BuildEngine(BuildExtension):
    """BuildExtension that refuses an extension with a statically linked libstdc++.

    Such a build (e.g. a compiler wrapper that adds ``-static-libstdc++``) carries a second
    libstdc++ beside torch's: its locale facets are never initialised, and the first integer
    formatted into an error message (``TORCH_CHECK(..., n)``) crashes the process with SIGSEGV
    instead of raising. Seen on a GPU image whose default ``g++`` was such a wrapper.
    """

    def run(self):
        super().run()
        if not sys.platform.startswith("linux") or shutil.which("ldd") is None:
            return
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            if not os.path.exists(path):
                continue
            deps = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
            if "libstdc++" not in deps:
                raise SystemExit(
                    f"{path} does not link libstdc++ dynamically (the compiler "
                    f"{os.environ.get('CXX', 'c++')!r} links it statically), so C++ errors "
                    "would crash instead of raising. Rebuild with the system compiler, e.g. "
                    "CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install --no-build-isolation -e .")


sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
extra = ["-O3", "-fopenmp", "-std=c++17"]

setup(
    ext_modules=[
        CppExtension(
            "hyper_parallel._C",
            sources,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args={"cxx": extra},
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildEngine.with_options(use_ninja=True)},
)
