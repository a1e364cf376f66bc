"""FP8 KV-cache formats of SPEC §4: quantise a BF16 cache, and decode one back.

``"v32"``: d_qk 576, 656 bytes per token (512 e4m3 NoPE, 4 float32 scales, 64 bf16 RoPE).
``"model1"``: d_qk 512, 584 bytes per token, block-interleaved (576-byte NoPE+RoPE records of all
tokens of a page block, then their 8-byte ue8m0 scale records).
"""

import torch

FORMATS = ("v32", "model1")
BYTES_PER_TOKEN = {"v32": 656, "model1": 584}
HEAD_DIM = {"v32": 576, "model1": 512}


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def quantize_kv_fp8(kv_bf16: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantise ``kv_bf16 [num_blocks, page_block_size, 1, d]`` (bf16; d = 576 for v32, 512 for
    model1) into a uint8 cache ``[num_blocks, page_block_size, 1, bytes_per_token]``.

    Per token and NoPE tile: ``scale = 2**ceil(log2(max(amax / 448, 1e-4)))``, ``e4m3 = x / scale``
    (round to nearest even); the RoPE part is copied. Byte-identical to FlashMLA's reference quantiser.
    """
    _check_fmt(fmt)
    device = kv_bf16.device
    out = torch.ops.mla_kernels.quantize_kv_fp8(kv_bf16.cpu(), fmt)
    return out.to(device)


def dequantize_kv_fp8(kv8: torch.Tensor, fmt: str) -> torch.Tensor:
    """Decode an FP8 cache ``[num_blocks, page_block_size, 1, bytes_per_token]`` (uint8, int8 or
    float8_e4m3fn) into bf16 ``[num_blocks, page_block_size, 1, d]``: the keys the kernels see."""
    _check_fmt(fmt)
    device = kv8.device
    out = torch.ops.mla_kernels.dequantize_kv_fp8(kv8.cpu(), fmt)
    return out.to(device)
