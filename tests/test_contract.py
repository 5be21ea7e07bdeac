"""The contract machinery (epmoe._contract) and every stage's declaration.

Each declaration rejects a wrong dtype / rank / shape / device / static argument with its op's
message, and its one-pass checks (``ok``, ``direct``) agree with the full check on a grid of good
and bad inputs (every single fault and every pair of them). Devices differ as CPU vs meta.
"""

import importlib
import itertools
from typing import NamedTuple

import pytest
import torch

from epmoe import _contract as C
from epmoe import layer
from epmoe.ops import activation as A
from epmoe.ops import combine as CB
from epmoe.ops import dispatch as D
from epmoe.ops import gemv as GV
from epmoe.ops.gemm import _validate as G

Q = importlib.import_module("epmoe.ops.quantize")
P = importlib.import_module("epmoe.ops.permute")
U = importlib.import_module("epmoe.ops.unpermute")
LS = importlib.import_module("epmoe.ops.ll_scatter")
LG = importlib.import_module("epmoe.ops.ll_gather")

bf, f32, i32, i64, i8 = torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.int8
FP8 = torch.float8_e4m3fn
META = torch.device("meta")


def z(*shape, dtype=f32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


class Case(NamedTuple):
    name: str
    contract: C.Contract
    good: tuple
    bad: list  # (parameter, bad value, message regex)


def _cases():
    x, ids, w = z(4, 256, dtype=bf), z(4, 2, dtype=i64), z(4, 2)
    y2, y3 = z(8, 256, dtype=bf), z(2, 4, 256, dtype=bf)
    mm, mi, offs = z(2, dtype=i32), z(8, dtype=i32), z(3, dtype=i32)
    b2, b3 = z(3, 256), z(2, 256, dtype=bf)  # expert biases of y2 (rows by m_indices) and y3
    a8, w8, s8, ws8 = z(2, 4, 128, dtype=i8), z(2, 256, 128, dtype=i8), z(2, 4, 1), z(2, 256)
    a8c = z(8, 128, dtype=i8)
    af, wf = z(8, 256, dtype=FP8), z(2, 256, 256, dtype=FP8)
    afs, wfs = z(8, 2), z(2, 2, 2)
    src = z(8, dtype=i32)  # (a gathering GEMM1's a_rows: rows of a 5-row a)
    yl, rows = z(2, 8, 256, dtype=bf), z(4, 2, dtype=i32)
    cpu = torch.device("cpu")
    return [
        Case(
            "quantize",
            Q.CONTRACT,
            (x, "fp8", 128, None, "row", None),
            [
                ("scheme", "int4", r"quantize: scheme expected one of 'fp8', 'int8', got 'int4'"),
                ("x", x.int(), r"quantize: x expected dtype torch.bfloat16 or .*, got torch.int32"),
                ("x", z(256, dtype=bf), r"quantize: x expected a 2-D or 3-D tensor, got shape"),
                ("group_size", True, r"quantize: group_size expected a positive int, got True"),
                ("group_size", 96, r"x.shape\[-1\] expected a multiple of 96 \(fp8 group_size\)"),
                (
                    "scale_layout",
                    "col",
                    r"quantize: scale_layout expected one of 'row', 'deepgemm'",
                ),
                ("masked_m", mm, r"quantize: masked_m expected None for a 2-D x, got a tensor"),
                ("width", 255, r"quantize: width expected None or an int >= H = 256 \(x's col"),
                ("width", True, r"quantize: width expected None or an int >= H = 256"),
                ("width", 320, r"quantize: width expected a multiple of 128 \(fp8 group_size\)"),
            ],
        ),
        Case(
            "quantize width",
            Q.CONTRACT,
            (x[:, :160], "fp8", 128, None, "row", 256),
            [
                ("width", None, r"quantize: x.shape\[-1\] expected a multiple of 128"),
                ("width", 159, r"quantize: width expected None or an int >= H = 160"),
            ],
        ),
        Case(
            "quantize masked",
            Q.CONTRACT,
            (y3, "int8", 128, mm, "deepgemm", None),
            [
                ("masked_m", mm[:1], r"quantize: masked_m expected shape \[2\], got \[1\]"),
                ("masked_m", mm.float(), r"quantize: masked_m expected dtype torch.int32 or"),
                ("masked_m", mm.to(META), r"quantize: masked_m expected device cpu \(same as the"),
                ("masked_m", 3, r"quantize: masked_m expected a torch.Tensor, got int"),
            ],
        ),
        Case(
            "permute",
            P.CONTRACT,
            (x, ids, 4, 128, afs[:4], "deepgemm"),
            [
                ("x", z(4, dtype=bf), r"permute: x expected a 2-D tensor, got shape \(4,\)"),
                ("scale_layout", "col", r"permute: scale_layout expected one of"),
                ("topk_ids", ids.float(), r"permute: topk_ids expected dtype torch.int32 or"),
                ("topk_ids", ids[:3], r"permute: topk_ids expected shape \[4, any\], got \[3, 2\]"),
                ("topk_ids", ids.to(META), r"permute: topk_ids expected device cpu"),
                ("num_experts", 0, r"permute: num_experts expected a positive int, got 0"),
                ("alignment", 4.0, r"permute: alignment expected a positive int, got 4.0"),
                ("x_scales", afs[:3], r"permute: x_scales expected shape \[4, any\], got \[3, 2\]"),
                ("x_scales", afs[:4].half(), r"permute: x_scales expected dtype torch.float32"),
                ("x_scales", afs[:4].to(META), r"permute: x_scales expected device cpu"),
            ],
        ),
        Case(
            "unpermute",
            U.CONTRACT,
            (y2, rows, w, None, None, None),
            [
                ("y", y3, r"unpermute: y expected a 2-D tensor, got shape \(2, 4, 256\)"),
                ("y", y2.int(), r"unpermute: y expected dtype"),
                ("inv_perm", rows.float(), r"unpermute: inv_perm expected dtype torch.int32 or"),
                ("inv_perm", rows[0], r"unpermute: inv_perm expected a 2-D tensor"),
                ("topk_weights", w[:, :1], r"unpermute: topk_weights expected shape \[4, 2\], got"),
                ("topk_weights", w.to(META), r"unpermute: topk_weights expected device cpu"),
                ("hidden", 0, r"unpermute: hidden expected None or an int in \[1, 256\] \(y's"),
                ("hidden", 257, r"unpermute: hidden expected None or an int in \[1, 256\]"),
                ("hidden", True, r"unpermute: hidden expected None or an int in \[1, 256\]"),
            ],
        ),
        Case(
            "unpermute bias",
            U.CONTRACT,
            (y2, rows, w, z(3, 256, dtype=bf), mi, 200),
            [
                ("bias", z(3, 256, dtype=i32), r"unpermute: bias expected dtype torch.bfloat16"),
                ("bias", z(256), r"unpermute: bias expected a 2-D tensor"),
                ("bias", z(3, 199), r"unpermute: bias expected at least 200 columns \(the out"),
                ("bias", z(3, 256, device="meta"), r"unpermute: bias expected device cpu"),
                ("m_indices", None, r"unpermute: m_indices expected permute's m_indices with a"),
                ("m_indices", mi[:7], r"unpermute: m_indices expected shape \[8\], got \[7\]"),
                ("m_indices", mi.long(), r"unpermute: m_indices expected dtype torch.int32"),
                ("m_indices", mi.to(META), r"unpermute: m_indices expected device cpu"),
                ("hidden", 257, r"unpermute: hidden expected None or an int in \[1, 256\]"),
            ],
        ),
        Case(
            "silu_and_mul 2-D",
            A.CONTRACT,
            (y2, None, mi, offs, "silu", b2),
            [
                ("gate", "swish", r"silu_and_mul: gate expected a gate spec .*, got 'swish'"),
                ("gate", "relu:limit=0", r"silu_and_mul: gate expected a gate spec"),
                ("gate", None, r"silu_and_mul: gate expected a gate spec .*, got None"),
                (
                    "bias",
                    b2[:, :128],
                    r"silu_and_mul: bias expected shape \[any, 256\], got \[3, 128\]",
                ),
                ("bias", b2.int(), r"silu_and_mul: bias expected dtype"),
                ("bias", b2.to(META), r"silu_and_mul: bias expected device cpu"),
                ("m_indices", None, r"silu_and_mul: m_indices expected int32 \[M_sum\] .* a bias"),
                ("y", y2[:, :255], r"silu_and_mul: y.shape\[-1\] expected a multiple of 2 \(gate"),
                ("y", z(8, dtype=bf), r"silu_and_mul: y expected a 2-D or 3-D tensor"),
                ("masked_m", mm, r"silu_and_mul: masked_m expected None for a 2-D y"),
                ("m_indices", mi[:7], r"silu_and_mul: m_indices expected shape \[8\], got \[7\]"),
                (
                    "m_indices",
                    mi.long(),
                    r"silu_and_mul: m_indices expected dtype torch.int32, got",
                ),
                ("m_indices", mi.view(2, 4), r"silu_and_mul: m_indices expected a 1-D tensor"),
                ("expert_offsets", offs[:0], r"silu_and_mul: expert_offsets expected \[E \+ 1\]"),
                ("expert_offsets", offs.to(META), r"silu_and_mul: expert_offsets expected device"),
            ],
        ),
        Case(
            "silu_and_mul 3-D",
            A.CONTRACT,
            (y3, mm, None, None, "gelu_tanh:limit=7", b3),
            [
                ("bias", b2, r"silu_and_mul: bias expected shape \[2, 256\], got \[3, 256\]"),
                ("bias", b3[0], r"silu_and_mul: bias expected shape \[any, 256\], got \[256\]"),
                ("gate", "gelu_tanh:alpha=2", r"silu_and_mul: gate expected a gate spec"),
                ("masked_m", mm[:1], r"silu_and_mul: masked_m expected shape \[2\], got \[1\]"),
                ("m_indices", mi, r"silu_and_mul: m_indices expected None for a 3-D y"),
                ("expert_offsets", offs, r"silu_and_mul: expert_offsets expected None for a 3-D y"),
            ],
        ),
        Case(
            "silu_and_mul_quant",
            A.CONTRACT_QUANT,
            (y2, "fp8", None, 128, mi, "row", offs, "silu:alpha=1.702,limit=7,up_offset=1", b2),
            [
                ("gate", "silu:beta=1", r"silu_and_mul_quant: gate expected a gate spec"),
                ("bias", z(3, 512), r"silu_and_mul_quant: bias expected shape \[any, 256\]"),
                ("m_indices", None, r"silu_and_mul_quant: m_indices expected int32"),
                ("scheme", "int4", r"silu_and_mul_quant: scheme expected one of 'fp8', 'int8'"),
                ("group_size", 0, r"silu_and_mul_quant: group_size expected a positive int, got 0"),
                ("group_size", 96, r"y.shape\[-1\] // 2 expected a multiple of 96 \(fp8 group\)"),
                ("scale_layout", "col", r"silu_and_mul_quant: scale_layout expected one of"),
                ("y", y2.int(), r"silu_and_mul_quant: y expected dtype"),
            ],
        ),
        Case(
            "silu_and_mul_quant no GLU",
            A.CONTRACT_QUANT,
            (y3, "fp8", mm, 128, None, "deepgemm", None, "relu2:glu=0", None),
            [
                ("group_size", 96, r"silu_and_mul_quant: y.shape\[-1\] expected a multiple of 96"),
                ("bias", b2, r"silu_and_mul_quant: bias expected shape \[2, 256\]"),
            ],
        ),
        Case(
            "gemm masked int8",
            G.MASKED,
            (a8, w8, mm, s8, ws8),
            [
                ("a", a8.float(), r"grouped_gemm: a expected dtype torch.bfloat16 or"),
                ("a", a8c, r"grouped_gemm: a expected a 3-D tensor"),
                ("w", w8.float(), r"grouped_gemm: w expected dtype torch.int8, got torch.float32"),
                ("w", w8[:, :, :64], r"grouped_gemm: w expected shape \[E, N, 128\] \(K of a\)"),
                ("w", w8[:1], r"grouped_gemm: a expected shape \[1, T, 128\] \(E of w\)"),
                ("w", w8.to(META), r"grouped_gemm: w expected device cpu"),
                ("masked_m", mm[:1], r"grouped_gemm: masked_m expected shape \[2\], got \[1\]"),
                ("masked_m", mm.long(), r"grouped_gemm: masked_m expected dtype torch.int32"),
                ("masked_m", mm.to(META), r"grouped_gemm: masked_m expected device cpu"),
                ("a_scales", None, r"grouped_gemm: a_scales/w_scales expected tensors for int8"),
                ("a_scales", s8.half(), r"grouped_gemm: a_scales expected dtype torch.float32"),
                ("a_scales", s8[:, :3], r"grouped_gemm: a_scales expected shape \[2, 4, 1\]"),
                ("w_scales", ws8[:, :64], r"grouped_gemm: w_scales expected shape \[2, 256\]"),
                ("w_scales", ws8.to(META), r"grouped_gemm: w_scales expected device cpu"),
            ],
        ),
        Case(
            "gemm contiguous fp8",
            G.CONTIGUOUS,
            (af, wf, mi, afs, wfs, offs, None),
            [
                ("m_indices", mi[:7], r"grouped_gemm: m_indices expected shape \[8\], got \[7\]"),
                ("m_indices", None, r"grouped_gemm: m_indices expected a torch.Tensor, got None"),
                ("expert_offsets", offs[:2], r"grouped_gemm: expert_offsets expected shape \[3\]"),
                ("expert_offsets", offs.long(), r"grouped_gemm: expert_offsets expected dtype"),
                ("a_scales", afs[:, :1], r"grouped_gemm: a_scales expected shape \[8, 2\]"),
                ("w_scales", wfs[:, :1], r"grouped_gemm: w_scales expected shape \[2, 2, 2\]"),
                ("w", wf[:, :192], r"grouped_gemm: N expected a multiple of 128 \(fp8 weight"),
            ],
        ),
        Case(
            "gemm contiguous bf16",
            G.CONTIGUOUS,
            (y2, z(2, 64, 256, dtype=bf), mi, None, None, None, None),
            [
                ("a_scales", afs, r"grouped_gemm: a_scales expected None for bf16 operands"),
                ("w_scales", wfs, r"grouped_gemm: w_scales expected None for bf16 operands"),
            ],
        ),  # fmt: skip
        Case(
            "gemm contiguous fp8, rows through a_rows",
            G.CONTIGUOUS,
            (af[:5], wf, mi, afs[:5], wfs, offs, src),
            [
                ("a_rows", src.long(), r"grouped_gemm: a_rows expected dtype torch.int32, got"),
                ("a_rows", src.view(2, 4), r"grouped_gemm: a_rows expected a 1-D tensor"),
                ("a_rows", src[:7], r"grouped_gemm: m_indices expected shape \[7\], got \[8\]"),
                ("a_rows", src.to(META), r"grouped_gemm: a_rows expected device cpu"),
                ("a_scales", afs, r"grouped_gemm: a_scales expected shape \[5, 2\], got \[8, 2\]"),
            ],
        ),  # fmt: skip
        Case(
            "gemv_gate_up fp8",
            GV.UP,
            (x, ids, wf, wfs, "silu", z(2, 256, dtype=bf)),
            [
                ("x", x.float(), r"gemv_gate_up: x expected dtype torch.bfloat16, got"),
                ("x", z(256, dtype=bf), r"gemv_gate_up: x expected a 2-D tensor, got shape"),
                ("topk_ids", ids[:3], r"gemv_gate_up: topk_ids expected shape \[4, any\], got"),
                ("topk_ids", ids.float(), r"gemv_gate_up: topk_ids expected dtype torch.int32 or"),
                ("topk_ids", ids.to(META), r"gemv_gate_up: topk_ids expected device cpu"),
                ("w1", wf.float(), r"gemv_gate_up: w1 expected dtype torch.bfloat16 or torch.f"),
                ("w1", wf[0], r"gemv_gate_up: w1 expected a 3-D tensor, got shape"),
                ("w1", wf[:, :255], r"gemv_gate_up: w1 expected shape \[E, 2I, H\] \(an even row"),
                ("w1", wf[:, :, :128], r"gemv_gate_up: x expected at most 128 columns \(w1's H\)"),
                ("w1", wf.to(META), r"gemv_gate_up: w1 expected device cpu"),
                ("w1", z(2, 384, 256, dtype=FP8), r"gemv_gate_up: I expected a multiple of 128 f"),
                ("w1_scales", None, r"gemv_gate_up: w1_scales expected a float32 tensor for fp8"),
                ("w1_scales", wfs.double(), r"gemv_gate_up: w1_scales expected dtype torch.float"),
                ("w1_scales", wfs[:, :1], r"gemv_gate_up: w1_scales expected shape \[2, 2, 2\]"),
                ("w1_scales", wfs.to(META), r"gemv_gate_up: w1_scales expected device cpu"),
                ("gate", "swish", r"gemv_gate_up: gate expected a gate spec such as .*, got 's"),
                ("gate", ["silu"], r"gemv_gate_up: gate expected a gate spec"),
                ("bias", z(2, 128, dtype=bf), r"gemv_gate_up: bias expected shape \[2, 256\], got"),
                ("bias", z(2, 256, dtype=i32), r"gemv_gate_up: bias expected dtype torch.bfloat16"),
                ("bias", z(2, 256, device=META), r"gemv_gate_up: bias expected device cpu"),
            ],
        ),
        Case(
            "gemv_gate_up int8 / bf16",
            GV.UP,
            (x[:, :200], ids, z(2, 256, 256, dtype=i8), ws8, "relu2:glu=0", None),
            [
                ("w1_scales", ws8[:, :128], r"gemv_gate_up: w1_scales expected shape \[2, 256\]"),
                ("w1_scales", None, r"gemv_gate_up: w1_scales expected a float32 tensor for fp8"),
                ("w1", z(2, 256, 256, dtype=bf), r"gemv_gate_up: w1_scales expected None for bf16"),
                ("x", z(4, 300, dtype=bf), r"gemv_gate_up: x expected at most 256 columns \(w1's"),
                (
                    "bias",
                    z(2, 512),
                    r"gemv_gate_up: bias expected shape \[2, 256\], got \[2, 512\]",
                ),
            ],
        ),
        Case(
            "gemv_down int8",
            GV.DOWN,
            (z(4, 2, 128, dtype=bf), ids, w, w8, ws8, z(2, 256), 200),
            [
                ("h", z(4, 2, 128), r"gemv_down: h expected dtype torch.bfloat16, got torch.float"),
                ("h", z(4, 128, dtype=bf), r"gemv_down: h expected a 3-D tensor, got shape"),
                ("topk_ids", ids[:, :1], r"gemv_down: topk_ids expected shape \[4, 2\], got"),
                ("topk_ids", ids.to(META), r"gemv_down: topk_ids expected device cpu"),
                ("topk_weights", w[:3], r"gemv_down: topk_weights expected shape \[4, 2\], got"),
                ("topk_weights", w.int(), r"gemv_down: topk_weights expected dtype torch.bfloat16"),
                ("topk_weights", w.to(META), r"gemv_down: topk_weights expected device cpu"),
                ("w2", w8[:, :, :64], r"gemv_down: w2 expected shape \[any, any, 128\], got"),
                ("w2", w8.to(META), r"gemv_down: w2 expected device cpu"),
                ("w2_scales", None, r"gemv_down: w2_scales expected a float32 tensor for fp8"),
                ("w2_scales", ws8[:1], r"gemv_down: w2_scales expected shape \[2, 256\], got"),
                ("w2_scales", ws8.to(META), r"gemv_down: w2_scales expected device cpu"),
                ("bias", z(2, 200), r"gemv_down: bias expected shape \[2, 256\], got \[2, 200\]"),
                ("bias", z(2, 256, dtype=f32).double(), r"gemv_down: bias expected dtype torch.bf"),
                ("bias", z(2, 256, device=META), r"gemv_down: bias expected device cpu"),
                ("hidden", 0, r"gemv_down: hidden expected None or an int in \[1, 256\]"),
                ("hidden", 257, r"gemv_down: hidden expected None or an int in \[1, 256\]"),
                ("hidden", 2.0, r"gemv_down: hidden expected None or an int in \[1, 256\]"),
            ],
        ),
        Case(
            "gemv_down fp8",
            GV.DOWN,
            (z(4, 2, 256, dtype=bf), ids, w, wf, wfs, None, None),
            [
                ("w2", z(2, 192, 256, dtype=FP8), r"gemv_down: H expected a multiple of 128 for"),
                ("w2_scales", wfs[:, :, :1], r"gemv_down: w2_scales expected shape \[2, 2, 2\]"),
                ("w2", z(2, 256, 256, dtype=bf), r"gemv_down: w2_scales expected None for bf16 "),
            ],
        ),
        Case(
            "ll_scatter",
            LS.CONTRACT,
            (x, ids, 2, 4, "fp8", 2, 4, "row", None),
            [
                ("x", x.float(), r"ll_scatter: x expected dtype torch.bfloat16, got torch.float32"),
                ("x", z(4, dtype=bf), r"ll_scatter: x expected a 2-D tensor"),
                ("x", x[:, :192], r"ll_scatter: x.shape\[1\] expected a multiple of 128 \(fp8"),
                ("topk_ids", ids[:3], r"ll_scatter: topk_ids expected shape \[4, any\]"),
                ("topk_ids", ids.to(META), r"ll_scatter: topk_ids expected device cpu"),
                ("num_experts", -1, r"ll_scatter: num_experts expected a positive int, got -1"),
                ("capacity", 0, r"ll_scatter: capacity expected a positive int, got 0"),
                ("quant", "nf4", r"ll_scatter: quant expected one of 'bf16', 'fp8', 'int8'"),
                ("scale_layout", "col", r"ll_scatter: scale_layout expected one of"),
                ("expert_lo", -1, r"ll_scatter: expert_lo expected a non-negative int, got -1"),
                (
                    "num_global_experts",
                    0,
                    r"ll_scatter: num_global_experts expected a positive int",
                ),
                (
                    "num_global_experts",
                    3,
                    r"num_global_experts expected at least expert_lo \+ num_",
                ),
                ("width", 255, r"ll_scatter: width expected None or an int >= H = 256 \(x's"),
                ("width", 256.0, r"ll_scatter: width expected None or an int >= H = 256"),
                ("width", 320, r"ll_scatter: width expected a multiple of 128 \(fp8 groups\)"),
            ],
        ),
        Case(
            "ll_scatter width",
            LS.CONTRACT,
            (x[:, :160], ids, 2, 4, "fp8", 0, None, "deepgemm", 384),
            [
                ("width", None, r"ll_scatter: x.shape\[1\] expected a multiple of 128 \(fp8"),
                ("width", 159, r"ll_scatter: width expected None or an int >= H = 160"),
            ],
        ),
        Case(
            "ll_scatter raw",
            LS.CONTRACT,
            (x.float(), ids, 2, 4, "bf16", 0, None, "row", 300),
            [
                ("x", x.double(), r"ll_scatter: x expected dtype torch.bfloat16 or torch.int8 or"),
            ],
        ),
        Case(
            "ll_gather",
            LG.CONTRACT_OUT,
            (yl, rows, w, z(4, 256, dtype=bf), None),
            [
                ("y", yl.float(), r"ll_gather: y expected dtype torch.bfloat16"),
                ("y", y2, r"ll_gather: y expected a 3-D tensor"),
                ("rows", rows.float(), r"ll_gather: rows expected dtype torch.int32 or"),
                ("rows", rows.to(META), r"ll_gather: rows expected device cpu"),
                ("topk_weights", w[:3], r"ll_gather: topk_weights expected shape \[4, 2\]"),
                ("out", z(3, 256, dtype=bf), r"ll_gather: out expected shape \[4, any\]"),
                ("out", z(4, 257, dtype=bf), r"ll_gather: out expected \[4, Ho\] with 1 <= Ho <="),
                ("out", z(4, 0, dtype=bf), r"ll_gather: out expected \[4, Ho\] with 1 <= Ho <="),
                ("out", z(256, 4, dtype=bf).t(), r"ll_gather: out expected a contiguous tensor"),
                ("out", z(4, 256, dtype=bf, device="meta"), r"ll_gather: out expected device cpu"),
                ("bias", z(2, 255), r"ll_gather: bias expected at least 256 columns \(the outp"),
                ("bias", z(3, 256), r"ll_gather: bias expected shape \[2, any\], got \[3, 256\]"),
                ("bias", z(2, 256, dtype=i8), r"ll_gather: bias expected dtype torch.bfloat16"),
                ("bias", z(2, 256, device="meta"), r"ll_gather: bias expected device cpu"),
            ],
        ),
        Case(
            "ll_gather hidden",
            LG.CONTRACT,
            (yl, rows, None, z(2, 200, dtype=bf), 200),
            [
                ("hidden", 0, r"ll_gather: hidden expected None or an int in \[1, 256\] \(y's"),
                ("hidden", 257, r"ll_gather: hidden expected None or an int in \[1, 256\]"),
                ("hidden", 200.0, r"ll_gather: hidden expected None or an int in \[1, 256\]"),
                ("hidden", None, r"ll_gather: bias expected at least 256 columns"),
                ("bias", z(2, 199), r"ll_gather: bias expected at least 200 columns"),
            ],
        ),
        Case(
            "dispatch",
            D.HT,
            (x, ids, w, afs[:4], 256),
            [
                ("x", x.half(), r"dispatch: x expected dtype torch.bfloat16 or"),
                ("x", x[:, :128], r"dispatch: x expected shape \[any, 256\], got \[4, 128\]"),
                ("topk_ids", ids.int(), r"dispatch: topk_ids expected dtype torch.int64"),
                ("topk_weights", w[:, :1], r"dispatch: topk_weights expected shape \[4, 2\]"),
                ("topk_weights", w.to(META), r"dispatch: topk_weights expected device cpu"),
                ("x_scales", afs[:3], r"dispatch: x_scales expected shape \[4, any\]"),
            ],
        ),
        Case(
            "ll_dispatch",
            D.LL,
            (x, ids, True, 256, 8),
            [
                ("topk_ids", ids[:3], r"ll_dispatch: topk_ids expected shape \[4, any\]"),
                ("max_tokens_per_rank", 0, r"ll_dispatch: max_tokens_per_rank expected a positive"),
                (
                    "max_tokens_per_rank",
                    2,
                    r"ll_dispatch: x expected at most max_tokens_per_rank=2",
                ),
                ("x", x[:, :64], r"ll_dispatch: x expected shape \[any, 256\]"),
            ],
        ),
        Case(
            "ll_dispatch fp8 groups",
            D.LL,
            (x[:, :64], ids, False, 64, 8),
            [
                ("use_fp8", True, r"ll_dispatch: hidden_size expected a multiple of 128 \(fp8"),
            ],
        ),
        Case(
            "combine",
            CB.HT,
            (x, [ids], 256),
            [
                ("handle", [], r"combine: handle expected the handle returned by ht_dispatch"),
                ("y", x.float(), r"combine: y expected dtype torch.bfloat16"),
            ],
        ),
        Case(
            "ll_combine",
            CB.LL_OUT,
            (yl, ids, w, 2, 8, 256, z(4, 256, dtype=bf)),
            [
                ("y", yl[:1], r"ll_combine: y expected shape \[2, 8, 256\], got \[1, 8, 256\]"),
                ("topk_ids", ids.int(), r"ll_combine: topk_ids expected dtype torch.int64"),
                ("topk_weights", w[:3], r"ll_combine: topk_weights expected shape \[4, 2\]"),
                ("out", z(4, 256), r"ll_combine: out expected dtype torch.bfloat16"),
                ("out", z(256, 4, dtype=bf).t(), r"ll_combine: out expected a contiguous tensor"),
            ],
        ),
        Case(
            "EPMoE",
            layer.FORWARD,
            (x, ids, w, 256, 2, cpu),
            [
                ("x", x.float(), r"EPMoE: x expected dtype torch.bfloat16, got torch.float32"),
                ("x", x[:, :128], r"EPMoE: x expected shape \[any, 256\]"),
                ("device", META, r"EPMoE: x expected device meta \(the layer's\), got cpu"),
                ("topk_ids", ids[:, :1], r"EPMoE: topk_ids expected shape \[4, 2\], got \[4, 1\]"),
                ("topk_ids", ids.to(META), r"EPMoE: topk_ids expected device cpu"),
                ("topk_weights", w.double(), r"EPMoE: topk_weights expected dtype torch.float32"),
            ],
        ),
    ]


CASES = _cases()
SINGLE = [(c, p, v, m) for c in CASES for p, v, m in c.bad]


def _sub(case: Case, changes) -> tuple:
    args = list(case.good)
    for p, v in changes:
        args[case.contract.params.index(p)] = v
    return tuple(args)


def _direct_on_cpu(contract):
    """The contract's direct check, built to take CPU tensors as the device it launches on. It
    compares devices as get_device() ints, which are -1 for CPU and meta alike: a meta tensor
    stands for another CUDA device only in ok() and check()."""
    return contract._build("direct", direct=True, cuda_attr="is_cpu")


def _on_meta(faults) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_meta for _, v, _ in faults)


def _passes_full(contract, args) -> bool:
    try:
        contract.full(*args)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_good_input_passes_every_check(case):
    c, args = case.contract, case.good
    assert c.ok(*args)
    assert _direct_on_cpu(c)(*args)
    assert not c.direct(*args)  # CPU tensors never launch directly
    c.check(*args)
    c.full(*args)


SINGLE_IDS = [f"{c.name}-{p}-{i}" for i, (c, p, _, _) in enumerate(SINGLE)]


@pytest.mark.parametrize("case, param, bad, match", SINGLE, ids=SINGLE_IDS)
def test_bad_input_is_rejected_with_its_message(case, param, bad, match):
    args = _sub(case, [(param, bad)])
    c = case.contract
    assert not c.ok(*args)
    assert _on_meta([(param, bad, match)]) or not _direct_on_cpu(c)(*args)
    with pytest.raises(ValueError, match=match):
        c.check(*args)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fast_checks_agree_with_the_full_check(case):
    """Every single fault and every pair of faults on different parameters: ok() is True exactly
    when the full check passes, and direct() (on CPU) never passes what the full check rejects."""
    direct = _direct_on_cpu(case.contract)
    grid = [[]] + [[b] for b in case.bad]
    grid += [[a, b] for a, b in itertools.combinations(case.bad, 2) if a[0] != b[0]]
    for faults in grid:
        args = _sub(case, [(p, v) for p, v, _ in faults])
        full = _passes_full(case.contract, args)
        assert case.contract.ok(*args) == full, [p for p, _, _ in faults]
        assert _on_meta(faults) or not direct(*args) or full, [p for p, _, _ in faults]
        if not full:
            with pytest.raises(ValueError):
                case.contract.check(*args)


def test_direct_takes_plain_tensors_without_grad_on_cuda_only():
    x, ids = z(4, 8, dtype=bf), z(4, 2, dtype=i64)
    args = (x, ids, 2, 4, None, "row")
    direct = _direct_on_cpu(P.CONTRACT)
    assert direct(*args)
    assert not direct(torch.nn.Parameter(x, requires_grad=False), *args[1:])
    assert not direct(x.clone().requires_grad_(), *args[1:])
    assert not direct(*args[:4], torch.nn.Parameter(z(4, 2)), "row")
    assert not P.CONTRACT.direct(*args)  # (built for CUDA)


def test_check_takes_fake_tensors():
    """The fakes call check: metadata only, on FakeTensors (no data pointer, no value read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y, inv, w = z(8, 16, dtype=bf), z(4, 2, dtype=i32), z(4, 2)
        assert U.CONTRACT.ok(y, inv, w, None, None, None)
        U.CONTRACT.check(y, inv, w, None, None, None)
        U.CONTRACT.check(y, inv, w, z(2, 16), z(8, dtype=i32), 8)
        with pytest.raises(ValueError, match=r"unpermute: topk_weights expected shape"):
            U.CONTRACT.check(y, inv, w[:, :1], None, None, None)


def test_declarations_build_small_functions():
    """The generated checks read each argument's attributes once (no loop, no comprehension)."""
    for case in CASES:
        for kind in ("ok", "direct", "check"):
            src = getattr(case.contract, kind).source
            assert " for " not in src and "lambda" not in src, src


def test_contract_machinery_in_isolation():
    c = C.Contract(
        "op",
        "t n mode",
        C.Tensor("t", (f32,), shape=("n", None)),
        C.Choice("mode", ("a", "b")),
        C.Let("m", "n * 2"),
        C.Case("mode == 'a'", [C.Multiple("t.shape[1]", "t.shape[1]", "m", "(pairs)")]),
    )
    assert c.ok(z(3, 12), 3, "a") and c.ok(z(3, 5), 3, "b")
    with pytest.raises(ValueError, match=r"op: t.shape\[1\] expected a multiple of 6 \(pairs\)"):
        c.check(z(3, 5), 3, "a")
    with pytest.raises(ValueError, match=r"op: t expected shape \[2, any\], got \[3, 5\]"):
        c.check(z(3, 5), 2, "b")
    with pytest.raises(ValueError, match=r"op: mode expected one of 'a', 'b', got 'c'"):
        c.check(z(3, 5), 3, "c")
