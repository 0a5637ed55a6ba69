"""Activation quantization (activation_quantization = "int8", deltaserve/ops/activation_quant.py): the C++
integer kernel (deltaserve/ops/csrc/linear_int.h; VNNI lanes where the group is a multiple of 8; in AVX2
builds, steps of 32 columns where the group and K are multiples of 32; plain loops otherwise and in the
portable build) against the scheme's reference, in every row count the engine runs (decode, verify rows,
batched steps, prompt chunks), with partial groups, odd K and K not a multiple of 64, parts of several formats
in one projection, the fused argmax and the sparse-MoE MLP; the Python modules' forward against the same
reference; and the setting's checks."""

from __future__ import annotations

import pytest
import torch

import deltaserve.model.linear as model_linear
from deltaserve.engine.config import EngineConfig, EngineConfigError
from deltaserve.model.linear import Linear, shared_activations, store
from deltaserve.model.mlp import MLP
from deltaserve.ops.activation_quant import fake_quantize, linear_reference, quantize_activations
from deltaserve.ops.formats import WeightFormat, dequantize, quantize
from deltaserve.ops.fused_ext import load_extension
from tests.test_kernels import assert_close_to, fmt_id, reference, spec


@pytest.fixture(scope="module", params=["native", "portable"])
def ext(request):
    return load_extension(portable=request.param == "portable")


# groups that are multiples of 8 take the VNNI lanes (native build), 10 and 6 the plain loops; int4's lanes
# take 128 columns a step: groups of 8 fill a step's 16-group scale window, and 40 starts steps mid-group
FORMATS = [WeightFormat.of("int8"), WeightFormat.of("int4"), WeightFormat.of("int8", 8), WeightFormat.of("int4", 16),
           WeightFormat.of("int8", 24), WeightFormat.of("int4", 128), WeightFormat.of("int8", 10),
           WeightFormat.of("int4", 6), WeightFormat.of("int4", 8), WeightFormat.of("int4", 40)]
# (N, K); in AVX2 builds, K = 64, 96 and 320 take the AVX2 kernel for groups of 32 and 128 (96 and 320: a last
# group shorter than 128; int4: K = 64 and 320, groups of 32 and 128); one row takes int8 rows of 1000 bytes and
# int4 ones of 550 four outputs a block (one prefetch stream of 4 KB), 70: a tail of two
SHAPES = [(70, 33), (130, 200), (5, 1), (64, 1100), (9, 127), (17, 64), (33, 96), (70, 320), (70, 1000)]


def int_bound(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat, k: int) -> torch.Tensor:
    """K ulps of sum |x~ w| (fp32 sums in any order) for the quantized x~: far below one step of q_x."""
    w = dequantize(data, scale, fmt, k).double().abs()
    return (k + 4) * 2.0**-23 * (fake_quantize(x, fmt.group).double().abs() @ w.T) + 1e-30


def assert_matches_the_scheme(got: torch.Tensor, x: torch.Tensor, part: tuple, k: int) -> None:
    data, scale, name, group = part
    fmt = WeightFormat.of(name, group)
    want = linear_reference(x, data, scale, fmt, k).double()
    error = (got.double() - want).abs()
    assert (error <= int_bound(x, data, scale, fmt, k)).all(), error.max()


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 12, 13, 16, 20, 130])
def test_int8_activation_projection_is_the_scheme(ext, fmt: WeightFormat, rows: int) -> None:
    """Each output is the reference's sum of exact int32 group dots times scale_x x scale_w, but for the order
    of its fp32 sums; up to INT_KERNEL_ROWS rows, the same rows alone give the same numbers (one row: a block of 8 or 4
    outputs), and from there on the numbers are the float kernel's over the quantized x."""
    g = torch.Generator().manual_seed(rows)
    for n_out, k_in in SHAPES:
        part = spec(torch.randn(n_out, k_in, generator=g), fmt)
        x = torch.randn(rows, k_in, generator=g) * torch.logspace(-3, 3, rows)[:, None]
        if rows > 2:
            x[2] = 0.0  # an all-zero row: scale 0
        panels = ext.amx_panels(), ext.vnni_tile_panels()
        got = ext.linear(x, [part], "int8")
        # a prompt chunk where AMX or the VNNI tiles run (tests/test_tile_kernels.py)
        amx, vnni = ext.amx_panels() > panels[0], ext.vnni_tile_panels() > panels[1]
        assert got.shape == (rows, n_out) and got.dtype == torch.float32
        assert_matches_the_scheme(got, x, part, k_in)
        if rows <= ext.INT_KERNEL_ROWS and not (amx or vnni):  # the integer kernel sums each row alone
            assert torch.equal(ext.linear(x[:1].contiguous(), [part], "int8"), got[:1])
        elif amx or vnni:  # the tile kernels too, from their least rows on
            least = ext.AMX_ROWS if amx else ext.VNNI_TILE_ROWS
            if rows < least:  # AVX2's, from one row on for the parts its integer kernel does not take
                assert vnni and ext.VECTOR_KERNELS == "avx2" and (k_in % 32 or fmt.group % 32 or fmt.name == "int4")
                least = 1
            assert fmt.group % 4 == 0
            assert torch.equal(ext.linear(x[-least:].contiguous(), [part], "int8"), got[-least:])
        else:  # a prompt chunk: the packed float kernel over x~ = q_x * s_x, as the Python model computes it
            assert torch.equal(got, ext.linear(fake_quantize(x, fmt.group), [part], "none"))
        if k_in >= 33:  # not the float path: its outputs are off by the quantization of x
            assert not torch.equal(got, ext.linear(x, [part], "none"))


def test_a_non_finite_group_makes_its_row_nan(ext) -> None:
    g = torch.Generator().manual_seed(0)
    for fmt in (WeightFormat.of("int8"), WeightFormat.of("int4"), WeightFormat.of("int8", 10)):
        part = spec(torch.randn(20, 70, generator=g), fmt)
        x = torch.randn(3, 70, generator=g)
        x[1, 40] = float("nan")
        x[2, 3] = float("inf")
        got = ext.linear(x, [part], "int8")
        assert got[1:].isnan().all() and not got[0].isnan().any()
        assert linear_reference(x, *part[:2], fmt, 70)[1:].isnan().all()


@pytest.mark.parametrize("rows", [1, 7, 20])
def test_parts_in_several_formats_each_take_their_path(ext, rows: int) -> None:
    """int8 q|k|v with float32 b|a in one projection (as the loader leaves GDN's in_proj): the int8 / int4
    parts (of two groups: x is quantized for each) follow the scheme, the others the float path."""
    g = torch.Generator().manual_seed(rows)
    k_in = 200
    formats = [WeightFormat.of("int8"), WeightFormat.of("bfloat16"), WeightFormat.of("int4", 16),
               WeightFormat.of("fp8"), WeightFormat.of("float32"), WeightFormat.of("int8")]
    parts = [spec(torch.randn(n, k_in, generator=g), fmt) for n, fmt in zip((48, 21, 3, 66, 2, 70), formats)]
    x = torch.randn(rows, k_in, generator=g)
    got = ext.linear(x, parts, "int8")
    start = 0
    for part, fmt in zip(parts, formats, strict=True):
        n = part[0].shape[0]
        mine = got[:, start:start + n]
        if fmt.name in ("int8", "int4"):
            assert_matches_the_scheme(mine, x, part, k_in)
        else:
            assert_close_to(mine, reference(x, [part], k_in), x, [part], k_in)
        start += n


@pytest.mark.parametrize("fmt", FORMATS[:2] + [WeightFormat.of("int4", 6)], ids=fmt_id)
@pytest.mark.parametrize("rows", [1, 6, 20])
def test_int8_activation_argmax_is_torch_argmax_of_its_outputs(ext, fmt: WeightFormat, rows: int) -> None:
    """The greedy path of an int8 / int4 lm_head (linear_argmax) under the scheme: ties and NaN included."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 50, generator=g)
    weight[250] = weight[10]  # a tie across panels: column 10 wins
    part = spec(weight, fmt)
    x = torch.randn(rows, 50, generator=g)
    x[0] = weight[10]
    if rows > 1:
        x[1, 3] = float("nan")
    got = ext.linear_argmax(x, [part], "int8")
    assert torch.equal(got, ext.linear(x, [part], "int8").argmax(dim=1))
    assert got[0] == 10


def test_an_unknown_setting_is_named(ext) -> None:
    part = spec(torch.randn(4, 32), WeightFormat.of("int8"))
    with pytest.raises(RuntimeError, match="activation_quantization 'int4' is not known"):
        ext.linear(torch.randn(1, 32), [part], "int4")


def test_quantized_rows_are_the_documented_ones() -> None:
    x = torch.tensor([[1.0, -0.5, 0.25, 127.0, 0.0, 0.0, 3.0], [0.5, 1.5, -2.5, 0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_activations(x, 4)
    assert torch.equal(scale, torch.tensor([[1.0, 3.0 / 127], [2.5 / 127, 0.0]]))
    assert torch.equal(q[0, :4], torch.tensor([1, 0, 0, 127], dtype=torch.int8))  # -0.5, 0.25: to even
    assert torch.equal(q[0, 4:], torch.tensor([0, 0, 127], dtype=torch.int8))
    assert torch.equal(q[1, :3], torch.tensor([25, 76, -127], dtype=torch.int8))  # 76.2 -> 76
    assert torch.equal(q[1, 4:], torch.zeros(3, dtype=torch.int8))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_the_python_module_and_the_kernel_compute_the_scheme(ext, name: str) -> None:
    """Linear.forward with activation_quantization "int8" (the torch executor's path): the reference's sums,
    and with "none" the dequantized matmul; the fused kernel agrees with it."""
    g = torch.Generator().manual_seed(1)
    fmt = WeightFormat.of(name)
    module = Linear(100, 40)
    store(module, fmt)
    data, scale = quantize(torch.randn(40, 100, generator=g), fmt)
    module.weight.data.copy_(data)
    module.weight_scale.data.copy_(scale)
    x = torch.randn(5, 100, generator=g)
    part = (module.weight, module.weight_scale, name, fmt.group)
    with torch.no_grad():
        exact = module(x)
        module.activation_quantization = "int8"
        got = module(x)
    assert_matches_the_scheme(got, x, part, 100)
    torch.testing.assert_close(ext.linear(x, [part], "int8"), got, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exact, x @ dequantize(data, scale, fmt, 100).T, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, exact)


def _stored_linear(k: int, n: int, fmt: WeightFormat, g: torch.Generator) -> Linear:
    module = Linear(k, n)
    store(module, fmt)
    data, scale = quantize(torch.randn(n, k, generator=g), fmt)
    module.weight.data.copy_(data)
    if scale is not None:
        module.weight_scale.data.copy_(scale)
    module.activation_quantization = "int8"
    return module


def test_sibling_projections_quantize_their_input_once(monkeypatch) -> None:
    """Projections that read the same x (an MLP's gate and up) quantize it once per group size among them,
    and compute exactly what each module computes alone."""
    g = torch.Generator().manual_seed(4)
    int8, int4 = WeightFormat.of("int8"), WeightFormat.of("int4", 16)
    a, b, c, d = (_stored_linear(64, 24, f, g) for f in (int8, int4, int8, WeightFormat.of("float32")))
    x = torch.randn(6, 64, generator=g)
    calls = []

    def counted(x: torch.Tensor, group: int) -> torch.Tensor:
        calls.append(group)
        return fake_quantize(x, group)

    monkeypatch.setattr(model_linear, "fake_quantize", counted)
    with torch.no_grad():
        xa, xb, xc, xd = shared_activations(x, a, b, c, d)
        assert calls == [int8.group, int4.group] and xa is xc and xd is x
        for module, xm in ((a, xa), (b, xb), (c, xc)):
            assert torch.equal(xm, fake_quantize(x, module.fmt.group))
            assert torch.equal(module(x, xm), module(x))
        mlp = MLP(64, 24)
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = a, c, _stored_linear(24, 64, int8, g)
        calls.clear()
        got = mlp(x)
        assert calls == [int8.group, int8.group]  # x once for gate and up, then down's input
        assert torch.equal(got, mlp.down_proj(torch.nn.functional.silu(a(x)) * c(x)))


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_moe_mlp_with_int8_activations_matches_the_python_block(ext, name: str, rows: int) -> None:
    """The experts and the shared expert, stored in int8 / int4, quantize their inputs in both the C++ MoE MLP
    and the Python block; the router stays float32 (as the loader leaves it) and reads x as it is."""
    from tests.test_moe_decode import decode_block, moe_args

    block, activations = decode_block(name, seed=rows)
    assert activations == "int8"
    x = torch.randn(rows, block.gate.weight.shape[1])
    args = moe_args(block)
    got = ext.moe_mlp(x, *args, activation_quantization="int8")
    with torch.no_grad():
        want = block(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - ext.moe_mlp(x, *args)).abs().max() > 1e-4  # the float path differs by the quantization


def test_the_setting_defaults_to_int8_for_int_weights_and_refuses_others() -> None:
    assert EngineConfig(quantization="int8").activation_quantization == "int8"
    assert EngineConfig(quantization="int4").activation_quantization == "int8"
    assert EngineConfig(quantization="int4", activation_quantization="none").activation_quantization == "none"
    assert EngineConfig().activation_quantization == "none"
    assert EngineConfig(quantization="fp8").activation_quantization == "none"
    with pytest.raises(EngineConfigError, match="applies to int8 or int4 weights .*not to 'fp8'"):
        EngineConfig(quantization="fp8", activation_quantization="int8")
    with pytest.raises(EngineConfigError, match="applies to int8 or int4 weights"):
        EngineConfig(activation_quantization="int8")
    with pytest.raises(EngineConfigError,
                       match="activation_quantization 'fp8' is not known; accepted: int8, bf16, none"):
        EngineConfig(quantization="int8", activation_quantization="fp8")


def test_the_cli_flag_reaches_the_engine_config() -> None:
    from deltaserve.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "-q", "int4", "--activation-quantization", "none"])
    assert EngineConfig(**engine_kwargs(args)).activation_quantization == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--activation-quantization", "int4"])


@pytest.mark.parametrize("fmt", [WeightFormat.of("int8"), WeightFormat.of("int4"), WeightFormat.of("int8", 128),
                                 WeightFormat.of("int4", 64)], ids=fmt_id)
def test_avx2_rows_are_the_same_bits_in_any_number_of_rows(fmt: WeightFormat) -> None:
    """In AVX2 builds the integer kernel (up to VNNI_TILE_ROWS - 1 rows, for the groups and K it takes) and the
    register tiles (from there on) sum each row's group dots alike: a row's outputs do not depend on the rows
    beside it, so that a speculative verify step scores a token as a one-row decode step would. Parts the integer
    kernel does not take (K = 48) run the tiles at any number of rows. K = 96 is an odd number of groups of 32
    (the one-row kernel's pairs of groups end with one alone)."""
    ext = load_extension()
    if ext.VECTOR_KERNELS != "avx2":
        pytest.skip("the AVX2 kernels run in native builds on CPUs with AVX2 but not AVX-512")
    g = torch.Generator().manual_seed(fmt.group)
    for n_out, k_in in ((150, 320), (40, 48), (70, 96)):
        part = spec(torch.randn(n_out, k_in, generator=g), fmt)
        x = torch.randn(64, k_in, generator=g) * torch.logspace(-2, 2, 64)[:, None]
        alone = torch.cat([ext.linear(x[t:t + 1].contiguous(), [part], "int8") for t in range(64)])
        tiles = ext.vnni_tile_panels()
        for rows in (2, 3, 5, ext.VNNI_TILE_ROWS - 1, ext.VNNI_TILE_ROWS, 16, 64):
            assert torch.equal(ext.linear(x[:rows].contiguous(), [part], "int8"), alone[:rows]), (k_in, rows)
        assert ext.vnni_tile_panels() > tiles
