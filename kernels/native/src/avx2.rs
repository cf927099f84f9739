//! The `Simd` instance for x86-64 CPUs with AVX2, FMA and F16C but no AVX-512 (Zen 2 / Zen 3,
//! Haswell to Alder Lake): sixteen fp32 lanes as two 256-bit registers.
//!
//! Chosen at run time (`lib.rs`) between `Avx512` and the baseline `Portable`, and compiled only
//! inside `#[target_feature(enable = "avx2,fma,f16c")]` functions. Without it such a CPU ran the
//! portable instance compiled for the x86-64 baseline (SSE2, a libm call per `exp` lane, no
//! FMA): 2x SDPA's time on a bf16 prefill of 512 tokens on a Zen 3 (docs/kernels.md).
//!
//! Invariants: the same results as `Portable` up to fp32 rounding (FMA rounds once; `hsum` adds
//! in a tree; `exp` is the AVX-512 instance's polynomial, ~2e-8 relative, with 2^n applied in
//! two factors so that results down to the subnormals stay exact), and bit-identical
//! conversions (`load_*`, `round_bf16`, `store_bf16`). No bf16-pair methods (`DPBF16` false):
//! bf16 caches are widened to fp32 as on the portable path. Costs: two instructions per lane op;
//! `select` builds its lane mask from the 16 bits (4 operations). `qk_direct` (decode scores
//! from K rows in place, no transpose) is this instance's own: ~1.2-1.3x on warm decode.

use crate::simd::{Simd, EXP_POLY, EXP_RANGE, LN2_HI, LN2_LO, W};
use std::arch::x86_64::*;

#[derive(Clone, Copy)]
pub struct Avx2(pub __m256, pub __m256);

/// Lane `i` of the two halves: bit `i` of a 16-bit mask (then compared to select).
const LO_BITS: [i32; 8] = [1, 2, 4, 8, 16, 32, 64, 128];
const HI_BITS: [i32; 8] = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768];

/// The bf16 nearest each lane (ties to even; NaN made quiet, as `simd::f32_to_bf16`), its bits
/// in the high 16 bits of each dword, the low 16 zero.
#[inline(always)]
unsafe fn bf16_bits_high(x: __m256) -> __m256i {
    let b = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    let quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x40_0000));
    let r = _mm256_blendv_epi8(r, quiet, nan);
    _mm256_and_si256(r, _mm256_set1_epi32(-65536))
}

/// The largest of eight lanes.
#[inline(always)]
unsafe fn max8(x: __m256) -> f32 {
    let v = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_max_ps(v, _mm_shuffle_ps::<0b01>(v, v)))
}

/// The sum of eight lanes (a tree: (0+4) + (2+6) + ...).
#[inline(always)]
unsafe fn sum8(x: __m256) -> f32 {
    let v = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ps(v, _mm_shuffle_ps::<0b01>(v, v)))
}

/// 2^e for integer lanes e in [-126, 127].
#[inline(always)]
unsafe fn pow2(e: __m256i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        e,
        _mm256_set1_epi32(127),
    )))
}

/// Lanes of `m` (a 16-bit mask in every dword) whose bit in `bits` is set, as a blend mask.
#[inline(always)]
unsafe fn lane_mask(m: __m256i, bits: &[i32; 8]) -> __m256 {
    let b = _mm256_loadu_si256(bits.as_ptr() as *const __m256i);
    _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(m, b), b))
}

/// Eight bf16 values widened.
#[inline(always)]
unsafe fn bf16_8(p: *const u16) -> __m256 {
    let x = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(x))
}

/// Eight int8 values widened.
#[inline(always)]
unsafe fn i8_8(p: *const i8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
}

/// In-place 8 x 8 transpose (unpacks, shuffles, 128-bit lane swaps).
#[inline(always)]
unsafe fn transpose8(r: &mut [__m256; 8]) {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xee>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xee>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xee>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xee>(t5, t7);
    r[0] = _mm256_permute2f128_ps::<0x20>(s0, s4);
    r[1] = _mm256_permute2f128_ps::<0x20>(s1, s5);
    r[2] = _mm256_permute2f128_ps::<0x20>(s2, s6);
    r[3] = _mm256_permute2f128_ps::<0x20>(s3, s7);
    r[4] = _mm256_permute2f128_ps::<0x31>(s0, s4);
    r[5] = _mm256_permute2f128_ps::<0x31>(s1, s5);
    r[6] = _mm256_permute2f128_ps::<0x31>(s2, s6);
    r[7] = _mm256_permute2f128_ps::<0x31>(s3, s7);
}

#[inline(always)]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_RANGE.0));
    let x = _mm256_min_ps(x, _mm256_set1_ps(EXP_RANGE.1));
    let t = _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E));
    let n = _mm256_round_ps::<0x08>(t); // nearest, no exceptions
    let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), f);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    // 2^n for n in [-150, 128] as two normal factors 2^a * 2^b (a = n >> 1, b = n - a)
    let ni = _mm256_cvtps_epi32(n);
    let a = _mm256_srai_epi32::<1>(ni);
    let b = _mm256_sub_epi32(ni, a);
    _mm256_mul_ps(_mm256_mul_ps(p, pow2(a)), pow2(b))
}

/// `exp8` for x <= 0 (a softmax's arguments): clamped below at -87.6, where n = round(x log2 e)
/// is still -126, so 2^n is one normal factor, and no upper clamp: 16 vector ops against 22. The
/// same bits as `exp8` from -87.6 up (there `exp8`'s product by 2^a, exact, then by 2^b rounds
/// once, as one product by 2^n does); e^-87.6 (~9e-39) for anything below.
#[inline(always)]
unsafe fn exp8_neg(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.6));
    let t = _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E));
    let n = _mm256_round_ps::<0x08>(t);
    let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), f);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    _mm256_mul_ps(p, pow2(_mm256_cvtps_epi32(n)))
}

/// Dimensions `16 c .. 16 c + 16` of a K row of format `F` as two fp32 vectors: for fp32, f16
/// and int8 codes the first and the last eight, for bf16 the even and the odd ones (one load, a
/// shift and a mask: the word pairs of a dword are the two halves' bf16 bits), for fp8 the even
/// and the odd ones read raw (2^`fp8_bias` too small).
#[inline(always)]
unsafe fn chunk16<const F: u8>(row: *const u8, c: usize) -> (__m256, __m256) {
    match F {
        0 => {
            let p = (row as *const f32).add(16 * c);
            (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
        1 => {
            let x = _mm256_loadu_si256((row as *const __m256i).add(c));
            (
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(x)),
                _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(-65536))),
            )
        }
        2 => {
            let p = (row as *const __m128i).add(2 * c);
            (
                _mm256_cvtph_ps(_mm_loadu_si128(p)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
            )
        }
        3 => {
            // int8 codes (the token's scale multiplies the score afterwards)
            let p = (row as *const i8).add(16 * c);
            (i8_8(p), i8_8(p.add(8)))
        }
        _ => {
            // fp8 codes read raw (`Simd::load_fp8_raw`), 16 at a time as sign-extended words:
            // a dword's low word (the even code) shifted to the top, its high word (the odd
            // one) shifted in place, one mask each (5 ops per 16 codes; 6 in order, 8 with the
            // exact read's multiply)
            let x = _mm256_cvtepi8_epi16(_mm_loadu_si128(row.add(16 * c) as *const __m128i));
            let m = _mm256_set1_epi32(fp8_mask::<F>());
            let (e, o) = if F == 5 {
                (_mm256_slli_epi32::<21>(x), _mm256_slli_epi32::<5>(x))
            } else {
                (_mm256_slli_epi32::<20>(x), _mm256_slli_epi32::<4>(x))
            };
            (
                _mm256_castsi256_ps(_mm256_and_si256(e, m)),
                _mm256_castsi256_ps(_mm256_and_si256(o, m)),
            )
        }
    }
}

/// The fp32 bits an fp8 code's sign, exponent and mantissa land on when shifted into place:
/// bit 31 and 26-20 (E4M3), bit 31 and 27-21 (E5M2).
#[inline(always)]
const fn fp8_mask<const F: u8>() -> i32 {
    if F == 5 {
        0x8fe0_0000_u32 as i32
    } else {
        0x87f0_0000_u32 as i32
    }
}

/// Eight fp8 codes read raw (`Simd::load_fp8_raw`): sign-extended to dwords, shifted, masked.
#[inline(always)]
unsafe fn fp8_raw_8<const F: u8>(p: *const u8) -> __m256 {
    let x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i));
    let bits = if F == 5 {
        _mm256_slli_epi32::<21>(x)
    } else {
        _mm256_slli_epi32::<20>(x)
    };
    _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(fp8_mask::<F>())))
}

impl Simd for Avx2 {
    const PV_PAIRED: bool = false;
    const QK_TWO_CHAINS: bool = false;
    const QK_DIRECT: bool = true;
    #[inline(always)]
    unsafe fn qk_direct<const F: u8, const NR: usize>(
        q: *const f32,
        d: usize,
        k: &[*const u8; W],
        nk: usize,
        p: *mut f32,
    ) {
        // h[x][jp]: hadd of the two keys' partial sums, [A01 A23 B01 B23 | A45 A67 B45 B67]
        let mut h = [[_mm256_setzero_ps(); W / 2]; NR];
        for jp in 0..nk.div_ceil(2) {
            let (k0, k1) = (k[2 * jp], k[2 * jp + 1]);
            let mut a0 = [_mm256_setzero_ps(); NR];
            let mut a1 = [_mm256_setzero_ps(); NR];
            for c in 0..d / 16 {
                let (e0, o0) = chunk16::<F>(k0, c);
                let (e1, o1) = chunk16::<F>(k1, c);
                for x in 0..NR {
                    let qe = _mm256_loadu_ps(q.add(x * d + 16 * c));
                    let qo = _mm256_loadu_ps(q.add(x * d + 16 * c + 8));
                    a0[x] = _mm256_fmadd_ps(qe, e0, a0[x]);
                    a1[x] = _mm256_fmadd_ps(qe, e1, a1[x]);
                    a0[x] = _mm256_fmadd_ps(qo, o0, a0[x]);
                    a1[x] = _mm256_fmadd_ps(qo, o1, a1[x]);
                }
            }
            for x in 0..NR {
                h[x][jp] = _mm256_hadd_ps(a0[x], a1[x]);
            }
        }
        for (x, hx) in h.iter().enumerate() {
            for g in 0..2 {
                // keys 8 g .. 8 g + 8: [k0..k3 lo halves | k0..k3 hi halves] per hadd, then
                // the 128-bit halves of two of them added
                let u = _mm256_hadd_ps(hx[4 * g], hx[4 * g + 1]);
                let v = _mm256_hadd_ps(hx[4 * g + 2], hx[4 * g + 3]);
                let s = _mm256_add_ps(
                    _mm256_permute2f128_ps::<0x20>(u, v),
                    _mm256_permute2f128_ps::<0x31>(u, v),
                );
                _mm256_storeu_ps(p.add(x * W + 8 * g), s);
            }
        }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Avx2(_mm256_set1_ps(x), _mm256_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Avx2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm256_storeu_ps(p, self.0);
        _mm256_storeu_ps(p.add(8), self.1);
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        Avx2(_mm256_add_ps(self.0, o.0), _mm256_add_ps(self.1, o.1))
    }
    #[inline(always)]
    unsafe fn mul(self, o: Self) -> Self {
        Avx2(_mm256_mul_ps(self.0, o.0), _mm256_mul_ps(self.1, o.1))
    }
    #[inline(always)]
    unsafe fn sub(self, o: Self) -> Self {
        Avx2(_mm256_sub_ps(self.0, o.0), _mm256_sub_ps(self.1, o.1))
    }
    #[inline(always)]
    unsafe fn div(self, o: Self) -> Self {
        Avx2(_mm256_div_ps(self.0, o.0), _mm256_div_ps(self.1, o.1))
    }
    #[inline(always)]
    unsafe fn round_bf16(self) -> Self {
        Avx2(
            _mm256_castsi256_ps(bf16_bits_high(self.0)),
            _mm256_castsi256_ps(bf16_bits_high(self.1)),
        )
    }
    #[inline(always)]
    unsafe fn store_bf16(self, p: *mut u16) {
        let lo = _mm256_srli_epi32::<16>(bf16_bits_high(self.0));
        let hi = _mm256_srli_epi32::<16>(bf16_bits_high(self.1));
        // packus interleaves 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> reorder
        let packed = _mm256_permute4x64_epi64::<0xd8>(_mm256_packus_epi32(lo, hi));
        _mm256_storeu_si256(p as *mut __m256i, packed);
    }
    #[inline(always)]
    unsafe fn fma(self, b: Self, c: Self) -> Self {
        Avx2(
            _mm256_fmadd_ps(self.0, b.0, c.0),
            _mm256_fmadd_ps(self.1, b.1, c.1),
        )
    }
    #[inline(always)]
    unsafe fn max(self, o: Self) -> Self {
        Avx2(_mm256_max_ps(self.0, o.0), _mm256_max_ps(self.1, o.1))
    }
    #[inline(always)]
    unsafe fn hmax(self) -> f32 {
        max8(_mm256_max_ps(self.0, self.1))
    }
    #[inline(always)]
    unsafe fn hsum(self) -> f32 {
        sum8(_mm256_add_ps(self.0, self.1))
    }
    #[inline(always)]
    unsafe fn exp(self) -> Self {
        Avx2(exp8(self.0), exp8(self.1))
    }
    #[inline(always)]
    unsafe fn exp_softmax(self) -> Self {
        Avx2(exp8_neg(self.0), exp8_neg(self.1))
    }
    #[inline(always)]
    unsafe fn select(self, mask: u16, other: Self) -> Self {
        let m = _mm256_set1_epi32(mask as i32);
        Avx2(
            _mm256_blendv_ps(other.0, self.0, lane_mask(m, &LO_BITS)),
            _mm256_blendv_ps(other.1, self.1, lane_mask(m, &HI_BITS)),
        )
    }
    /// Four 8 x 8 transposes: the result's rows 0-7 are (A^T, C^T), rows 8-15 (B^T, D^T), for
    /// the input's blocks A (rows 0-7, lanes 0-7), B (rows 0-7, lanes 8-15), C, D (rows 8-15).
    #[inline(always)]
    unsafe fn transpose(rows: &mut [Self; W]) {
        let mut a = [_mm256_setzero_ps(); 8];
        let mut b = [_mm256_setzero_ps(); 8];
        let mut c = [_mm256_setzero_ps(); 8];
        let mut d = [_mm256_setzero_ps(); 8];
        for i in 0..8 {
            a[i] = rows[i].0;
            b[i] = rows[i].1;
            c[i] = rows[8 + i].0;
            d[i] = rows[8 + i].1;
        }
        transpose8(&mut a);
        transpose8(&mut b);
        transpose8(&mut c);
        transpose8(&mut d);
        for i in 0..8 {
            rows[i] = Avx2(a[i], c[i]);
            rows[8 + i] = Avx2(b[i], d[i]);
        }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self {
        Avx2(bf16_8(p), bf16_8(p.add(8)))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self {
        Avx2(
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(8) as *const __m128i)),
        )
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> Self {
        Avx2(i8_8(p), i8_8(p.add(8)))
    }
    #[inline(always)]
    unsafe fn load_e4m3(p: *const u8) -> Self {
        // the raw read scaled by 2^120 (exact, subnormals included)
        let s = _mm256_set1_ps(f32::from_bits(0x7b80_0000));
        Avx2(
            _mm256_mul_ps(fp8_raw_8::<4>(p), s),
            _mm256_mul_ps(fp8_raw_8::<4>(p.add(8)), s),
        )
    }
    #[inline(always)]
    unsafe fn load_fp8_raw<const F: u8>(p: *const u8) -> Self {
        Avx2(fp8_raw_8::<F>(p), fp8_raw_8::<F>(p.add(8)))
    }
    #[inline(always)]
    unsafe fn load_e5m2(p: *const u8) -> Self {
        // an e5m2 byte is the high byte of the fp16 with the same value
        let x = _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i)));
        Avx2(
            _mm256_cvtph_ps(_mm256_castsi256_si128(x)),
            _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(x)),
        )
    }
}

/// Whether this CPU runs the AVX2 instance (avx2, fma, f16c).
pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{self, Portable};

    #[test]
    fn avx2_matches_portable() {
        if !has_avx2() {
            return;
        }
        unsafe { inner() }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn inner() {
        let data: Vec<f32> = (0..256).map(|i| (i as f32 * 0.37).sin() * 30.0).collect();
        let mut a: [Avx2; W] = [Avx2::splat(0.0); W];
        let mut p: [Portable; W] = [Portable::splat(0.0); W];
        for i in 0..W {
            a[i] = Avx2::load(data.as_ptr().add(i * W));
            p[i] = Portable::load(data.as_ptr().add(i * W));
        }
        Avx2::transpose(&mut a);
        Portable::transpose(&mut p);
        let mut out = [0f32; W];
        for i in 0..W {
            a[i].store(out.as_mut_ptr());
            assert_eq!(out, p[i].0, "transpose row {i}");
        }
        // exp over the softmax's range, down to the subnormals and the clamp
        let xs: Vec<f32> = (0..4096).map(|i| -110.0 + i as f32 * 0.0489).collect();
        for chunk in xs.chunks(W) {
            Avx2::load(chunk.as_ptr()).exp().store(out.as_mut_ptr());
            for (j, &x) in chunk.iter().enumerate() {
                let want = x.exp();
                let tol = if want < f32::MIN_POSITIVE {
                    2e-45
                } else {
                    4e-7 * want
                };
                assert!(
                    (out[j] - want).abs() <= tol,
                    "exp({x}) = {} not {want}",
                    out[j]
                );
            }
        }
        // exp_softmax: exp's bits from -87.6 up (0 down to -87.7 in steps), at most e^-87.6
        // below
        let mut got = [0f32; W];
        let mut x = 0f32;
        while x > -87.7 {
            let chunk: [f32; W] = std::array::from_fn(|j| x - j as f32 * 0.0061);
            Avx2::load(chunk.as_ptr()).exp().store(out.as_mut_ptr());
            Avx2::load(chunk.as_ptr())
                .exp_softmax()
                .store(got.as_mut_ptr());
            for j in 0..W {
                if chunk[j] >= -87.6 {
                    assert_eq!(
                        got[j].to_bits(),
                        out[j].to_bits(),
                        "exp_softmax({})",
                        chunk[j]
                    );
                }
            }
            x -= 0.0977;
        }
        for x in [-87.61f32, -100.0, -1e30, f32::NEG_INFINITY] {
            Avx2::splat(x).exp_softmax().store(got.as_mut_ptr());
            assert!(
                got.iter().all(|&g| (0.0..1e-38).contains(&g)),
                "exp_softmax({x})"
            );
        }
        // select, hmax, hsum
        let v = Avx2::load(data.as_ptr());
        for mask in [0u16, 1, 0x8000, 0x00ff, 0xff00, 0xa5c3, 0xffff] {
            v.select(mask, Avx2::splat(-1.0)).store(out.as_mut_ptr());
            for j in 0..W {
                let want = if mask >> j & 1 != 0 { data[j] } else { -1.0 };
                assert_eq!(out[j], want, "select {mask:#x} lane {j}");
            }
        }
        assert_eq!(v.hmax(), data[..W].iter().copied().fold(f32::MIN, f32::max));
        let sum: f32 = data[..W].iter().sum();
        assert!((v.hsum() - sum).abs() < 1e-4 * sum.abs().max(1.0));
        // conversions: every code of each 8-bit format, bf16 / f16 halves, bf16 rounding
        let bytes: Vec<u8> = (0..=255u8).collect();
        for chunk in bytes.chunks(W) {
            Avx2::load_e4m3(chunk.as_ptr()).store(out.as_mut_ptr());
            for (j, &b) in chunk.iter().enumerate() {
                if b & 0x7f != 0x7f {
                    assert_eq!(out[j], simd::e4m3_to_f32(b), "e4m3 {b:#x}");
                }
            }
            Avx2::load_e5m2(chunk.as_ptr()).store(out.as_mut_ptr());
            for (j, &b) in chunk.iter().enumerate() {
                let want = simd::e5m2_to_f32(b);
                assert!(
                    out[j] == want || (want.is_nan() && out[j].is_nan()),
                    "e5m2 {b:#x}"
                );
            }
            for f in [4u8, 5] {
                let raw = if f == 4 {
                    Avx2::load_fp8_raw::<4>(chunk.as_ptr())
                } else {
                    Avx2::load_fp8_raw::<5>(chunk.as_ptr())
                };
                raw.store(out.as_mut_ptr());
                for (j, &b) in chunk.iter().enumerate() {
                    let want = if f == 4 {
                        simd::e4m3_to_f32(b)
                    } else {
                        simd::e5m2_to_f32(b)
                    };
                    if want.is_finite() {
                        let got = out[j] as f64 * (2f64).powi(simd::fp8_bias(f));
                        assert_eq!(got, want as f64, "raw fp8 format {f} code {b:#x}");
                    }
                }
            }
            Avx2::load_i8(chunk.as_ptr() as *const i8).store(out.as_mut_ptr());
            for (j, &b) in chunk.iter().enumerate() {
                assert_eq!(out[j], b as i8 as f32);
            }
        }
        let halves: Vec<u16> = (0..4096u32).map(|i| (i * 16) as u16).collect();
        for chunk in halves.chunks(W) {
            Avx2::load_f16(chunk.as_ptr()).store(out.as_mut_ptr());
            for j in 0..W {
                let want = simd::f16_to_f32(chunk[j]);
                assert!(out[j] == want || (want.is_nan() && out[j].is_nan()));
            }
            let b = Avx2::load_bf16(chunk.as_ptr());
            b.store(out.as_mut_ptr());
            for j in 0..W {
                let want = simd::bf16_to_f32(chunk[j]);
                assert!(out[j] == want || (want.is_nan() && out[j].is_nan()));
            }
        }
        let mut bits = [0u16; W];
        for chunk in data.chunks(W) {
            let x = Avx2::load(chunk.as_ptr());
            x.store_bf16(bits.as_mut_ptr());
            x.round_bf16().store(out.as_mut_ptr());
            for j in 0..W {
                assert_eq!(bits[j], simd::f32_to_bf16(chunk[j]), "store_bf16 lane {j}");
                assert_eq!(out[j], simd::bf16_to_f32(bits[j]), "round_bf16 lane {j}");
            }
        }
        Avx2::splat(f32::NAN).store_bf16(bits.as_mut_ptr());
        assert_eq!(bits[0], simd::f32_to_bf16(f32::NAN));
        qk_direct_cases();
    }

    /// `qk_direct` against scalar dot products: every format it takes (fp32, bf16, f16, int8
    /// codes, fp8), 1-4 rows, 1-16 keys,
    /// head dims 16-128, missing keys as zero rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn qk_direct_cases() {
        for d in [16usize, 64, 128] {
            let nkeys = W;
            let kf: Vec<f32> = (0..nkeys * d)
                .map(|i| ((i * 7 % 61) as f32 - 30.0) / 8.0)
                .collect();
            let kb: Vec<u16> = kf.iter().map(|&x| simd::f32_to_bf16(x)).collect();
            let kh: Vec<u16> = kf.iter().map(|&x| simd::f32_to_f16(x)).collect();
            let k8: Vec<i8> = (0..nkeys * d).map(|i| (i * 7 % 251) as i8).collect();
            // fp8 codes: every byte but NaN's (e4m3 0x7f / 0xff; e5m2's 0x7c.. are inf / NaN)
            let c8: Vec<u8> = (0..nkeys * d)
                .map(|i| (i * 11 % 120) as u8 | (i as u8 & 0x80))
                .collect();
            let q: Vec<f32> = (0..4 * d)
                .map(|i| ((i * 13 % 37) as f32 - 18.0) / 16.0)
                .collect();
            let zero = vec![0u8; 4 * d];
            for fmt in 0u8..6 {
                for nk in 1..=W {
                    let mut k = [zero.as_ptr(); W];
                    for (j, kp) in k.iter_mut().enumerate().take(nk) {
                        *kp = match fmt {
                            0 => kf.as_ptr().add(j * d) as *const u8,
                            1 => kb.as_ptr().add(j * d) as *const u8,
                            2 => kh.as_ptr().add(j * d) as *const u8,
                            3 => k8.as_ptr().add(j * d) as *const u8,
                            _ => c8.as_ptr().add(j * d),
                        };
                    }
                    // fp8 K is read raw (2^bias too small): the query scaled up as `run_item` does
                    let (pre, post) = match fmt {
                        4 | 5 => {
                            let b = simd::fp8_bias(fmt);
                            ((2f32).powi(simd::FP8_PRE), (2f32).powi(b - simd::FP8_PRE))
                        }
                        _ => (1.0, 1.0),
                    };
                    let mut qx: Vec<f32> = q.iter().map(|&x| x * pre).collect();
                    if fmt == 1 || fmt >= 4 {
                        for row in qx.chunks_exact_mut(d) {
                            crate::attend::evenodd_row(row);
                        }
                    }
                    let mut p = [0f32; 4 * W];
                    macro_rules! call {
                        ($f:literal, $nr:literal) => {
                            Avx2::qk_direct::<$f, $nr>(qx.as_ptr(), d, &k, nk, p.as_mut_ptr())
                        };
                    }
                    macro_rules! run {
                        ($nr:literal) => {
                            match fmt {
                                0 => call!(0, $nr),
                                1 => call!(1, $nr),
                                2 => call!(2, $nr),
                                3 => call!(3, $nr),
                                4 => call!(4, $nr),
                                _ => call!(5, $nr),
                            }
                        };
                    }
                    for nr in 1..=4usize {
                        match nr {
                            1 => run!(1),
                            2 => run!(2),
                            3 => run!(3),
                            _ => run!(4),
                        }
                        for x in 0..nr {
                            for j in 0..nk {
                                let kv = |e: usize| match fmt {
                                    0 => kf[j * d + e],
                                    1 => simd::bf16_to_f32(kb[j * d + e]),
                                    2 => simd::f16_to_f32(kh[j * d + e]),
                                    3 => k8[j * d + e] as f32,
                                    4 => simd::e4m3_to_f32(c8[j * d + e]),
                                    _ => simd::e5m2_to_f32(c8[j * d + e]),
                                };
                                let want: f32 = (0..d).map(|e| q[x * d + e] * kv(e)).sum();
                                let got = p[x * W + j] * post;
                                assert!(
                                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                                    "fmt {fmt} d {d} nr {nr} nk {nk} row {x} key {j}: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
