"""Where the codecs' kernels come from: the extension minddp._C, or the pure-torch reference.

torch.ops.minddp.* serve a device where the extension has kernels for it;
elsewhere reference.py's ops give the same numbers, slower, and minddp says
so once per device (and once at import when the extension is missing).
"""
import warnings

import torch

from minddp.compression import reference

try:
    import minddp._C  # noqa: F401  (loading it registers torch.ops.minddp.*)
    HAVE_EXTENSION = True
except ImportError as e:
    HAVE_EXTENSION = False
    warnings.warn(f"minddp: the C++ extension minddp._C is not available ({e}); compression "
                  f"runs on pure torch ops, which is slower. Build it with `make setup` or "
                  f"`pip install --no-build-isolation -e .`.", RuntimeWarning, stacklevel=2)

_warned_devices = set()


def kernels_for(device):
    """The module whose compress/decompress/decompress_add_ serve tensors on `device`."""
    device_type = torch.device(device).type
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if HAVE_EXTENSION and key and torch._C._dispatch_has_kernel_for_dispatch_key(
            "minddp::compress", key):
        return torch.ops.minddp
    if HAVE_EXTENSION and device_type not in _warned_devices:
        _warned_devices.add(device_type)
        warnings.warn(f"minddp: minddp._C has no {device_type} kernels (built without CUDA?); "
                      f"compression of {device_type} tensors runs on pure torch ops. Rebuild "
                      f"where torch has CUDA and nvcc to get them.", RuntimeWarning, stacklevel=2)
    return reference
