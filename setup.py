"""Builds minddp and its optional extension minddp._C.

The C++ kernels in csrc/*.cpp always build. The CUDA kernels in csrc/cuda/
build only where torch has CUDA and nvcc exists (CUDA_HOME); elsewhere the
extension is CPU-only. Set MINDDP_NO_EXTENSION=1 to skip the extension
entirely (minddp then runs on pure torch ops and says so).
"""
import glob
import os

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
sources = sorted(glob.glob("csrc/*.cpp"))
if sources and os.environ.get("MINDDP_NO_EXTENSION") != "1":
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    cxx = ["-O3", "-std=c++17"]
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
    if torch.cuda.is_available() or os.environ.get("MINDDP_FORCE_CUDA") == "1":
        use_cuda = bool(cuda_sources) and CUDA_HOME is not None and torch.version.cuda is not None
    else:
        use_cuda = False
    if use_cuda:
        ext = CUDAExtension("minddp._C", sources + cuda_sources,
                            define_macros=[("MINDDP_WITH_CUDA", None)],
                            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math"]})
    else:
        ext = CppExtension("minddp._C", sources, extra_compile_args={"cxx": cxx})
    ext_modules = [ext]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(
    name="minddp",
    version="0.1.0",
    description="PyTorch DistributedDataParallel internals, rebuilt to read and to change",
    packages=find_packages(include=["minddp", "minddp.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.9",
)
