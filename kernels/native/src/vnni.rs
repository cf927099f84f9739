//! Quantized decode on AVX-512 VNNI / VBMI. int8: scores and P.V as integer dot products of the
//! int8 codes, no conversion of K or V to bf16 or fp32 (`attend::run_item` takes it for items
//! of at most `MAX_ROWS` rows per KV head over an int8 cache, with bf16 queries; decode items
//! run these products in `dec_lean.rs`'s two passes, others in the tile loop). fp8 (`fp8_*`,
//! at most 4 rows): each code, put in the high byte of a word by a byte shuffle, becomes a bf16
//! by a shift and a mask (`fp8_words`: the value times a power of two, undone outside the dot
//! products; subnormal codes read as zero), then the bf16 pair dot products: K transposed as
//! codes (1 KB per 64 dimensions, not 2 KB), V paired as codes by `vpermt2b`.
//!
//!   query    q ~ s (hi + lo / 256), hi and lo int8, s = max|q| / 127 per row (error <= s / 512
//!            per element: finer than the bf16 rounding of q on the bf16 path)
//!   scores   sum_d q[d] k[d] = s (sum (k + 128) hi - 128 sum hi) + s / 256 (...lo...): `vpdpbusd`
//!            takes the codes as unsigned (k xor 0x80) against each part; the K tile is one
//!            16 x 16 dword transpose per 64 dimensions (4 codes a dword), shared by the rows
//!   P.V      w = p * v_scale (>= 0) ~ t u, u uint8, t = max w / 255 per row and tile (two
//!            parts, as for q, cost as much as they saved); 4 keys' V codes byte-interleaved
//!            per dword (8 unpacks per 4 keys x 64 dimensions), one `vpdpbusd` per 4 keys x 16
//!            dimensions
//!
//! The int32 sums are exact and folded into the fp32 accumulator once per tile. The
//! accumulator's dimensions are *permuted* within each 64 (`unpermute` restores them once per
//! item): lane 4 L + i of vector m holds dimension 16 L + 4 m + i.
//! Costs per 16 keys x 64 dimensions, R rows: 16 xors + 64 shuffles + 32 R `vpdpbusd` (K);
//! 32 shuffles + 16 R `vpdpbusd` (V), against the bf16 conversions and fp32 FMAs of the
//! widening path (which was 0.8-0.9x the speed of a bf16 cache at 4K+ keys).
//! The fp8 accumulator is in dimension order. Costs per 16 keys x 64 dimensions, R rows: 64
//! shuffles (transpose) + 32 `vpshufb` + 64 shift / and + 32 R `vdpbf16ps` (K); per 2 keys 4
//! `vpermt2b` + 8 shift / and + 4 R `vdpbf16ps` (V); no stores.
//! K and V rows come as a `Rows`: an array of 16 addresses, or a first row and a stride when a
//! tile's keys fill one block (`Strided`: no address array stored and reloaded per tile; its
//! stride a constant where the caller compiled one in).

#![cfg(target_arch = "x86_64")]

use crate::simd::{Avx512, Simd, W};
use std::arch::x86_64::*;

/// Rows per KV head up to which an item takes this path.
pub const MAX_ROWS: usize = 8;

/// Rows one call handles (accumulators in registers).
pub const NR_MAX: usize = 4;

/// The 16 K or V rows of a tile: an array of row addresses, or (every key real and in one
/// block, most tiles) a first row and a stride, so the addresses are formed in registers at
/// their use instead of in a stack array per tile and head (the e4m3 decode spent ~14 % of its
/// time on those stores and reloads).
pub trait Rows {
    unsafe fn row(&self, j: usize) -> *const u8;
}

impl Rows for [*const u8; W] {
    #[inline(always)]
    unsafe fn row(&self, j: usize) -> *const u8 {
        self[j]
    }
}

/// Rows `base + j * stride`, the stride `S` bytes when `S` is not 0 (known when compiled: the
/// row addresses are immediate offsets of `base`) or `stride` (read at run time).
#[derive(Clone, Copy)]
pub struct Strided<const S: usize> {
    pub base: *const u8,
    pub stride: usize,
}

impl<const S: usize> Rows for Strided<S> {
    #[inline(always)]
    unsafe fn row(&self, j: usize) -> *const u8 {
        self.base.add(j * if S != 0 { S } else { self.stride })
    }
}

/// Quantize query row `q` (`d` floats, already scaled) into `hi` and `lo` (`d` int8 each);
/// returns (s, 128 sum hi, 128 sum lo) as three floats, `qk`'s `meta` row.
pub fn quantize_q(q: &[f32], hi: &mut [i8], lo: &mut [i8]) -> [f32; 3] {
    let (s, ch, cl) = quantize_parts(q, hi, lo);
    [s, ch as f32, cl as f32] // |sums| <= 128 * 127 * 256 at d = 256: exact in f32
}

fn quantize_parts(q: &[f32], hi: &mut [i8], lo: &mut [i8]) -> (f32, i32, i32) {
    let mx = q.iter().fold(0f32, |m, x| m.max(x.abs()));
    if mx == 0.0 || !mx.is_finite() {
        hi.fill(0);
        lo.fill(0);
        return (if mx == 0.0 { 0.0 } else { f32::NAN }, 0, 0);
    }
    let inv = 127.0 / mx;
    let (mut sh, mut sl) = (0i32, 0i32);
    for ((x, h), l) in q.iter().zip(hi.iter_mut()).zip(lo.iter_mut()) {
        let t = x * inv;
        let a = t.round().clamp(-127.0, 127.0);
        let b = ((t - a) * 256.0).round().clamp(-127.0, 127.0);
        *h = a as i8;
        *l = b as i8;
        sh += a as i32;
        sl += b as i32;
    }
    (mx / 127.0, 128 * sh, 128 * sl)
}

/// `quantize_q` on AVX-512, 16 dimensions a step, the same codes and meta: `f32::round`'s
/// half-away-from-zero rounding (truncate, then one step away from zero where the dropped part
/// is at least 0.5), the same clamps and sums. A row of length not a multiple of 16, all
/// zeros, or holding a NaN or an infinity goes to `quantize_q`. The scalar loop (with a `roundf`
/// call per element) was a third of an int8 decode item's time at 48 x 288 keys.
///
/// # Safety
/// AVX-512 F on this CPU.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub unsafe fn quantize_q_avx512(q: &[f32], hi: &mut [i8], lo: &mut [i8]) -> [f32; 3] {
    let d = q.len();
    if d % W != 0 || hi.len() < d || lo.len() < d {
        return quantize_q(q, hi, lo);
    }
    let (mut m, mut bad) = (_mm512_setzero_ps(), 0u16);
    for c in (0..d).step_by(W) {
        let ax = _mm512_abs_ps(_mm512_loadu_ps(q.as_ptr().add(c)));
        // NaN or an infinity: not below infinity
        bad |= _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(ax, _mm512_set1_ps(f32::INFINITY));
        m = _mm512_max_ps(m, ax);
    }
    let mx = _mm512_reduce_max_ps(m);
    if bad != 0 || mx == 0.0 {
        return quantize_q(q, hi, lo);
    }
    let inv = _mm512_set1_ps(127.0 / mx);
    let (lim, nlim, half, k256) = (
        _mm512_set1_ps(127.0),
        _mm512_set1_ps(-127.0),
        _mm512_set1_ps(0.5),
        _mm512_set1_ps(256.0),
    );
    let round = |t: __m512| {
        let a = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
        let away = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_abs_ps(_mm512_sub_ps(t, a)), half);
        // copysign(1, t)
        let one = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(_mm512_set1_ps(1.0)),
            _mm512_and_si512(_mm512_castps_si512(t), _mm512_set1_epi32(i32::MIN)),
        ));
        _mm512_min_ps(
            _mm512_max_ps(_mm512_mask_add_ps(a, away, a, one), nlim),
            lim,
        )
    };
    let (mut sh, mut sl) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for c in (0..d).step_by(W) {
        let t = _mm512_mul_ps(_mm512_loadu_ps(q.as_ptr().add(c)), inv);
        let a = round(t);
        let b = round(_mm512_mul_ps(_mm512_sub_ps(t, a), k256));
        let (ai, bi) = (_mm512_cvtps_epi32(a), _mm512_cvtps_epi32(b)); // integers: exact
        _mm_storeu_si128(
            hi.as_mut_ptr().add(c) as *mut __m128i,
            _mm512_cvtepi32_epi8(ai),
        );
        _mm_storeu_si128(
            lo.as_mut_ptr().add(c) as *mut __m128i,
            _mm512_cvtepi32_epi8(bi),
        );
        sh = _mm512_add_epi32(sh, ai);
        sl = _mm512_add_epi32(sl, bi);
    }
    let (ch, cl) = (_mm512_reduce_add_epi32(sh), _mm512_reduce_add_epi32(sl));
    [mx / 127.0, (128 * ch) as f32, (128 * cl) as f32]
}

#[inline(always)]
unsafe fn bcast(p: *const i8, dw: usize) -> __m512i {
    _mm512_set1_epi32((p as *const i32).add(dw).read_unaligned())
}

/// Scores of `nr` (1..=`NR_MAX`) rows against the 16 keys `k` (int8 rows, a zero row for keys
/// that are not real): `p[x * W + j]` = s_x sum_d q_x[d] k_j[d] (before the key's scale).
/// `qh` / `ql`: the rows' parts, `d` apart; `meta`: `quantize_q`'s three floats per row.
#[inline(always)]
pub unsafe fn qk<R: Rows>(
    k: &R,
    d: usize,
    nr: usize,
    qh: *const i8,
    ql: *const i8,
    meta: *const f32,
    p: *mut f32,
) {
    match nr {
        1 => qk_n::<1, R>(k, d, qh, ql, meta, p),
        2 => qk_n::<2, R>(k, d, qh, ql, meta, p),
        3 => qk_n::<3, R>(k, d, qh, ql, meta, p),
        _ => qk_n::<4, R>(k, d, qh, ql, meta, p),
    }
}

#[inline(always)]
unsafe fn qk_n<const NR: usize, R: Rows>(
    k: &R,
    d: usize,
    qh: *const i8,
    ql: *const i8,
    meta: *const f32,
    p: *mut f32,
) {
    let mut ah = [_mm512_setzero_si512(); NR];
    let mut al = [_mm512_setzero_si512(); NR];
    for x in 0..NR {
        ah[x] = _mm512_set1_epi32(-(*meta.add(3 * x + 1) as i32));
        al[x] = _mm512_set1_epi32(-(*meta.add(3 * x + 2) as i32));
    }
    let flip = _mm512_set1_epi8(-128);
    let mut c = 0;
    while c < d {
        // kt[dq] lane j: dimensions c + 4 dq .. + 3 of key j, as unsigned codes
        let mut t = [Avx512::<true, true>(_mm512_setzero_ps()); W];
        for (j, tj) in t.iter_mut().enumerate() {
            let row = _mm512_loadu_si512(k.row(j).add(c) as *const _);
            *tj = Avx512(_mm512_castsi512_ps(_mm512_xor_si512(row, flip)));
        }
        <Avx512<true, true> as Simd>::transpose(&mut t);
        for (dq, tq) in t.iter().enumerate() {
            let kt = _mm512_castps_si512(tq.0);
            for x in 0..NR {
                let at = x * d + c;
                ah[x] = _mm512_dpbusd_epi32(ah[x], kt, bcast(qh.add(at), dq));
                al[x] = _mm512_dpbusd_epi32(al[x], kt, bcast(ql.add(at), dq));
            }
        }
        c += 64;
    }
    for x in 0..NR {
        let s = *meta.add(3 * x);
        let v = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(al[x]),
            _mm512_set1_ps(s / 256.0),
            _mm512_mul_ps(_mm512_cvtepi32_ps(ah[x]), _mm512_set1_ps(s)),
        );
        _mm512_storeu_ps(p.add(x * W), v);
    }
}

/// `acc[x][:] += sum_j p[x][j] * V_j` for `nr` (1..=`NR_MAX`) rows (acc rows `d` apart, in the
/// permuted layout; p rows `W` apart, already times each key's V scale, >= 0); `ng` groups of
/// 4 keys of `v` (int8 rows; a zero row for keys that are not real).
#[inline(always)]
pub unsafe fn pv<R: Rows>(acc: *mut f32, p: *const f32, d: usize, nr: usize, v: &R, ng: usize) {
    match nr {
        1 => pv_n::<1, R>(acc, p, d, v, ng),
        2 => pv_n::<2, R>(acc, p, d, v, ng),
        3 => pv_n::<3, R>(acc, p, d, v, ng),
        _ => pv_n::<4, R>(acc, p, d, v, ng),
    }
}

#[inline(always)]
unsafe fn pv_n<const NR: usize, R: Rows>(acc: *mut f32, p: *const f32, d: usize, v: &R, ng: usize) {
    // weights as uint8 per row: w ~ t u, u = round(w / t), t = max w / 255
    let mut wq = [[0u8; W]; NR];
    let mut t = [0f32; NR];
    for x in 0..NR {
        let w = _mm512_loadu_ps(p.add(x * W));
        let mx = _mm512_reduce_max_ps(w);
        if mx.is_nan() || mx <= 1e-30 {
            continue; // no weight (or too small to scale): u stays zero, t = 0
        }
        t[x] = mx / 255.0;
        let u = _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(w, _mm512_set1_ps(255.0 / mx)));
        let u = _mm512_cvttps_epi32(_mm512_min_ps(u, _mm512_set1_ps(255.0)));
        _mm_storeu_si128(wq[x].as_mut_ptr() as *mut _, _mm512_cvtepi32_epi8(u));
    }
    let mut c = 0;
    while c < d {
        let mut a = [[_mm512_setzero_si512(); 4]; NR];
        for g in 0..ng {
            let mut r = [_mm512_setzero_si512(); 4];
            for (j, rj) in r.iter_mut().enumerate() {
                *rj = _mm512_loadu_si512(v.row(4 * g + j).add(c) as *const _);
            }
            // 4 keys' codes per dword: vector m, lane 4 L + i = dimension 16 L + 4 m + i
            let (lo01, hi01) = (
                _mm512_unpacklo_epi8(r[0], r[1]),
                _mm512_unpackhi_epi8(r[0], r[1]),
            );
            let (lo23, hi23) = (
                _mm512_unpacklo_epi8(r[2], r[3]),
                _mm512_unpackhi_epi8(r[2], r[3]),
            );
            let xs = [
                _mm512_unpacklo_epi16(lo01, lo23),
                _mm512_unpackhi_epi16(lo01, lo23),
                _mm512_unpacklo_epi16(hi01, hi23),
                _mm512_unpackhi_epi16(hi01, hi23),
            ];
            for x in 0..NR {
                let bw = bcast(wq[x].as_ptr() as *const i8, g);
                for m in 0..4 {
                    a[x][m] = _mm512_dpbusd_epi32(a[x][m], bw, xs[m]);
                }
            }
        }
        for x in 0..NR {
            if t[x] == 0.0 {
                continue;
            }
            let tv = _mm512_set1_ps(t[x]);
            for m in 0..4 {
                let pa = acc.add(x * d + c + m * W);
                _mm512_storeu_ps(
                    pa,
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[x][m]), tv, _mm512_loadu_ps(pa)),
                );
            }
        }
        c += 64;
    }
}

/// fp8 codes as *biased* bf16 (E4M3: F = 4, E5M2: F = 5). Placed in the high byte of a word
/// (`c << 8`), a code becomes bf16 by one arithmetic shift and one mask: the sign stays in bit
/// 15 and the 7 magnitude bits land on bf16's exponent and mantissa, so the bf16 holds the
/// fp8 value times 2^-`fp8_bias` (2^-120 / 2^-112). The bias is undone outside the dot
/// products: the query and P are scaled by 2^`FP8_PRE` (exact) and the sums by
/// 2^(`fp8_bias` - `FP8_PRE`), so no product of normal values leaves fp32's normal range.
/// Subnormal codes (below 2^-6 / 2^-14, at most 3.5e-5 of a head's largest E4M3 value) become
/// bf16 subnormals, which `vdpbf16ps` reads as zero.
#[inline(always)]
unsafe fn fp8_words<const F: u8>(w: __m512i) -> __m512i {
    if F == 5 {
        _mm512_and_si512(
            _mm512_srai_epi16::<3>(w),
            _mm512_set1_epi16(0x8FE0u16 as i16),
        )
    } else {
        _mm512_and_si512(
            _mm512_srai_epi16::<4>(w),
            _mm512_set1_epi16(0x87F0u16 as i16),
        )
    }
}

/// In-lane byte order that turns a transposed dword vector (dword j: key j's codes c0..c3)
/// into dwords [0, c0, 0, c1] (`half` 0) or [0, c2, 0, c3] (`half` 1): codes in high bytes.
#[inline(always)]
unsafe fn fp8_spread(half: usize) -> __m512i {
    let mut idx = [0i8; 64];
    for (p, x) in idx.iter_mut().enumerate() {
        let (dw, b) = ((p % 16) / 4, p % 4);
        *x = if b % 2 == 0 {
            -128 // zero
        } else {
            (4 * dw + 2 * half + b / 2) as i8
        };
    }
    _mm512_loadu_si512(idx.as_ptr() as *const _)
}

/// `p[x][j] = scale * q[x] . K[j]` for `nr` (1..=4) query rows (`q`: `d / 2` dword pairs per
/// row, natural order, bf16 scaled by 2^`FP8_PRE`; `scale` includes 2^(bias - `FP8_PRE`)) and
/// a tile of 16 fp8 K rows `k` (a zero row for keys that are not real). Per 64 dimensions the
/// raw codes are transposed as dwords (vector i, dword j: key j's codes 4 i..4 i + 3), then
/// each vector gives the pair rows 2 i and 2 i + 1 in key order (`fp8_spread`, `fp8_words`),
/// each met by one `vdpbf16ps` per row. The transpose moves the 1 KB of codes, not the 2 KB
/// of a converted tile, and nothing is stored.
#[inline(always)]
pub unsafe fn fp8_qk<const F: u8, R: Rows>(
    k: &R,
    d: usize,
    nr: usize,
    q: *const u32,
    scale: f32,
    p: *mut f32,
) {
    match nr {
        1 => fp8_qk_n::<F, 1, R>(k, d, q, scale, p),
        2 => fp8_qk_n::<F, 2, R>(k, d, q, scale, p),
        3 => fp8_qk_n::<F, 3, R>(k, d, q, scale, p),
        _ => fp8_qk_n::<F, 4, R>(k, d, q, scale, p),
    }
}

#[inline(always)]
unsafe fn fp8_qk_n<const F: u8, const NR: usize, R: Rows>(
    k: &R,
    d: usize,
    q: *const u32,
    scale: f32,
    p: *mut f32,
) {
    let dp = d / 2;
    let (sp0, sp1) = (fp8_spread(0), fp8_spread(1));
    let mut s0 = [_mm512_setzero_ps(); NR];
    let mut s1 = [_mm512_setzero_ps(); NR];
    for c4 in 0..d / 64 {
        let mut t = [Avx512::<true, true>(_mm512_setzero_ps()); W];
        for (j, tj) in t.iter_mut().enumerate() {
            *tj = Avx512(_mm512_loadu_ps(k.row(j).add(64 * c4) as *const f32));
        }
        <Avx512<true, true> as Simd>::transpose(&mut t);
        for (i, ti) in t.iter().enumerate() {
            let x = _mm512_castps_si512(ti.0);
            let k0: __m512bh = std::mem::transmute(fp8_words::<F>(_mm512_shuffle_epi8(x, sp0)));
            let k1: __m512bh = std::mem::transmute(fp8_words::<F>(_mm512_shuffle_epi8(x, sp1)));
            let pi = 32 * c4 + 2 * i;
            for x in 0..NR {
                let q0: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*q.add(x * dp + pi) as i32));
                let q1: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*q.add(x * dp + pi + 1) as i32));
                s0[x] = _mm512_dpbf16_ps(s0[x], q0, k0);
                s1[x] = _mm512_dpbf16_ps(s1[x], q1, k1);
            }
        }
    }
    let sc = _mm512_set1_ps(scale);
    for x in 0..NR {
        _mm512_storeu_ps(p.add(x * W), _mm512_mul_ps(_mm512_add_ps(s0[x], s1[x]), sc));
    }
}

/// `acc[x][:] += sum_j p[x][j] * V_j` for `nr` (1..=4) rows over fp8 V rows `v` (`njp` pairs
/// of keys; a zero row for keys that are not real), P as bf16 key pairs scaled by
/// 2^`FP8_PRE` (`pb` rows `W / 2` dwords apart), one `vdpbf16ps` per two keys and 16
/// dimensions, `acc` in dimension order (and 2^(bias - `FP8_PRE`) too small: the caller
/// scales it once per item). Each pair of keys: 4 byte permutes (`vpermt2b`, zeroing the low
/// bytes) put the two keys' codes of 16 dimensions side by side in the high bytes of a dword
/// each, then `fp8_words`.
#[inline(always)]
pub unsafe fn fp8_pv<const F: u8, R: Rows>(
    acc: *mut f32,
    pb: *const u32,
    d: usize,
    nr: usize,
    v: &R,
    njp: usize,
) {
    match nr {
        1 => fp8_pv_n::<F, 1, R>(acc, pb, d, v, njp),
        2 => fp8_pv_n::<F, 2, R>(acc, pb, d, v, njp),
        3 => fp8_pv_n::<F, 3, R>(acc, pb, d, v, njp),
        _ => fp8_pv_n::<F, 4, R>(acc, pb, d, v, njp),
    }
}

/// Byte indices for `vpermt2b(a, idx, b)`: dword i of output `m` = [_, a[16 m + i], _,
/// b[16 m + i]] (the even bytes are zeroed by the mask).
#[inline(always)]
unsafe fn fp8_pair_idx(m: usize) -> __m512i {
    let mut idx = [0u8; 64];
    for (p, x) in idx.iter_mut().enumerate() {
        let (i, b) = (p / 4, p % 4);
        *x = (16 * m + i) as u8 + if b == 3 { 64 } else { 0 };
    }
    _mm512_loadu_si512(idx.as_ptr() as *const _)
}

#[inline(always)]
unsafe fn fp8_pv_n<const F: u8, const NR: usize, R: Rows>(
    acc: *mut f32,
    pb: *const u32,
    d: usize,
    v: &R,
    njp: usize,
) {
    const HIGH: __mmask64 = 0xAAAA_AAAA_AAAA_AAAA;
    let idx = [
        fp8_pair_idx(0),
        fp8_pair_idx(1),
        fp8_pair_idx(2),
        fp8_pair_idx(3),
    ];
    let mut c = 0;
    while c < d {
        let mut a = [[_mm512_setzero_ps(); 4]; NR];
        for x in 0..NR {
            for m in 0..4 {
                a[x][m] = _mm512_loadu_ps(acc.add(x * d + c + m * W));
            }
        }
        for jp in 0..njp {
            let va = _mm512_loadu_si512(v.row(2 * jp).add(c) as *const _);
            let vb = _mm512_loadu_si512(v.row(2 * jp + 1).add(c) as *const _);
            let mut xs = [_mm512_setzero_si512(); 4];
            for (m, xm) in xs.iter_mut().enumerate() {
                *xm = fp8_words::<F>(_mm512_maskz_permutex2var_epi8(HIGH, va, idx[m], vb));
            }
            for x in 0..NR {
                let pj: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*pb.add(x * (W / 2) + jp) as i32));
                for m in 0..4 {
                    let xm: __m512bh = std::mem::transmute(xs[m]);
                    a[x][m] = _mm512_dpbf16_ps(a[x][m], pj, xm);
                }
            }
        }
        for x in 0..NR {
            for m in 0..4 {
                _mm512_storeu_ps(acc.add(x * d + c + m * W), a[x][m]);
            }
        }
        c += 64;
    }
}

/// Row `acc` (`d` floats) from the permuted layout back to dimension order.
pub fn unpermute(acc: &mut [f32]) {
    for chunk in acc.chunks_exact_mut(64) {
        let mut t = [0f32; 64];
        for m in 0..4 {
            for l in 0..4 {
                for i in 0..4 {
                    t[16 * l + 4 * m + i] = chunk[16 * m + 4 * l + i];
                }
            }
        }
        chunk.copy_from_slice(&t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{fp8_bias, FP8_PRE};

    #[test]
    fn q_parts_reconstruct_the_row() {
        let q: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173)
            .collect();
        let (mut hi, mut lo) = ([0i8; 64], [0i8; 64]);
        let (s, ch, cl) = quantize_parts(&q, &mut hi, &mut lo);
        let mx = q.iter().fold(0f32, |m, x| m.max(x.abs()));
        for i in 0..64 {
            let r = s * (hi[i] as f32 + lo[i] as f32 / 256.0);
            assert!(
                (r - q[i]).abs() <= mx / 127.0 / 500.0,
                "{i}: {r} vs {}",
                q[i]
            );
        }
        assert_eq!(ch, 128 * hi.iter().map(|&h| h as i32).sum::<i32>());
        assert_eq!(cl, 128 * lo.iter().map(|&h| h as i32).sum::<i32>());
        assert_eq!(quantize_parts(&[0.0; 64], &mut hi, &mut lo), (0.0, 0, 0));
    }

    #[test]
    fn avx512_quantizer_matches_the_scalar_one() {
        if !crate::has_avx512() {
            return;
        }
        // rows of pseudo-random values, rows whose products land on exact halves (ties: the
        // largest value 127, so the scale is 1), zeros, a NaN, an infinity, odd lengths
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for (n, d) in [16usize, 64, 128, 256, 48, 40, 7].iter().enumerate() {
            let mut x = 0x9e37_79b9u32.wrapping_mul(n as u32 + 1);
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 20001) as f32 / 10000.0 - 1.0
            };
            rows.push((0..*d).map(|_| next() * 3.7).collect());
            rows.push((0..*d).map(|_| next() * 1e-30).collect());
            let mut ties: Vec<f32> = (0..*d)
                .map(|i| {
                    (i as f32 - *d as f32 / 2.0) * 0.5 + [0.0, 1.0 / 512.0, -1.0 / 512.0][i % 3]
                })
                .collect();
            ties[0] = 127.0;
            rows.push(ties);
            rows.push(vec![0.0; *d]);
            let mut nan = rows[rows.len() - 4].clone();
            nan[d / 2] = f32::NAN;
            rows.push(nan);
            let mut inf = rows[rows.len() - 5].clone();
            inf[d - 1] = f32::NEG_INFINITY;
            rows.push(inf);
        }
        for q in &rows {
            let d = q.len();
            let (mut h0, mut l0, mut h1, mut l1) =
                (vec![0i8; d], vec![0i8; d], vec![0i8; d], vec![0i8; d]);
            let want = quantize_q(q, &mut h0, &mut l0);
            let got = unsafe { quantize_q_avx512(q, &mut h1, &mut l1) };
            assert_eq!((h0, l0), (h1, l1), "codes, d {d}");
            assert_eq!(
                want.map(f32::to_bits),
                got.map(f32::to_bits),
                "meta, d {d}: {want:?} vs {got:?}"
            );
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni")]
    unsafe fn qk_pv_vnni<R: Rows>(k: &R, q: &[f32], p: &mut [f32], acc: &mut [f32]) {
        let d = q.len();
        let (mut hi, mut lo) = (vec![0i8; d], vec![0i8; d]);
        let meta = quantize_q(q, &mut hi, &mut lo);
        qk(
            k,
            d,
            1,
            hi.as_ptr(),
            lo.as_ptr(),
            meta.as_ptr(),
            p.as_mut_ptr(),
        );
        let w: Vec<f32> = (0..W).map(|j| (j as f32 * 0.37).sin().abs()).collect();
        pv(acc.as_mut_ptr(), w.as_ptr(), d, 1, k, 4);
    }

    #[test]
    fn integer_dot_products_match_scalar() {
        if !crate::has_avx512() || !crate::has_vnni() || !is_x86_feature_detected!("avx512bf16") {
            return;
        }
        let d = 128;
        let rows: Vec<Vec<i8>> = (0..W)
            .map(|j| {
                (0..d)
                    .map(|e| ((j * 131 + e * 71) % 256) as u8 as i8)
                    .collect()
            })
            .collect();
        let k: [*const u8; W] = std::array::from_fn(|j| rows[j].as_ptr() as *const u8);
        let q: Vec<f32> = (0..d)
            .map(|e| ((e * 29 % 17) as f32 - 8.0) * 0.21)
            .collect();
        let (mut p, mut acc) = (vec![0f32; W], vec![0f32; d]);
        unsafe { qk_pv_vnni(&k, &q, &mut p, &mut acc) };
        unpermute(&mut acc);
        for j in 0..W {
            let want: f32 = (0..d).map(|e| q[e] * rows[j][e] as f32).sum();
            assert!(
                (p[j] - want).abs() <= 1e-3 * want.abs().max(10.0),
                "{j}: {} vs {want}",
                p[j]
            );
        }
        let w: Vec<f32> = (0..W).map(|j| (j as f32 * 0.37).sin().abs()).collect();
        let step = w.iter().fold(0f32, |m, &x| m.max(x)) / 255.0;
        for e in 0..d {
            let want: f32 = (0..W).map(|j| w[j] * rows[j][e] as f32).sum();
            // each weight within half a step of its uint8 value
            let bound: f32 = (0..W).map(|j| step / 2.0 * (rows[j][e] as f32).abs()).sum();
            assert!(
                (acc[e] - want).abs() <= bound * 1.001 + 1e-3,
                "{e}: {} vs {want}",
                acc[e]
            );
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")]
    unsafe fn fp8_words_of<const F: u8>(codes: &[u8; 32]) -> [u16; 32] {
        let mut w = [0u16; 32];
        for (x, &c) in w.iter_mut().zip(codes.iter()) {
            *x = (c as u16) << 8;
        }
        let v = fp8_words::<F>(_mm512_loadu_si512(w.as_ptr() as *const _));
        _mm512_storeu_si512(w.as_mut_ptr() as *mut _, v);
        w
    }

    #[test]
    fn fp8_words_are_the_values_times_a_power_of_two() {
        if !crate::has_avx512() || !crate::has_vnni() || !is_x86_feature_detected!("avx512bf16") {
            return;
        }
        for c0 in (0..256).step_by(32) {
            let codes: [u8; 32] = std::array::from_fn(|i| (c0 + i) as u8);
            let (w4, w5) = unsafe { (fp8_words_of::<4>(&codes), fp8_words_of::<5>(&codes)) };
            for (i, &c) in codes.iter().enumerate() {
                for (w, f, sub, conv) in [
                    (
                        w4[i],
                        4u8,
                        c & 0x78 == 0,
                        crate::simd::e4m3_to_f32 as fn(u8) -> f32,
                    ),
                    (
                        w5[i],
                        5u8,
                        c & 0x7c == 0,
                        crate::simd::e5m2_to_f32 as fn(u8) -> f32,
                    ),
                ] {
                    let got = f32::from_bits((w as u32) << 16) * (2f32).powi(fp8_bias(f));
                    if sub {
                        // subnormal codes: a bf16 subnormal (read as zero by `vdpbf16ps`)
                        assert_eq!(w & 0x7f80, 0, "F={f} code {c:#x}");
                        assert_eq!(w & 0x8000, (c as u16 & 0x80) << 8);
                    } else if conv(c).is_finite() {
                        assert_eq!(got, conv(c), "F={f} code {c:#x}");
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")]
    unsafe fn fp8_qk_pv<const F: u8, R: Rows>(
        k: &R,
        q: &[u32],
        pb: &[u32],
        p: &mut [f32],
        acc: &mut [f32],
    ) {
        let d = 2 * q.len();
        fp8_qk::<F, _>(k, d, 1, q.as_ptr(), 1.0, p.as_mut_ptr());
        fp8_pv::<F, _>(acc.as_mut_ptr(), pb.as_ptr(), d, 1, k, W / 2);
    }

    #[test]
    fn fp8_dot_products_match_scalar() {
        if !crate::has_avx512() || !crate::has_vnni() || !is_x86_feature_detected!("avx512bf16") {
            return;
        }
        let d = 128;
        let bf = |x: f32| (x.to_bits() >> 16) as u16; // exact for the values below
                                                      // normal codes only (exponent bits not all zero), both signs
        let rows: Vec<Vec<u8>> = (0..W)
            .map(|j| {
                (0..d)
                    .map(|e| (((j * 131 + e * 71) % 112) as u8 + 8) | ((e as u8 & 1) << 7))
                    .collect()
            })
            .collect();
        let k: [*const u8; W] = std::array::from_fn(|j| rows[j].as_ptr());
        let qv: Vec<f32> = (0..d)
            .map(|e| ((e * 29 % 17) as f32 - 8.0) * 0.25)
            .collect();
        let pre = (2f32).powi(FP8_PRE);
        let q: Vec<u32> = (0..d / 2)
            .map(|i| bf(qv[2 * i] * pre) as u32 | (bf(qv[2 * i + 1] * pre) as u32) << 16)
            .collect();
        let w: Vec<f32> = (0..W).map(|j| (j as f32 + 1.0) / 16.0).collect();
        let pb: Vec<u32> = (0..W / 2)
            .map(|i| bf(w[2 * i] * pre) as u32 | (bf(w[2 * i + 1] * pre) as u32) << 16)
            .collect();
        for (f, conv) in [
            (4u8, crate::simd::e4m3_to_f32 as fn(u8) -> f32),
            (5, crate::simd::e5m2_to_f32),
        ] {
            let (mut p, mut acc) = (vec![0f32; W], vec![0f32; d]);
            unsafe {
                if f == 4 {
                    fp8_qk_pv::<4, _>(&k, &q, &pb, &mut p, &mut acc)
                } else {
                    fp8_qk_pv::<5, _>(&k, &q, &pb, &mut p, &mut acc)
                }
            };
            let post = (2f32).powi(fp8_bias(f) - FP8_PRE);
            for j in 0..W {
                let want: f32 = (0..d).map(|e| qv[e] * conv(rows[j][e])).sum();
                let got = p[j] * post;
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "F={f} key {j}: {got} vs {want}"
                );
            }
            for e in 0..d {
                let want: f32 = (0..W).map(|j| w[j] * conv(rows[j][e])).sum();
                let got = acc[e] * post;
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "F={f} dim {e}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn strided_rows_give_the_bits_of_an_address_array() {
        if !crate::has_avx512() || !crate::has_vnni() || !is_x86_feature_detected!("avx512bf16") {
            return;
        }
        let vbmi = is_x86_feature_detected!("avx512vbmi");
        let d = 64;
        let stride = 3 * d + 40; // rows of one head, other heads' bytes between them
        let buf: Vec<u8> = (0..W * stride + 5)
            .map(|i| (((i * 131 + 7) % 112) as u8 + 8) | ((i as u8 & 1) << 7))
            .collect();
        let base = buf[5..].as_ptr(); // not 64-byte aligned
        let strided = Strided::<0> { base, stride };
        let arr: [*const u8; W] = std::array::from_fn(|j| unsafe { base.add(j * stride) });
        let q: Vec<f32> = (0..d)
            .map(|e| ((e * 29 % 17) as f32 - 8.0) * 0.21)
            .collect();
        let run = |k: &dyn Fn(&mut [f32], &mut [f32])| {
            let (mut p, mut acc) = (vec![0f32; W], vec![0f32; d]);
            k(&mut p, &mut acc);
            (p, acc)
        };
        let a = run(&|p, acc| unsafe { qk_pv_vnni(&arr, &q, p, acc) });
        let b = run(&|p, acc| unsafe { qk_pv_vnni(&strided, &q, p, acc) });
        assert_eq!(a, b, "int8");
        if !vbmi {
            return;
        }
        let qb: Vec<u32> = (0..d / 2).map(|i| 0x3f80_3f80 + i as u32).collect();
        let pb: Vec<u32> = (0..W / 2).map(|i| 0x3f00_3f00 + i as u32).collect();
        for f in [4u8, 5] {
            let a = run(&|p, acc| unsafe {
                if f == 4 {
                    fp8_qk_pv::<4, _>(&arr, &qb, &pb, p, acc)
                } else {
                    fp8_qk_pv::<5, _>(&arr, &qb, &pb, p, acc)
                }
            });
            let b = run(&|p, acc| unsafe {
                if f == 4 {
                    fp8_qk_pv::<4, _>(&strided, &qb, &pb, p, acc)
                } else {
                    fp8_qk_pv::<5, _>(&strided, &qb, &pb, p, acc)
                }
            });
            assert_eq!(a, b, "fp8 F={f}");
        }
    }

    #[test]
    fn unpermute_inverts_the_layout() {
        let mut a = [0f32; 128];
        for c in 0..2 {
            for m in 0..4 {
                for l in 0..4 {
                    for i in 0..4 {
                        a[64 * c + 16 * m + 4 * l + i] = (64 * c + 16 * l + 4 * m + i) as f32;
                    }
                }
            }
        }
        unpermute(&mut a);
        for (e, x) in a.iter().enumerate() {
            assert_eq!(*x, e as f32);
        }
    }
}
