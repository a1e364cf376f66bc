"""FP8 KV-cache formats: the library's quantize_kv_fp8 / dequantize_kv_fp8 against the independent
quantiser and decoder of reference.py, byte for byte (SPEC section 4, flashmla-semantics.md 3.3-3.5)."""

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R


def _kv_with_edge_cases(fmt, nb, bs):
    kv = R.rand((nb, bs, 1, fmt.d), torch.float32)
    # magnitudes over many binades (scales differ per tile / token)
    kv = kv * torch.pow(2.0, torch.randint(-6, 7, (nb, bs, 1, 1)).float())
    kv[0, 0, 0, :fmt.tile] *= 1e-5             # tiny tile -> scale clamps at 2^-13
    kv[0, -1, 0, fmt.tile:2 * fmt.tile] *= 300  # large tile
    kv[-1, 0, 0, 3] = 0.0                       # an exact zero inside a tile
    tile = kv[-1, -1, 0, :fmt.tile]
    tile.copy_(tile.sign() * 0.25)              # amax/448 not a power of two, all equal magnitudes
    kv[-1, -1, 0, 0] = 448.0 * 2 ** -5          # amax/448 exactly a power of two
    return kv.to(torch.bfloat16)


def _block_bytes(kv8, fmt):
    return R.block_bytes_view(kv8, fmt)


def _mask_pad_bytes(fmt, bs):
    """Bytes of a block whose value the format defines (everything but MODEL1's pad byte)."""
    m = torch.ones(bs * fmt.bytes_per_token, dtype=torch.bool)
    if fmt.name == "model1":
        m[bs * 576 + 7::8] = False
    return m


@pytest.mark.parametrize("fmt_name,bs,nb", [("v32", 1, 3), ("v32", 16, 2), ("v32", 64, 2),
                                            ("model1", 1, 3), ("model1", 16, 2), ("model1", 64, 2),
                                            ("model1", 256, 1)])
def test_quantize_matches_reference_bytes(fmt_name, bs, nb):
    fmt = R.FORMATS[fmt_name]
    kv = _kv_with_edge_cases(fmt, nb, bs)
    got = flash_mla.quantize_kv_fp8(kv, fmt_name)
    assert got.dtype == torch.uint8
    assert tuple(got.shape) == (nb, bs, 1, fmt.bytes_per_token)
    assert got.stride(1) == fmt.bytes_per_token and got.stride(-1) == 1
    want = R.quantize_ref(kv, fmt)
    g, w = _block_bytes(got, fmt), _block_bytes(want, fmt)
    m = _mask_pad_bytes(fmt, bs)
    diff = (g[:, m] != w[:, m]).nonzero()
    assert diff.shape[0] == 0, (
        f"{diff.shape[0]} bytes differ; first (block, byte) {tuple(diff[0].tolist())}: "
        f"got {g[:, m][tuple(diff[0].tolist())].item():#04x} want {w[:, m][tuple(diff[0].tolist())].item():#04x}")


@pytest.mark.parametrize("fmt_name", ["v32", "model1"])
def test_dequantize_matches_reference_decoder(fmt_name):
    fmt = R.FORMATS[fmt_name]
    nb, bs = 3, 16
    kv = _kv_with_edge_cases(fmt, nb, bs)
    # bytes from the independent quantiser, with a padded block stride
    kv8 = R.quantize_ref(kv, fmt, block_stride_bytes=bs * fmt.bytes_per_token + 64)
    got = flash_mla.dequantize_kv_fp8(kv8, fmt_name)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (nb, bs, 1, fmt.d)
    want = R.dequantize_ref(kv8, fmt).view(nb, bs, 1, fmt.d)
    # power-of-two scales: the bf16 product is exact
    assert torch.equal(got.double(), want), (got.double() - want).abs().max()


@pytest.mark.parametrize("fmt_name", ["v32", "model1"])
def test_roundtrip(fmt_name):
    fmt = R.FORMATS[fmt_name]
    kv = _kv_with_edge_cases(fmt, 2, 64)
    deq = flash_mla.dequantize_kv_fp8(flash_mla.quantize_kv_fp8(kv, fmt_name), fmt_name)
    x = kv.double()
    # RoPE part is stored verbatim
    assert torch.equal(deq[..., fmt.d_nope:].double(), x[..., fmt.d_nope:])
    err = (deq[..., :fmt.d_nope].double() - x[..., :fmt.d_nope]).abs()
    tiles = x[..., :fmt.d_nope].unflatten(-1, (fmt.num_tiles, fmt.tile))
    s = torch.pow(2.0, torch.ceil(torch.log2((tiles.abs().amax(-1) / 448).clamp_min(1e-4))))
    bound = x[..., :fmt.d_nope].abs() * 2 ** -4 + s.repeat_interleave(fmt.tile, -1) * 2 ** -9
    assert (err <= bound).all()
    assert err.max() > 0  # the quantisation really happened


def test_model1_is_block_interleaved():
    """Token t's NoPE bytes start at t*576 inside the block and its scales at bs*576 + t*8."""
    fmt = R.MODEL1
    bs = 4
    kv = R.rand((1, bs, 1, 512))
    kv[0, 2] *= 64                      # token 2 has larger scales than the others
    got = _block_bytes(flash_mla.quantize_kv_fp8(kv, "model1"), fmt)[0]
    rope_t2 = kv[0, 2, 0, 448:].contiguous().view(torch.uint8)
    assert torch.equal(got[2 * 576 + 448:3 * 576], rope_t2)
    e = got[bs * 576:bs * 584].view(bs, 8)[:, :7].to(torch.int32)
    assert (e[2] > e[1]).all() and (e[2] > e[3]).all()


def test_v32_scales_are_float32_powers_of_two():
    kv = R.rand((1, 8, 1, 576)) * 3
    got = flash_mla.quantize_kv_fp8(kv, "v32")
    rec = _block_bytes(got, R.V32).view(8, 656)
    scales = rec[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    tiles = kv[0, :, 0, :512].float().unflatten(-1, (4, 128)).abs().amax(-1)
    assert (scales >= tiles / 448).all() and (scales < 2 * tiles / 448).all()


@pytest.mark.parametrize("fmt_name", ["v32", "model1"])
def test_quantize_accepts_strided_input(fmt_name):
    fmt = R.FORMATS[fmt_name]
    kv = _kv_with_edge_cases(fmt, 2, 16)
    a = flash_mla.quantize_kv_fp8(kv, fmt_name)
    b = flash_mla.quantize_kv_fp8(R.non_contiguous(kv), fmt_name)
    m = _mask_pad_bytes(fmt, 16)
    assert torch.equal(_block_bytes(a, fmt)[:, m], _block_bytes(b, fmt)[:, m])


@pytest.mark.parametrize("fmt_name", ["v32", "model1"])
def test_dequantize_accepts_int8_and_fp8_views(fmt_name):
    fmt = R.FORMATS[fmt_name]
    kv8 = R.quantize_ref(_kv_with_edge_cases(fmt, 2, 16), fmt)
    ref = flash_mla.dequantize_kv_fp8(kv8, fmt_name)
    for dt in (torch.int8, torch.float8_e4m3fn):
        assert torch.equal(flash_mla.dequantize_kv_fp8(kv8.view(dt), fmt_name), ref)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt_name", ["v32", "model1"])
def test_helpers_keep_the_input_device(fmt_name):
    """quantize_kv_fp8 / dequantize_kv_fp8 accept CUDA tensors (they round-trip through the CPU):
    the result comes back on the input's device and equals the CPU result."""
    fmt = R.FORMATS[fmt_name]
    kv = _kv_with_edge_cases(fmt, 2, 16)
    q_cpu = flash_mla.quantize_kv_fp8(kv, fmt_name)
    q_gpu = flash_mla.quantize_kv_fp8(kv.cuda(), fmt_name)
    assert q_gpu.device.type == "cuda" and q_gpu.dtype == q_cpu.dtype and q_gpu.shape == q_cpu.shape
    m = _mask_pad_bytes(fmt, 16)
    assert torch.equal(_block_bytes(q_gpu.cpu(), fmt)[:, m], _block_bytes(q_cpu, fmt)[:, m])
    # dequantize: a padded block stride on the GPU too
    kv8 = R.quantize_ref(kv, fmt, block_stride_bytes=16 * fmt.bytes_per_token + 64)
    d_cpu = flash_mla.dequantize_kv_fp8(kv8, fmt_name)
    d_gpu = flash_mla.dequantize_kv_fp8(R.to_device(kv8, "cuda"), fmt_name)
    assert d_gpu.device.type == "cuda" and d_gpu.dtype == d_cpu.dtype
    assert torch.equal(d_gpu.cpu(), d_cpu)
