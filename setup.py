"""Builds minddp and its optional extension minddp._C.

    pip install --no-build-isolation -e .     # uses the environment's torch

The C++ kernels in csrc/*.cpp always build. The CUDA kernels in csrc/cuda/
build only where torch has CUDA and nvcc exists (CUDA_HOME); elsewhere the
extension is CPU-only. The extension is optional: without torch at build time,
with MINDDP_NO_EXTENSION=1, or when compiling fails, minddp installs without
it and runs on pure torch ops (it says so once at import).
"""
import glob
import os
import sys

from setuptools import find_packages, setup


def extension():
    """(ext_modules, cmdclass) for minddp._C, or nothing when it cannot be built."""
    sources = sorted(glob.glob("csrc/*.cpp"))
    if not sources or os.environ.get("MINDDP_NO_EXTENSION") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print("minddp: torch is not importable at build time, so minddp._C is skipped; "
              "build with `pip install --no-build-isolation .`", file=sys.stderr)
        return [], {}

    class OptionalBuildExt(BuildExtension):
        """A failed compile leaves minddp without its kernels instead of failing the install
        (torch's ninja build raises errors that setuptools' `optional` does not catch)."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - the compiler's error, reported and skipped
                print(f"minddp: WARNING: building {ext.name} failed ({e}); minddp will run on "
                      f"pure torch ops", file=sys.stderr)

    # -ffp-contract=off: no FMA contraction, so decompress_add_ rounds twice
    # exactly like its pure-torch reference. No -march: the AVX-512 and AVX2 kernels are
    # picked at run time (csrc/cpu_kernels.h), the build runs on any x86-64.
    # No -std: torch adds the C++ standard its own headers need.
    cxx = ["-O3", "-ffp-contract=off"]
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
    wants_cuda = torch.cuda.is_available() or os.environ.get("MINDDP_FORCE_CUDA") == "1"
    if wants_cuda and cuda_sources and CUDA_HOME is not None and torch.version.cuda is not None:
        ext = CUDAExtension("minddp._C", sources + cuda_sources, optional=True,
                            define_macros=[("MINDDP_WITH_CUDA", None)],
                            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]})
    else:
        ext = CppExtension("minddp._C", sources, optional=True, extra_compile_args={"cxx": cxx})
    return [ext], {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}


ext_modules, cmdclass = extension()
setup(
    name="minddp",
    version="0.1.0",
    description="PyTorch DistributedDataParallel internals, rebuilt to read and to change",
    # minddp only: top-level `benchmarks` and `examples` in site-packages would collide with
    # other projects'. They run from the checkout, which tools/make_venv.sh puts on the venv's
    # path and pytest.ini on the tests' (tests/test_packaging.py holds this list to minddp).
    packages=find_packages(include=["minddp", "minddp.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.9",
)
