"""Each kernel of the fused C++ step (deltaserve/ops/csrc) alone against its reference in deltaserve/ops or
deltaserve/model, on random inputs: the projections (every weight format against formats.dequantize), RMSNorm
and gated RMSNorm, RoPE, the GDN conv + recurrence (prompt, decode and verify tokens, from zero and from a given
state), the paged attention loop (decode and prompt chunks, GQA groups, partial last blocks), and the vision
tower's bf16 element-wise steps and fp32 blocks and merger."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.config import VisionConfig
from deltaserve.executor.fused_cpu.vision import _fp32_projection
from deltaserve.model import vision as vision_model
from deltaserve.model.gdn import l2norm
from deltaserve.model.layers import GatedRMSNorm, RMSNorm, RotaryEmbedding
from deltaserve.model.linear import store
from deltaserve.model.vision import PatchMerger, VisionBlock, attend, attend_bf16
from deltaserve.model.vision import rotate as vision_rotate
from deltaserve.ops.attention import decode_attention, prefill_attention, quantize_fp8
from deltaserve.ops.conv import causal_conv1d_reference
from deltaserve.ops.delta_rule import delta_rule_reference
from deltaserve.ops.formats import WeightFormat, dequantize, quantize
from deltaserve.ops.fused_ext import load_extension

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32 rounding: the kernels sum in other orders than torch
# the recurrence carries its rounding from token to token (states of unit scale, outputs after a norm)
GDN_TOL = dict(atol=5e-5, rtol=1e-4)


@pytest.fixture(scope="module", params=["native", "portable"])
def ext(request):
    """Both builds of the C++ step: for this CPU (-march=native), and portable (-march=x86-64-v2, where the
    sources' non-AVX-512 branches are compiled)."""
    return load_extension(portable=request.param == "portable")


# ---- projections ----------------------------------------------------------------------------------------
# Every format at its default group and at groups that are not multiples of 16 (scales lane by lane) or that
# leave a partial last group; K odd (int4's padded nibble), N not a multiple of the 64-output panel.
FORMATS = [WeightFormat.of("float32"), WeightFormat.of("bfloat16"), WeightFormat.of("fp8"),
           WeightFormat.of("fp8", 48), WeightFormat.of("int8"), WeightFormat.of("int8", 10), WeightFormat.of("int4"),
           WeightFormat.of("int4", 6)]
SHAPES = [(70, 33), (130, 200), (5, 1), (64, 1100)]  # (N, K): K blocks of kKBlock, a partial last one


def fmt_id(fmt: WeightFormat) -> str:
    return f"{fmt.name}-{fmt.group}" if fmt.quantized else fmt.name


def spec(weight: torch.Tensor, fmt: WeightFormat) -> tuple:
    """A part as the extension takes it, quantized from weight."""
    data, scale = quantize(weight, fmt)
    return data, scale, fmt.name, fmt.group


def reference(x: torch.Tensor, parts: list[tuple], k: int) -> torch.Tensor:
    """x @ cat(dequantize(part))^T, in float64: the kernels may differ only by fp32 summation rounding."""
    w = torch.cat([dequantize(d, s, WeightFormat.of(name, group or None), k) for d, s, name, group in parts])
    return x.double() @ w.double().T


def assert_close_to(got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, parts: list[tuple], k: int) -> None:
    """Within K ulps of sum |x w| (fp32 summation in any order), and no looser."""
    w = torch.cat([dequantize(d, s, WeightFormat.of(name, group or None), k) for d, s, name, group in parts])
    bound = k * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((got.double() - expected).abs() <= bound).all(), (got.double() - expected).abs().max()


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 12, 16, 21, 100])
def test_projection_of_each_format_matches_dequantize_then_matmul(ext, fmt: WeightFormat, rows: int) -> None:
    """The kernels read the stored bytes: 1..20 rows the dot-product kernel (16: two groups of rows), 21 and
    100 (a partial 6-row tile) the packed one. Each equals formats.dequantize(...) @ x^T but for the order of
    its fp32 sums."""
    g = torch.Generator().manual_seed(rows)
    for n_out, k_in in SHAPES:
        parts = [spec(torch.randn(n_out, k_in, generator=g), fmt)]
        x = torch.randn(rows, k_in, generator=g)
        got = ext.linear(x, parts)
        assert got.shape == (rows, n_out) and got.dtype == torch.float32
        assert_close_to(got, reference(x, parts, k_in), x, parts, k_in)
        # each row's sums do not depend on the other rows (the greedy screen recomputes panels row by row):
        # the same kernel on fewer rows gives the same numbers
        fewer = 1 if rows <= ext.DOT_ROWS else ext.DOT_ROWS + 1
        assert torch.equal(ext.linear(x[:fewer].contiguous(), parts), got[:fewer])


def each_row_count(ext, fmt: WeightFormat, n_out: int, k_in: int, most: int, seed: int):
    """For rows = 1..most of one random x: (rows, the projection of its first rows, each row projected alone,
    x, parts), the projection checked against the reference first."""
    g = torch.Generator().manual_seed(seed)
    parts = [spec(torch.randn(n_out, k_in, generator=g), fmt)]
    x = torch.randn(most, k_in, generator=g)
    expected = reference(x, parts, k_in)
    alone = torch.cat([ext.linear(x[r:r + 1].contiguous(), parts) for r in range(most)])
    for rows in range(1, most + 1):
        got = ext.linear(x[:rows].contiguous(), parts)
        assert_close_to(got, expected[:rows], x[:rows], parts, k_in)
        yield rows, got, alone, x, parts


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_projection_at_every_row_count_gives_each_row_its_own_sums(ext, fmt: WeightFormat) -> None:
    """1..24 rows: every row-block shape of the dot-product kernel (R rows x NO outputs, R x NO accumulators;
    the equal row groups past its largest R) and the packed kernel past them. N = 75 leaves partial output
    blocks of every width, K = 37 a partial 16-lane step (and, for the small groups, a partial last group).
    Every row is the reference's and, bit for bit, what the same kernel gives for that row alone (the greedy
    screen recomputes a panel for one row): a sum landing in another row's or output's accumulator fails."""
    dot_rows = ext.DOT_ROWS
    for rows, got, alone, x, parts in each_row_count(ext, fmt, n_out=75, k_in=37, most=24, seed=20):
        if rows <= dot_rows:
            assert torch.equal(got, alone[:rows]), rows
        else:  # the packed kernel: its first rows as it computes them for fewer rows
            assert torch.equal(got[:dot_rows + 1], ext.linear(x[:dot_rows + 1].contiguous(), parts)), rows


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_projection_of_long_rows_in_slices_of_k_gives_each_row_its_own_sums(ext, fmt: WeightFormat) -> None:
    """From 3 rows of K = 3601 on, the dot-product kernel takes K a slice at a time (its rows of x would not
    stay in L1), keeping each block's accumulators between slices: every row is the reference's and, bit for
    bit, what it is alone (one pass over K). The slices end inside groups of 10 and 6 (scales lane by lane)
    and on multiples of 32, 48 and 128; the last one has a partial 16-lane step; N = 37 leaves partial output
    blocks."""
    for rows, got, alone, _, _ in each_row_count(ext, fmt, n_out=37, k_in=3601, most=12, seed=21):
        assert torch.equal(got, alone[:rows]), rows


def on_threads(ext, threads: int, run, *args):
    """run(*args) on `threads` compute threads, and how many outputs it computed as streams of weight rows."""
    before_threads, before = torch.get_num_threads(), ext.dot_streamed_outputs()
    torch.set_num_threads(threads)
    try:
        out = run(*args)
    finally:
        torch.set_num_threads(before_threads)
    return out, ext.dot_streamed_outputs() - before


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_one_row_over_long_weight_runs_reads_them_as_streams_with_the_same_sums(ext, fmt: WeightFormat) -> None:
    """One row of x over a part of at least 256 KB, on one thread, reads its weight rows as four long streams
    at once (dot_streams; int_streams with int8 activations; AVX-512 builds): every output is the reference's
    and, bit for bit, what the blocks of consecutive rows give for the same row among two (the greedy screen
    and a verify step rely on it), argmax included. N = 1031 leaves 3 rows past the four streams; the small
    groups take their scales lane by lane. On two threads the blocks run (two cores' streams read no faster)."""
    g = torch.Generator().manual_seed(45)
    n_out, k_in = 1031, 1040
    parts = [spec(torch.randn(n_out, k_in, generator=g), fmt)]
    x = torch.randn(2, k_in, generator=g)
    streams = ext.VECTOR_KERNELS == "avx512"
    schemes = ["none", "int8"] if fmt.name in ("int8", "int4") and fmt.group == 32 else ["none"]
    row = x[:1].contiguous()
    for activations in schemes:
        one, streamed = on_threads(ext, 1, ext.linear, row, parts, activations)
        assert streamed == (n_out if streams else 0), activations
        assert torch.equal(one[0], ext.linear(x, parts, activations)[0]), activations
        top, streamed = on_threads(ext, 1, ext.linear_argmax, row, parts, activations)
        assert top.item() == one.argmax().item() and streamed == (n_out if streams else 0)
        again, streamed = on_threads(ext, 2, ext.linear, row, parts, activations)
        assert torch.equal(again, one) and streamed == 0
        if activations == "none":
            assert_close_to(one, reference(x[:1], parts, k_in), x[:1], parts, k_in)


@pytest.mark.parametrize("rows", [1, 7, 100])
def test_a_projection_of_parts_in_different_formats_is_the_linear_of_their_concatenation(ext, rows: int) -> None:
    """A fused group's parts may differ in format (int8 q|k|v|z with float32 b|a, as the loader leaves them):
    output columns in part order, parts that end inside a 64-output panel and inside a group of 4."""
    g = torch.Generator().manual_seed(rows)
    k_in = 40
    formats = [WeightFormat.of("int8"), WeightFormat.of("bfloat16"), WeightFormat.of("int4"), WeightFormat.of("fp8"),
               WeightFormat.of("float32")]
    parts = [spec(torch.randn(n, k_in, generator=g), fmt) for n, fmt in zip((48, 21, 3, 66, 2), formats)]
    x = torch.randn(rows, k_in, generator=g)
    got = ext.linear(x, parts)
    assert_close_to(got, reference(x, parts, k_in), x, parts, k_in)
    assert torch.equal(ext.linear(x, parts[:1]), got[:, :48])


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("rows", [1, 6, 40])
def test_projection_argmax_is_torch_argmax_of_its_outputs(ext, fmt: WeightFormat, rows: int) -> None:
    """linear_argmax keeps no outputs; it is torch.argmax of linear's, ties (the first wins) and NaN included."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 50, generator=g)
    weight[250] = weight[10]  # a tie across panels: column 10 wins
    parts = [spec(weight, fmt)]
    x = torch.randn(rows, 50, generator=g)
    x[0] = weight[10]  # rows where 10 and 250 hold the maximum
    if rows > 1:
        x[1, 3] = float("nan")  # a NaN row: argmax is its first NaN, column 0
    assert torch.equal(ext.linear_argmax(x, parts), ext.linear(x, parts).argmax(dim=1))


def test_projection_errors_name_the_problem(ext) -> None:
    x = torch.randn(2, 40)
    data, scale = quantize(torch.randn(8, 40), WeightFormat.of("int8"))
    with pytest.raises(RuntimeError, match="int8 weights need their scale"):
        ext.linear(x, [(data, None, "int8", 32)])
    with pytest.raises(RuntimeError, match=r"contiguous scale \[8, 4\] expected \(group 12\)"):
        ext.linear(x, [(data, scale, "int8", 12)])
    with pytest.raises(RuntimeError, match="int8 data is Char, got Float"):
        ext.linear(x, [(data.float(), scale, "int8", 32)])
    with pytest.raises(RuntimeError, match="weight format 'int3' is not known"):
        ext.linear(x, [(data, scale, "int3", 32)])
    with pytest.raises(RuntimeError, match="has 40 columns, got 20"):
        ext.linear(x, [(data[:, :20].contiguous(), scale, "int8", 32)])


# ---- norms and rotary ----------------------------------------------------------------------------------
def norm_rows(T: int, n: int, g: torch.Generator) -> torch.Tensor:
    """Rows of every scale, down to ones whose mean square is near eps (where eps decides the result)."""
    x = torch.randn(T, n, generator=g)
    return x * torch.logspace(-4, 1, T)[:, None]


def test_gelu_tanh_bf16_in_place_is_gelu_tanh_rounded_once(ext) -> None:
    """The vision tower's MLP activation on its bf16 product (executor/fused_cpu/vision.py): each value within
    one bf16 rounding of GELU (tanh) of it, x * sigmoid(2z) in fp64 (the same function as 0.5 x (1 + tanh z),
    without its cancellation in the negative tail), and of torch's fp32 GELU (tanh) up to that cancellation."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([6 * torch.randn(5000, generator=g), torch.linspace(-12, 12, 3001), torch.tensor(
        [0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0, 3e38, -3e38, float("inf"), float("-inf"), float("nan")])])
    x = x.to(torch.bfloat16)
    out = x.clone()
    ext.gelu_tanh_bf16_(out)
    xd = x.double()
    exact = xd * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (xd + 0.044715 * xd**3))
    torch.testing.assert_close(out.double(), exact, atol=1e-30, rtol=2**-8, equal_nan=True)
    torch.testing.assert_close(out.float(), F.gelu(x.float(), approximate="tanh"), atol=1e-6, rtol=2**-8,
                               equal_nan=True)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        ext.gelu_tanh_bf16_(x.float())
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        ext.gelu_tanh_bf16_(x[:8000].view(-1, 2)[:, 0])


def test_rotary_qk_bf16_in_place_is_the_vision_rotary_of_q_and_k(ext) -> None:
    """q and k of the vision tower's bf16 qkv product rotated in place: model/vision.py's rotate of each (fp32
    maths, rounded to bf16 once; a fused multiply-add may move a rounding step), v untouched."""
    g = torch.Generator().manual_seed(3)
    N, heads, hd = 37, 3, 16
    qkv = (4 * torch.randn(N, 3, heads, hd, generator=g)).to(torch.bfloat16)
    angles = 20 * torch.rand(N, hd // 2, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k, v = (qkv[:, i].clone() for i in range(3))
    ext.rotary_qk_bf16_(qkv, cos, sin)
    torch.testing.assert_close(qkv[:, 0], vision_rotate(q, cos, sin), atol=1e-5, rtol=2**-7)
    torch.testing.assert_close(qkv[:, 1], vision_rotate(k, cos, sin), atol=1e-5, rtol=2**-7)
    assert torch.equal(qkv[:, 2], v) and not torch.equal(qkv[:, 0], q)
    with pytest.raises(RuntimeError, match="qkv: \\[N, 3, heads, head_dim\\]"):
        ext.rotary_qk_bf16_(qkv[:, :2].contiguous(), cos, sin)
    with pytest.raises(RuntimeError, match="cos, sin"):
        ext.rotary_qk_bf16_(qkv, cos[:-1].contiguous(), sin[:-1].contiguous())


@pytest.mark.parametrize("heads, hd, segments", [(12, 64, [784]), (4, 8, [20, 64, 80]), (3, 72, [5, 32, 1]),
                                                 (2, 128, [17, 33]), (1, 2, [3])])
def test_vision_attention_bf16_is_attend_bf16(ext, heads, hd, segments) -> None:
    """The bf16 scheme's attention (bf16 pairs, an fp32 softmax) against its torch reference, model/vision.py
    attend_bf16: within a rounding step of the bf16 output (the sums' order moves an exponential's bf16
    rounding now and then). The reference itself is the fp32 attention within bf16's rounding."""
    if not ext.BF16_PAIR_KERNEL:
        pytest.skip("this build does not multiply bf16 pairs (no AVX512-BF16): the tower runs torch's SDPA")
    g = torch.Generator().manual_seed(hd)
    N = sum(segments)
    qkv = (2 * torch.randn(N, 3, heads, hd, generator=g)).to(torch.bfloat16)
    q, k, v = qkv.unbind(1)
    got = ext.vision_attention_bf16(qkv, segments)
    expected = attend_bf16(q, k, v, segments)
    assert got.dtype == torch.bfloat16 and got.shape == (N, heads * hd)
    torch.testing.assert_close(got.view(N, heads, hd).float(), expected.float(), atol=1e-3, rtol=2**-7)
    exact = attend(q.float(), k.float(), v.float(), segments)
    torch.testing.assert_close(expected.float(), exact, atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="head_dim even and at most 128"):
        ext.vision_attention_bf16(torch.zeros(4, 3, 1, 130, dtype=torch.bfloat16), [4])
    with pytest.raises(RuntimeError, match="segments: row counts summing to N"):
        ext.vision_attention_bf16(qkv, [N - 1])


def test_add_layer_norm_bf16_adds_the_product_then_normalizes_like_torch(ext) -> None:
    """The vision tower's residual add and LayerNorm: x += y in place (the fp32 sum torch's add_ makes), then
    torch's LayerNorm of x rounded to bf16 (within a rounding step: the mean and variance sum in another order)."""
    g = torch.Generator().manual_seed(4)
    T, n = 29, 200
    x = 3 * torch.randn(T, n, generator=g) + 1
    y = torch.randn(T, n, generator=g).to(torch.bfloat16)
    weight, bias = 1 + 0.1 * torch.randn(n, generator=g), 0.1 * torch.randn(n, generator=g)
    expected_x = x + y.float()
    expected = F.layer_norm(expected_x, (n,), weight, bias, 1e-6)
    got = ext.add_layer_norm_bf16(x, y, weight, bias, 1e-6)
    assert torch.equal(x, expected_x) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=1e-5, rtol=2**-7)
    alone = ext.add_layer_norm_bf16(x, None, weight, bias, 1e-6)  # no product to add: x unchanged
    assert torch.equal(x, expected_x) and torch.equal(alone, got)
    with pytest.raises(RuntimeError, match="y: the shape of x"):
        ext.add_layer_norm_bf16(x, y[:, :-1].contiguous(), weight, bias, 1e-6)
    with pytest.raises(RuntimeError, match="weight, bias"):
        ext.add_layer_norm_bf16(x, y, weight[:-1].contiguous(), bias[:-1].contiguous(), 1e-6)


# The fp32 scheme of a small vision tower (vision.h): its reference is model/vision.py on fp32 input, whose
# products widen the stored weights exactly; LayerNorms, GELU, the softmax's exp and the sums run in other orders
# or approximations, on values of unit scale.
VISION_F32_TOL = dict(atol=1e-4, rtol=1e-4)


def _vision_config(act: str = "gelu_pytorch_tanh") -> VisionConfig:
    return VisionConfig(depth=1, hidden_size=48, num_heads=3, intermediate_size=80, patch_size=8,
                        temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=40, num_position_embeddings=16,
                        hidden_act=act)


def _randomized(module: torch.nn.Module, g: torch.Generator, bf16: tuple[str, ...],
                quantized: dict[str, WeightFormat] | None = None) -> torch.nn.Module:
    """module with random LayerNorms (weights near 1) and biases, the projections named in bf16 stored in bf16,
    those in `quantized` in their format with int8 activations (--quantization's), the others fp32, as the
    loader stores a checkpoint's."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    for name in bf16:
        linear = module.get_submodule(name)
        linear.weight = torch.nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
    for name, fmt in (quantized or {}).items():
        linear = module.get_submodule(name)
        data, scale = quantize(linear.weight.detach(), fmt)
        store(linear, fmt)
        linear.weight.copy_(data)
        linear.weight_scale.copy_(scale)
        linear.activation_quantization = "int8"
    return module.eval()


def _norm_spec(norm: torch.nn.LayerNorm) -> tuple:
    return norm.weight.detach(), norm.bias.detach(), norm.eps


def _vision_tables(N: int, hd: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = 20 * torch.rand(N, hd // 2, generator=g)
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu", "silu", "quick_gelu"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8-int4"])
def test_vision_block_f32_is_the_vision_block_on_fp32_input(ext, act, quantized) -> None:
    """One VisionBlock in fp32 in place on the residual stream: qkv and fc1 stored in bf16, proj and fc2 in fp32
    (each read where it is), or proj in int8 and fc2 in int4 with their int8 activations (activation_quant.py:
    the step's integer kernels, the VNNI tiles from their fewest rows on); three segments (frames) of unequal
    length, each attending within itself."""
    g = torch.Generator().manual_seed(5)
    cfg = _vision_config(act)
    formats = {"attn.proj": WeightFormat.of("int8", 16), "mlp.linear_fc2": WeightFormat.of("int4", 16)}
    block = _randomized(VisionBlock(cfg), g, bf16=("attn.qkv", "mlp.linear_fc1"),
                        quantized=formats if quantized else None)
    segments = [5, 23, 12]
    N = sum(segments)
    x = torch.randn(N, cfg.hidden_size, generator=g)
    cos, sin = _vision_tables(N, cfg.head_dim, g)
    with torch.no_grad():
        expected = block(x, cos, sin, segments)
    spec = (_norm_spec(block.norm1), _fp32_projection(block.attn.qkv), _fp32_projection(block.attn.proj),
            _norm_spec(block.norm2), _fp32_projection(block.mlp.linear_fc1), _fp32_projection(block.mlp.linear_fc2))
    tiles = ext.vnni_tile_panels()
    ext.vision_block_f32(x, *spec, cfg.num_heads, act, cos, sin, segments)
    if quantized:
        # where fp32 rounding (the LayerNorm's sums in another order) moves a value across an int8 rounding step,
        # its row's quantized value differs by the step: a few outputs move by more than fp32 rounding
        rms = ((x - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()
        assert rms <= 1e-3
        torch.testing.assert_close(x, expected, atol=1e-2 * expected.abs().max().item(), rtol=1e-2)
    else:
        torch.testing.assert_close(x, expected, **VISION_F32_TOL)
    assert (ext.vnni_tile_panels() > tiles) == (quantized and ext.vnni_tiles_supported())
    # One segment of all rows is another attention: the segments are honoured.
    whole = x.clone()
    ext.vision_block_f32(whole, *spec, cfg.num_heads, act, cos, sin, [N])
    with torch.no_grad():
        assert not torch.allclose(whole, block(x, cos, sin, segments), **VISION_F32_TOL)
    with pytest.raises(RuntimeError, match="segments: row counts summing to N = 40"):
        ext.vision_block_f32(x, *spec, cfg.num_heads, act, cos, sin, [5, 23])
    with pytest.raises(RuntimeError, match="vision activation 'relu' is not known"):
        ext.vision_block_f32(x, *spec, cfg.num_heads, "relu", cos, sin, segments)
    with pytest.raises(RuntimeError, match="qkv: a contiguous float32 bias"):
        ext.vision_block_f32(x, spec[0], (spec[1][0], spec[1][1][:-1], "none"), *spec[2:], cfg.num_heads, act, cos,
                             sin, segments)


def test_vision_block_f32_with_bf16_attention_rounds_q_k_v_to_bf16(ext, monkeypatch) -> None:
    """bf16_attention (the tower of int8-activation projections): the block's attention is vision_attention_bf16 on
    q, k, v rounded to bf16 (model/vision.py attend_bf16 on them, widened back), the rest as without it."""
    g = torch.Generator().manual_seed(7)
    cfg = _vision_config()
    block = _randomized(VisionBlock(cfg), g, bf16=("attn.qkv",))
    segments = [9, 27]
    N = sum(segments)
    x = torch.randn(N, cfg.hidden_size, generator=g)
    cos, sin = _vision_tables(N, cfg.head_dim, g)
    spec = (_norm_spec(block.norm1), _fp32_projection(block.attn.qkv), _fp32_projection(block.attn.proj),
            _norm_spec(block.norm2), _fp32_projection(block.mlp.linear_fc1), _fp32_projection(block.mlp.linear_fc2))
    if not ext.BF16_PAIR_KERNEL:
        with pytest.raises(RuntimeError, match="bf16_attention: this build does not multiply bf16 pairs"):
            ext.vision_block_f32(x, *spec, cfg.num_heads, cfg.hidden_act, cos, sin, segments, bf16_attention=True)
        return
    with torch.no_grad():
        exact = block(x, cos, sin, segments)
        monkeypatch.setattr(vision_model, "attend", attend_bf16)  # q, k, v rounded to bf16, fp32 out
        expected = block(x, cos, sin, segments)
    ext.vision_block_f32(x, *spec, cfg.num_heads, cfg.hidden_act, cos, sin, segments, bf16_attention=True)
    torch.testing.assert_close(x, expected, atol=1e-3, rtol=1e-3)
    assert not torch.allclose(x, exact, **VISION_F32_TOL)


def test_vision_merger_f32_is_the_patch_merger_on_fp32_input(ext) -> None:
    """PatchMerger in fp32: each 2x2 block's four normed rows side by side through fc1 (bf16), exact GELU and fc2
    (fp32) to the text width."""
    g = torch.Generator().manual_seed(6)
    cfg = _vision_config()
    merger = _randomized(PatchMerger(cfg), g, bf16=("linear_fc1",))
    x = 2 * torch.randn(36, cfg.hidden_size, generator=g)
    with torch.no_grad():
        expected = merger(x)
    got = ext.vision_merger_f32(x, _norm_spec(merger.norm), merger.merged, _fp32_projection(merger.linear_fc1),
                                _fp32_projection(merger.linear_fc2))
    assert got.shape == (9, cfg.out_hidden_size)
    torch.testing.assert_close(got, expected, **VISION_F32_TOL)
    with pytest.raises(RuntimeError, match="a multiple of merged"):
        ext.vision_merger_f32(x[:-1].contiguous(), _norm_spec(merger.norm), merger.merged,
                              _fp32_projection(merger.linear_fc1), _fp32_projection(merger.linear_fc2))


def test_rms_norm_matches_the_model_norm(ext) -> None:
    g = torch.Generator().manual_seed(0)
    for n in (16, 37, 192):
        norm = RMSNorm(n, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(n, generator=g) * 0.3)
        x = norm_rows(12, n, g)
        with torch.no_grad():
            torch.testing.assert_close(ext.rms_norm(x, 1.0 + norm.weight, norm.eps), norm(x), **TOL)


def test_gated_rms_norm_matches_the_model_norm(ext) -> None:
    g = torch.Generator().manual_seed(1)
    for n in (12, 32, 64):
        norm = GatedRMSNorm(n, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(n, generator=g) * 0.3 + 1)
        x = norm_rows(12, 3 * n, g).view(12, 3, n)
        z = torch.randn(12, 3, n, generator=g) * 3
        with torch.no_grad():
            torch.testing.assert_close(ext.gated_rms_norm(x, z, norm.weight, norm.eps), norm(x, z), **TOL)


@pytest.mark.parametrize("rotary_dim", [8, 16, 32], ids=["partial-0.25", "partial-0.5", "full"])
def test_rotary_matches_the_model_rotary(ext, rotary_dim: int) -> None:
    g = torch.Generator().manual_seed(rotary_dim)
    rope = RotaryEmbedding(rotary_dim, theta=10_000_000.0)
    positions = torch.randint(0, 4096, (9,), generator=g)
    x = torch.randn(9, 3, 32, generator=g)
    cos, sin = rope.cos_sin(positions)
    torch.testing.assert_close(ext.rotary(x, positions, rope.inv_freq), rope(x, cos, sin), **TOL)


# ---- Gated DeltaNet ------------------------------------------------------------------------------------
def gdn_reference(x, conv_w, neg_a, dt_bias, norm_w, conv_state, ssm_state, hk: int, dk: int, eps: float):
    """deltaserve/model/gdn.py between in_proj and out_proj, from the ops references, for one sequence:
    (core [T, hv dv], conv state after, recurrent state after)."""
    C, hv, dv = conv_w.shape[0], neg_a.numel(), norm_w.numel()
    T, rep = x.shape[0], hv // hk
    qkv, z, b, a = x.split([C, hv * dv, hv, hv], dim=-1)
    mixed, conv_state = causal_conv1d_reference(qkv, conv_w, conv_state)
    q, k, v = F.silu(mixed).split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = (l2norm(q.reshape(T, hk, dk)) * dk**-0.5).repeat_interleave(rep, dim=1)
    k = l2norm(k.reshape(T, hk, dk)).repeat_interleave(rep, dim=1)
    decay = neg_a * F.softplus(a + dt_bias)
    o, ssm_state = delta_rule_reference(q, k, v.reshape(T, hv, dv), decay, b.sigmoid(), ssm_state)
    norm = GatedRMSNorm(dv, eps)
    with torch.no_grad():
        norm.weight.copy_(norm_w)
        return norm(o, z.reshape(T, hv, dv)).reshape(T, hv * dv), conv_state, ssm_state


# (query length, starts from zeros, verify segment): a prompt, a continued chunk, decodes from a given
# state and from zeros, verify segments of 3 (from a given state) and 2 (from zeros, shorter than the width),
# and segments long enough for the chunked form (gdn.cpp kChunkedTokens): a prompt of two chunks and a part,
# a continued one of one chunk and a part
GDN_SEQS = [(7, True, False), (5, False, False), (1, False, False), (1, True, False), (3, False, True),
            (2, True, True), (150, True, False), (70, False, False)]


@pytest.mark.parametrize("kernel", [4, 3], ids=["kernel-4", "kernel-3"])
@pytest.mark.parametrize("dk, dv", [(16, 32), (8, 12), (64, 72)], ids=["dv-32", "dv-12", "two-conv-blocks"])
def test_gdn_recurrence_matches_the_ops_reference(ext, kernel: int, dk: int, dv: int) -> None:
    """two-conv-blocks: 544 conv channels, the conv pass's 512-channel blocks and a short one."""
    hk, hv, eps, width = 2, 4, 1e-6, 3
    C = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(kernel * 100 + dv)
    B = len(GDN_SEQS)
    lens = [n for n, _, _ in GDN_SEQS]
    qsl = torch.tensor([0] + lens).cumsum(0)
    T = int(qsl[-1])
    x = torch.randn(T, C + hv * dv + 2 * hv, generator=g)
    conv_w = torch.randn(C, kernel, generator=g) * 0.5
    neg_a = -torch.empty(hv).uniform_(0.5, 8, generator=g)
    dt_bias = torch.randn(hv, generator=g) * 0.5
    norm_w = torch.randn(dv, generator=g) * 0.2 + 1
    slots = torch.tensor([4, 0, 5, 2, 1, 3, 7, 6])  # one spare slot (8) that nothing touches
    conv_cache = torch.randn(B + 1, C, kernel - 1, generator=g)
    ssm_cache = torch.randn(B + 1, hv, dk, dv, generator=g)
    context = torch.tensor([0 if fresh else 9 for _, fresh, _ in GDN_SEQS])
    spec_index = torch.full((B,), -1)
    spec_index[[b for b, (_, _, verify) in enumerate(GDN_SEQS) if verify]] = torch.arange(2)
    conv_after, ssm_after = conv_cache.clone(), ssm_cache.clone()
    core, spec_conv, spec_ssm = ext.gdn_recurrence(
        x, conv_w, neg_a, dt_bias, norm_w, conv_after, ssm_after, qsl, context, slots, spec_index, width, eps
    )
    assert spec_conv.shape == (2, width, C, kernel - 1) and spec_ssm.shape == (2, width, hv, dk, dv)
    for b, (n, fresh, verify) in enumerate(GDN_SEQS):
        s, e, slot = int(qsl[b]), int(qsl[b + 1]), int(slots[b])
        conv0 = torch.zeros(C, kernel - 1) if fresh else conv_cache[slot]
        ssm0 = torch.zeros(hv, dk, dv) if fresh else ssm_cache[slot]
        args = (conv_w, neg_a, dt_bias, norm_w)
        out, conv1, ssm1 = gdn_reference(x[s:e], *args, conv0, ssm0, hk, dk, eps)
        torch.testing.assert_close(core[s:e], out, **GDN_TOL)
        if not verify:
            torch.testing.assert_close(conv_after[slot], conv1, **GDN_TOL)
            torch.testing.assert_close(ssm_after[slot], ssm1, **GDN_TOL)
            continue
        assert torch.equal(conv_after[slot], conv_cache[slot]) and torch.equal(ssm_after[slot], ssm_cache[slot])
        row = int(spec_index[b])
        for i in range(width):  # the states after each position; padding positions keep the last one
            _, conv_i, ssm_i = gdn_reference(x[s : s + min(i + 1, n)], *args, conv0, ssm0, hk, dk, eps)
            torch.testing.assert_close(spec_conv[row, i], conv_i, **GDN_TOL)
            torch.testing.assert_close(spec_ssm[row, i], ssm_i, **GDN_TOL)
    assert torch.equal(conv_after[B], conv_cache[B]) and torch.equal(ssm_after[B], ssm_cache[B])


# ---- paged attention -----------------------------------------------------------------------------------
# (query tokens, positions they end at): decodes at 1, 16 (a full block), 37 and 50 positions (partial last
# blocks), a verify-like segment of 3, a continued chunk of 20 over 37 and a fresh prompt of 18
ATTN_SEQS = [(1, 1), (1, 16), (1, 37), (1, 50), (3, 41), (20, 37), (18, 18)]


@pytest.mark.parametrize("nh, nkv, hd, block_size", [
    (8, 2, 64, 16), (6, 1, 32, 16), (8, 1, 64, 16), (3, 3, 48, 16), (12, 1, 16, 16), (4, 2, 16, 8),
    (4, 2, 40, 16),
], ids=["group-4", "group-6", "group-8", "group-1-hd48", "group-12", "block-8", "group-2-hd40"])
@pytest.mark.parametrize("prompts", ["loop", "torch-kernel"])
@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_paged_attention_matches_the_ops_reference(ext, nh: int, nkv: int, hd: int, block_size: int,
                                                   prompts: str, kv: str) -> None:
    """fp8: the cache holds E4M3 codes of rows of very different sizes with their row scales; the loop widens
    them in registers, the reference dequantizes first."""
    g = torch.Generator().manual_seed(nh * 1000 + hd + block_size)
    need = [-(-L // block_size) for _, L in ATTN_SEQS]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()  # each sequence's blocks scattered in the cache
    width = max(need) + 1  # tables padded past their last block
    tables = torch.zeros(len(ATTN_SEQS), width, dtype=torch.long)
    for b, n_blocks in enumerate(need):
        tables[b, :n_blocks] = torch.tensor(order[:n_blocks])
        order = order[n_blocks:]
    positions = torch.cat([torch.arange(L - n, L) for n, L in ATTN_SEQS])
    qsl = torch.tensor([0] + [n for n, _ in ATTN_SEQS]).cumsum(0)
    q = torch.randn(int(qsl[-1]), nh, hd, generator=g)
    k_cache = torch.randn(num_blocks, nkv, hd, block_size, generator=g)
    v_cache = torch.randn(num_blocks, block_size, nkv, hd, generator=g)
    scales = None
    tol = TOL
    if kv == "fp8":  # rows from 1e-3 to 10 (outputs to 10: fp32 rounding ten times the unit-scale one's)
        sizes = torch.logspace(-3, 1, num_blocks * block_size)
        k_cache *= sizes[torch.randperm(len(sizes), generator=g)].view(num_blocks, 1, 1, block_size)
        v_cache *= sizes.view(num_blocks, block_size, 1, 1)
        tol = dict(atol=1e-4, rtol=1e-4)
        k_codes, k_scale = quantize_fp8(k_cache.transpose(2, 3))  # a key row is a column of its block
        v_cache, v_scale = quantize_fp8(v_cache)
        k_cache, k_scale = k_codes.transpose(2, 3).contiguous(), k_scale.contiguous()
        scales = (k_scale, v_scale)
    loop_kv_bytes = 8 << 20 if prompts == "loop" else 0  # 0: chunks of more than 16 tokens to torch's kernel
    got = ext.paged_attention(q, k_cache, v_cache, positions, qsl, tables, loop_kv_bytes,
                              *(scales if scales is not None else ()))
    scale = hd**-0.5
    for b, (n, L) in enumerate(ATTN_SEQS):
        s, e = int(qsl[b]), int(qsl[b + 1])
        if n == 1:
            expected = decode_attention(q[s:e], k_cache, v_cache, tables[b : b + 1], torch.tensor([L]), scale, scales)
        else:
            expected = prefill_attention(q[s:e], k_cache, v_cache, tables[b], L, scale, scales)
        torch.testing.assert_close(got[s:e], expected, **tol)


def test_fp8_rows_quantize_as_the_reference(ext) -> None:
    """The fp8 cache's writes (fp8.h) and deltaserve/ops/attention.py's quantize_fp8: the same codes and
    scales, bit for bit, over rows of every size, a zero row, and values on E4M3's rounding ties."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 64, generator=g) * torch.logspace(-30, 30, 400)[:, None]
    x[7] = 0.0
    x[8, :3] = torch.tensor([448.0, 1.0625, -1.1875])  # scale 1: ties round to the even code
    x[8, 3:] = 0.0
    codes, scales = ext.quantize_fp8(x)
    want_codes, want_scales = quantize_fp8(x)
    assert codes.dtype == want_codes.dtype == torch.float8_e4m3fn
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes[8, :3].float(), torch.tensor([448.0, 1.0, -1.25]))


def test_fp8_codes_widen_as_torch_converts_them(ext) -> None:
    """Every one of the 256 E4M3 codes, NaNs (0x7f, 0xff) included, widened by the one definition (fp8.h) as
    both its readers use it: an fp8 weight row (formats.h) and an fp8 KV cache's value row (attention), each
    against torch's float8_e4m3fn -> float32 conversion. A single cached position with a zero key takes
    probability 1, so the attention output is its value row times its scale (1)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    assert want.isnan().sum() == 2
    # a weight [256, 16] whose row b holds code b 16 times, times x = e_0: y[0, b] is code b's value
    weight = codes[:, None].expand(256, 16).contiguous().view(torch.float8_e4m3fn)
    x = torch.zeros(1, 16)
    x[0, 0] = 1.0
    got = ext.linear(x, [(weight, torch.ones(256, 1), "fp8", 16)])
    torch.testing.assert_close(got[0], want, rtol=0, atol=0, equal_nan=True)
    # one block of 16 positions, one kv head of 256 dims: position 0's value row holds every code
    v_cache = torch.zeros(1, 16, 1, 256, dtype=torch.uint8)
    v_cache[0, 0, 0] = codes
    k_cache = torch.zeros(1, 1, 256, 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = (torch.ones(1, 1, 16), torch.ones(1, 16, 1))
    out = ext.paged_attention(torch.randn(1, 1, 256), k_cache, v_cache.view(torch.float8_e4m3fn),
                              torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([[0]]), 8 << 20, *scales)
    torch.testing.assert_close(out[0, 0], want, rtol=0, atol=0, equal_nan=True)


# ---- sparse MoE ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("values", ["fp32", "bf16", "int4", "zero-router"])
@pytest.mark.parametrize("family, fields", [("qwen3_5_moe", {}), ("qwen3_next", {"norm_topk_prob": False})])
def test_moe_mlp_matches_the_python_block(ext, family: str, fields: dict, values: str, rows: int) -> None:
    """The MoE MLP alone against deltaserve/model/moe.py's SparseMoeBlock: the experts as row blocks of their
    3-D tensors in a stored format (the block computes with the same values dequantized; the router stays
    fp32 as the loader leaves it), renormalised or not, and a zero router (every expert ties: torch.topk's
    choice, not the lowest ids)."""
    from deltaserve.config import ModelConfig
    from deltaserve.model.moe import SparseMoeBlock
    from tests.checkpoints import TINY, hf_moe_config

    cfg = ModelConfig.from_dict({**hf_moe_config(family, TINY, **fields).to_dict(), "architectures": None})
    torch.manual_seed(rows)
    block = SparseMoeBlock(cfg)
    fmt = WeightFormat.of({"bf16": "bfloat16", "int4": "int4"}.get(values, "float32"))
    stored: dict[str, tuple] = {}
    with torch.no_grad():
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.3)
        if values == "zero-router":
            block.gate.weight.zero_()
        for name, p in block.named_parameters():
            if name == "gate.weight":
                stored[name] = (p.detach(), None, "float32", 0)
                continue
            data, scale = quantize(p, fmt)
            p.copy_(dequantize(data, scale, fmt, p.shape[-1]))  # the values the kernel reads
            stored[name] = (data, scale, fmt.name, fmt.group)
    x = torch.randn(rows, cfg.hidden_size)
    got = ext.moe_mlp(x, [stored[n] for n in ("gate.weight", "shared_expert.gate_proj.weight",
                                              "shared_expert.up_proj.weight", "shared_expert_gate.weight")],
                      stored["shared_expert.down_proj.weight"], stored["experts.gate_up_proj"],
                      stored["experts.down_proj"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    with torch.no_grad():
        torch.testing.assert_close(got, block(x), atol=1e-5, rtol=1e-5)
