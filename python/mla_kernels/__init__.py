"""mla-kernels: Multi-head Latent Attention kernels for DeepSeek-style models.

Importing the package loads the compiled extension, which registers ``torch.ops.mla_kernels.*``.
The sgl-kernel-compatible API is :mod:`mla_kernels.flash_mla`.
"""

import os as _os

import torch as _torch

__version__ = "0.1.0"

_LIB = _os.path.join(_os.path.dirname(__file__), "libmla_kernels_ops.so")
if not _os.path.exists(_LIB):
    raise ImportError(
        f"mla_kernels: the compiled extension {_LIB} is missing; install the package with "
        "`pip install --no-build-isolation .` from the repository root"
    )
_torch.ops.load_library(_LIB)

from . import _ops  # noqa: E402,F401  (fake kernels for torch.compile)
from .formats import dequantize_kv_fp8, quantize_kv_fp8  # noqa: E402

__all__ = ["quantize_kv_fp8", "dequantize_kv_fp8", "__version__"]
