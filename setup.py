"""Builds the C++ attention engine (csrc/ -> hyper_parallel._C) at install time.

Every ``csrc/**/*.cpp`` is compiled into one extension registered through TORCH_LIBRARY.
Requires torch to be installed first (use ``pip install --no-build-isolation``).
"""
import glob
import os

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - install-time guard
    raise SystemExit(
        "hyper_parallel builds a C++ extension against torch: install torch first "
        "(pip install -c constraints.txt torch==2.13.0) and then install this package "
        "with --no-build-isolation."
    ) from exc

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
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
