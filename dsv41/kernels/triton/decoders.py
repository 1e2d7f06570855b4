"""Decoders of the packed KV bytes in Triton registers: E4M3, UE8M0 and E2M1 codes to fp32 (arithmetic), and the
PTX decoders that the packed decode's staging kernel (packed_staged.py) and the indexer (indexer_kernel.py) share.

Each PTX decoder takes `ASM`: on the GPU a few PTX instructions per 32-bit word (SIMD within the register); off it
(the interpreter, `common.ASM` False) the arithmetic decoders give the same values. Every decode is exact: each
stored value is representable in the target format.

Byte layouts (`dsv41.codecs`): an SWA ring row holds E4M3 codes (channel d at byte d) and one UE8M0 scale per 32
channels; a main-KV record E2M1 nibbles (channel 2k in the low nibble of byte k, 2k+1 in the high one) and one
E4M3 scale per 16 channels; an index-key record nibbles as the main KV and one UE8M0 scale per 32 channels.
The split decoders return the even and odd channels of a tile separately ([BN, D/2] each): a main-KV byte holds
channels 2k and 2k+1, an SWA pair of bytes channels 2i and 2i+1, so each half comes out of the bytes with no
interleave.

Not handled: the NaN codes (E4M3 0x7F/0xFF decode as +-480, UE8M0 0xFF as 2^128 here, NaN in the reference; the
pool never writes them) and UE8M0 byte 0 (0 here, 2^-127 there; below every scale the quantizers produce).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["e4m3_to_f32", "ue8m0_to_f32", "e2m1_to_f32", "swa_split", "e2m1_split", "e2m1_f16", "word_f16",
           "P2_112", "P2_118"]


# ------------------------------------------------------------------------------------------ arithmetic

@triton.jit
def e4m3_to_f32(b):
    """E4M3 byte (int32 0..255) -> fp32: normals by moving the 7 magnitude bits under the fp32 exponent and
    rebiasing (7 -> 127), subnormals (exponent 0) as m * 2^-9; the sign from bit 7 (codecs.e4m3_to_float)."""
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    v = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, normal)
    return tl.where(b >= 128, -v, v)


@triton.jit
def ue8m0_to_f32(b):
    """UE8M0 byte (int32) -> 2^(b - 127) as the fp32 exponent field (codecs.e8m0_to_float)."""
    return (b << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_f32(c):
    """E2M1 nibble (int32 0..15, bit 3 sign) -> fp32 (codecs.e2m1_to_float): exponent e = bits 1-2, mantissa m =
    bit 0; e >= 1 is (1 + m/2) 2^(e-1) (fp32 exponent e + 126), e = 0 is m * 0.5 (0x3F000000 = 0.5)."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------------------------------ PTX
# The split decoders (SWA rows and main-KV records to bf16), step by step:
#   E2M1 nibble -> E4M3 byte: the 3 magnitude bits move under the E4M3 exponent/mantissa (value * 2^-6, exact, the
#     nibble's subnormal 0.5 becomes the E4M3 subnormal 2^-7), the sign to bit 7;
#   E4M3 pair -> f16x2 by the hardware conversion (exact: every E4M3 value is an fp16 normal);
#   f16 -> bf16 bits by moving exponent and mantissa down 3 bits, sign kept ((x >> 3) & 0x0FFF | x & 0x8000): the
#     bf16 whose exponent field is the fp16's, i.e. the value * 2^-112 (zero stays zero, no subnormals occur);
#   times the group scale, pre-multiplied by 2^112 (SWA, UE8M0: exact for scale bytes <= 142, i.e. scales
#   <= 2^15) or 2^118 (main KV, E4M3), in one bf16x2 fma with -0 (a single rounding of an exact product: exact).
# The fp16 decoders of the indexer (`e2m1_f16`, `word_f16`) stop after the E4M3 -> f16x2 conversion (the value
# * 2^-6), `word_f16` then multiplies by a power of two of the group (mul.f16x2: exact).

_F16_TO_BF16 = """
shr.b32 t, {r}, 3;
and.b32 t, t, 0x0FFF0FFF;
and.b32 {r}, {r}, 0x80008000;
or.b32 {r}, {r}, t;"""

# The E2M1 nibbles of a 32-bit word {x} as E4M3 bytes (the 3 magnitude bits under the E4M3 exponent / mantissa: the
# value * 2^-6, exact; the sign to bit 7): A = the low nibbles (channels 2k), B = the high ones (2k+1), byte k of
# each; then as f16x2 by the hardware conversion: {r0} {r1} = the low nibbles' bytes 0-1 and 2-3, {r2} {r3} the high
# ones'. Needs .reg .b16 a0, a1, b0, b1 and .reg .b32 t1, t2, A, B.
_E2M1_TO_F16X2 = """
shl.b32 t1, {x}, 2;
and.b32 t1, t1, 0x1C1C1C1C;
shl.b32 t2, {x}, 4;
and.b32 t2, t2, 0x80808080;
or.b32 A, t1, t2;
shr.b32 t1, {x}, 2;
and.b32 t1, t1, 0x1C1C1C1C;
and.b32 t2, {x}, 0x80808080;
or.b32 B, t1, t2;
mov.b32 {{a0, a1}}, A;
mov.b32 {{b0, b1}}, B;
cvt.rn.f16x2.e4m3x2 {r0}, a0;
cvt.rn.f16x2.e4m3x2 {r1}, a1;
cvt.rn.f16x2.e4m3x2 {r2}, b0;
cvt.rn.f16x2.e4m3x2 {r3}, b1;"""

# uint16 element i = channels (2i, 2i+1) as E4M3 bytes (low, high); pack 2: $2 = two elements, $3 = their two bf16
# scales; $0 = even channels (2i), $1 = odd channels (2i+1) as bf16x2.
_SWA_ASM = tl.constexpr("""{
.reg .b16 l, h;
.reg .b32 a, b, e, o, t, z;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 a, l;
cvt.rn.f16x2.e4m3x2 b, h;
prmt.b32 e, a, b, 0x5410;
prmt.b32 o, a, b, 0x7632;""" + _F16_TO_BF16.format(r="e") + _F16_TO_BF16.format(r="o") + """
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, e, $3, z;
fma.rn.bf16x2 $1, o, $3, z;
}""")

# uint8 element k = channels (2k low nibble, 2k+1 high nibble) in E2M1; pack 4: $4 = four bytes, $5 $6 = their four
# bf16 scales; $0 $1 = even channels, $2 $3 = odd channels, bf16x2 each.
_E2M1_ASM = tl.constexpr("""{
.reg .b16 a0, a1, b0, b1;
.reg .b32 t1, t2, A, B, e0, e1, o0, o1, t, z;
""" + _E2M1_TO_F16X2.format(x="$4", r0="e0", r1="e1", r2="o0", r3="o1") + "".join(
    _F16_TO_BF16.format(r=r) for r in ("e0", "e1", "o0", "o1")) + """
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, e0, $5, z;
fma.rn.bf16x2 $1, e1, $6, z;
fma.rn.bf16x2 $2, o0, $5, z;
fma.rn.bf16x2 $3, o1, $6, z;
}""")

P2_112 = tl.constexpr(5.192296858534828e33)      # 2^112
P2_118 = tl.constexpr(3.3230699894622943e35)     # 2^118
_P2_M112 = tl.constexpr(1.925929944387236e-34)    # 2^-112
_P2_M118 = tl.constexpr(3.0092655314788645e-36)   # 2^-118


@triton.jit
def swa_split(codes, sc, ASM: tl.constexpr):
    """uint16 codes (E4M3 channels 2i | 2i+1 << 8), bf16 sc = UE8M0 scale * 2^112 -> (even, odd) bf16 channels."""
    if ASM:
        ev, od = tl.inline_asm_elementwise(_SWA_ASM, "=r,=r,r,r", [codes, sc], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=2)
    else:
        c = codes.to(tl.int32)
        s = sc.to(tl.float32) * _P2_M112
        ev = (e4m3_to_f32(c & 255) * s).to(tl.bfloat16)
        od = (e4m3_to_f32(c >> 8) * s).to(tl.bfloat16)
    return ev, od


@triton.jit
def e2m1_split(byt, sc, ASM: tl.constexpr):
    """uint8 bytes (E2M1 channel 2k low nibble, 2k+1 high), bf16 sc = E4M3 scale * 2^118 -> (even, odd) bf16."""
    if ASM:
        ev, od = tl.inline_asm_elementwise(_E2M1_ASM, "=r,=r,=r,=r,r,r,r", [byt, sc],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        c = byt.to(tl.int32)
        s = sc.to(tl.float32) * _P2_M118
        ev = (e2m1_to_f32(c & 15) * s).to(tl.bfloat16)
        od = (e2m1_to_f32(c >> 4) * s).to(tl.bfloat16)
    return ev, od


# uint8 element k (E2M1 channel 2k low nibble, 2k+1 high); pack 4: $4 = four bytes; $0 $1 = the low nibbles as
# f16x2 (E2M1 * 2^-6), $2 $3 = the high ones.
_E2M1_F16_ASM = tl.constexpr("""{
.reg .b16 a0, a1, b0, b1;
.reg .b32 t1, t2, A, B;
""" + _E2M1_TO_F16X2.format(x="$4", r0="$0", r1="$1", r2="$2", r3="$3") + """
}""")


@triton.jit
def e2m1_f16(byt, ASM: tl.constexpr):
    """uint8 bytes -> (low-nibble, high-nibble) E2M1 values * 2^-6 in fp16 (exact)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_F16_ASM, "=r,=r,=r,=r,r", [byt], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=4)
    else:
        c = byt.to(tl.int32)
        lo = (e2m1_to_f32(c & 15) * 0.015625).to(tl.float16)
        hi = (e2m1_to_f32(c >> 4) * 0.015625).to(tl.float16)
    return lo, hi


# $8 = one word (4 bytes: channels 2k low nibble, 2k+1 high), $9 = the fp16x2 power of two of its group;
# $0..$7 = channels 0, 2, 4, 6, 1, 3, 5, 7 of the word as fp16.
_WORD_F16_ASM = tl.constexpr("""{
.reg .b16 a0, a1, b0, b1;
.reg .b32 t1, t2, A, B, r0, r1, r2, r3;
""" + _E2M1_TO_F16X2.format(x="$8", r0="r0", r1="r1", r2="r2", r3="r3") + """
mul.rn.f16x2 r0, r0, $9;
mul.rn.f16x2 r1, r1, $9;
mul.rn.f16x2 r2, r2, $9;
mul.rn.f16x2 r3, r3, $9;
mov.b32 {$0, $1}, r0;
mov.b32 {$2, $3}, r1;
mov.b32 {$4, $5}, r2;
mov.b32 {$6, $7}, r3;
}""")


@triton.jit
def word_f16(wd, mul, ASM: tl.constexpr):
    """int32 words -> 8 fp16 tensors (channels 0, 2, 4, 6, 1, 3, 5, 7 of each word) * 2^-6 * mul; mul int32 holding
    the fp16x2 bits of a power of two (exact)."""
    if ASM:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            _WORD_F16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [wd, mul], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        m = (mul & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 0.015625
        o0 = (e2m1_to_f32(wd & 15) * m).to(tl.float16)
        o4 = (e2m1_to_f32((wd >> 4) & 15) * m).to(tl.float16)
        o1 = (e2m1_to_f32((wd >> 8) & 15) * m).to(tl.float16)
        o5 = (e2m1_to_f32((wd >> 12) & 15) * m).to(tl.float16)
        o2 = (e2m1_to_f32((wd >> 16) & 15) * m).to(tl.float16)
        o6 = (e2m1_to_f32((wd >> 20) & 15) * m).to(tl.float16)
        o3 = (e2m1_to_f32((wd >> 24) & 15) * m).to(tl.float16)
        o7 = (e2m1_to_f32((wd >> 28) & 15) * m).to(tl.float16)
    return o0, o1, o2, o3, o4, o5, o6, o7

