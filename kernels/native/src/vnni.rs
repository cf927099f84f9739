//! Quantized decode on AVX-512 VNNI / VBMI. int8: scores and P.V as integer dot products of the
//! int8 codes, no conversion of K or V to bf16 or fp32 (`attend::run_item` takes it for items
//! of at most `MAX_ROWS` rows per KV head over an int8 cache, with bf16 queries). fp8 (`fp8_*`,
//! at most 4 rows): codes to bf16 by two `vpermi2b` table lookups, then the bf16 pair dot
//! products, V paired in registers.
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
//! The fp8 accumulator uses the same permuted layout (its V pairs come from the same unpacks).

#![cfg(target_arch = "x86_64")]

use crate::simd::{Avx512, Simd, W};
use std::arch::x86_64::*;

/// Rows per KV head up to which an item takes this path.
pub const MAX_ROWS: usize = 8;

/// Rows one call handles (accumulators in registers).
pub const NR_MAX: usize = 4;

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

#[inline(always)]
unsafe fn bcast(p: *const i8, dw: usize) -> __m512i {
    _mm512_set1_epi32((p as *const i32).add(dw).read_unaligned())
}

/// Scores of `nr` (1..=`NR_MAX`) rows against the 16 keys `k` (int8 rows, a zero row for keys
/// that are not real): `p[x * W + j]` = s_x sum_d q_x[d] k_j[d] (before the key's scale).
/// `qh` / `ql`: the rows' parts, `d` apart; `meta`: `quantize_q`'s three floats per row.
#[inline(always)]
pub unsafe fn qk(
    k: &[*const u8; W],
    d: usize,
    nr: usize,
    qh: *const i8,
    ql: *const i8,
    meta: *const f32,
    p: *mut f32,
) {
    match nr {
        1 => qk_n::<1>(k, d, qh, ql, meta, p),
        2 => qk_n::<2>(k, d, qh, ql, meta, p),
        3 => qk_n::<3>(k, d, qh, ql, meta, p),
        _ => qk_n::<4>(k, d, qh, ql, meta, p),
    }
}

#[inline(always)]
unsafe fn qk_n<const NR: usize>(
    k: &[*const u8; W],
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
        for (tj, &kj) in t.iter_mut().zip(k.iter()) {
            let row = _mm512_loadu_si512(kj.add(c) as *const _);
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
pub unsafe fn pv(acc: *mut f32, p: *const f32, d: usize, nr: usize, v: &[*const u8; W], ng: usize) {
    match nr {
        1 => pv_n::<1>(acc, p, d, v, ng),
        2 => pv_n::<2>(acc, p, d, v, ng),
        3 => pv_n::<3>(acc, p, d, v, ng),
        _ => pv_n::<4>(acc, p, d, v, ng),
    }
}

#[inline(always)]
unsafe fn pv_n<const NR: usize>(
    acc: *mut f32,
    p: *const f32,
    d: usize,
    v: &[*const u8; W],
    ng: usize,
) {
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
                *rj = _mm512_loadu_si512(v[4 * g + j].add(c) as *const _);
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

/// fp8 (E4M3 / E5M2) to bf16 by table (AVX-512 VBMI `vpermi2b`): the low and high bytes of
/// the bf16 of each 7-bit magnitude, two 64-byte halves each (exact: fp8 values are bf16 values).
pub struct Fp8Lut {
    lo: [__m512i; 2],
    hi: [__m512i; 2],
}

fn fp8_tables() -> &'static [[u8; 128]; 4] {
    static T: std::sync::OnceLock<[[u8; 128]; 4]> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut t = [[0u8; 128]; 4];
        for x in 0..128u8 {
            for (f, conv) in [crate::simd::e4m3_to_f32, crate::simd::e5m2_to_f32]
                .iter()
                .enumerate()
            {
                let b = (conv(x).to_bits() >> 16) as u16;
                t[2 * f][x as usize] = b as u8;
                t[2 * f + 1][x as usize] = (b >> 8) as u8;
            }
        }
        t
    })
}

/// The tables of E4M3 (`e5m2` false) or E5M2.
#[inline(always)]
pub unsafe fn fp8_lut(e5m2: bool) -> Fp8Lut {
    let t = &fp8_tables()[2 * e5m2 as usize..];
    Fp8Lut {
        lo: [
            _mm512_loadu_si512(t[0].as_ptr() as *const _),
            _mm512_loadu_si512(t[0].as_ptr().add(64) as *const _),
        ],
        hi: [
            _mm512_loadu_si512(t[1].as_ptr() as *const _),
            _mm512_loadu_si512(t[1].as_ptr().add(64) as *const _),
        ],
    }
}

/// 64 fp8 codes to bf16: (lane L words = codes 16 L + 0..7, lane L words = codes 16 L + 8..15).
#[inline(always)]
unsafe fn fp8_bf16(l: &Fp8Lut, x: __m512i) -> (__m512i, __m512i) {
    let lo = _mm512_permutex2var_epi8(l.lo[0], x, l.lo[1]);
    let hi = _mm512_permutex2var_epi8(l.hi[0], x, l.hi[1]);
    let hi = _mm512_or_si512(hi, _mm512_and_si512(x, _mm512_set1_epi8(-128)));
    (_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi))
}

/// Natural pair index (within 64 dimensions) of pair row `p` of `fp8_k_pairs`' tile.
#[inline(always)]
fn fp8_pair_of(p: usize) -> usize {
    let (r, i) = (p / 16, p % 16);
    8 * (i / 4) + 4 * r + i % 4
}

/// A bf16 query row's dimension pairs (`d / 2` dwords) in the order of `fp8_k_pairs`' rows.
pub fn fp8_permute_q_pairs(row: &mut [u32]) {
    for chunk in row.chunks_exact_mut(32) {
        let mut t = [0u32; 32];
        for (p, x) in t.iter_mut().enumerate() {
            *x = chunk[fp8_pair_of(p)];
        }
        chunk.copy_from_slice(&t);
    }
}

/// The fp8 K tile (16 rows `k`, a zero row for keys that are not real) as bf16 dimension pairs,
/// `kp[p][j]`, pair rows in `fp8_pair_of` order per 64 dimensions (`d / 2` rows of 16 dwords).
/// Each 64 codes are converted once: the second half waits in `tmp` (16 x 32 halves).
#[inline(always)]
pub unsafe fn fp8_k_pairs(l: &Fp8Lut, k: &[*const u8; W], d: usize, kp: *mut u32, tmp: *mut u16) {
    for c4 in 0..d / 64 {
        let mut t = [Avx512::<true, true>(_mm512_setzero_ps()); W];
        for (j, (tj, &kj)) in t.iter_mut().zip(k.iter()).enumerate() {
            let (w0, w1) = fp8_bf16(l, _mm512_loadu_si512(kj.add(64 * c4) as *const _));
            *tj = Avx512(_mm512_castsi512_ps(w0));
            _mm512_storeu_si512(tmp.add(32 * j) as *mut _, w1);
        }
        for half in 0..2 {
            if half == 1 {
                for (j, tj) in t.iter_mut().enumerate() {
                    *tj = Avx512(_mm512_loadu_ps(tmp.add(32 * j) as *const f32));
                }
            }
            <Avx512<true, true> as Simd>::transpose(&mut t);
            let c2 = 2 * c4 + half;
            for (i, v) in t.iter().enumerate() {
                _mm512_storeu_ps(kp.add((c2 * W + i) * W) as *mut f32, v.0);
            }
        }
    }
}

/// `acc[x][:] += sum_j p[x][j] * V_j` for `nr` (1..=`NR_MAX`) rows over fp8 V rows `v` (`njp`
/// pairs of keys; a zero row for keys that are not real), P as bf16 key pairs (`pb` rows `W / 2`
/// dwords apart), one `vdpbf16ps` per two keys and 16 dimensions; acc in the permuted layout.
#[inline(always)]
pub unsafe fn fp8_pv(
    l: &Fp8Lut,
    acc: *mut f32,
    pb: *const u32,
    d: usize,
    nr: usize,
    v: &[*const u8; W],
    njp: usize,
) {
    match nr {
        1 => fp8_pv_n::<1>(l, acc, pb, d, v, njp),
        2 => fp8_pv_n::<2>(l, acc, pb, d, v, njp),
        3 => fp8_pv_n::<3>(l, acc, pb, d, v, njp),
        _ => fp8_pv_n::<4>(l, acc, pb, d, v, njp),
    }
}

#[inline(always)]
unsafe fn fp8_pv_n<const NR: usize>(
    l: &Fp8Lut,
    acc: *mut f32,
    pb: *const u32,
    d: usize,
    v: &[*const u8; W],
    njp: usize,
) {
    let mut c = 0;
    while c < d {
        let mut a = [[_mm512_setzero_ps(); 4]; NR];
        for x in 0..NR {
            for m in 0..4 {
                a[x][m] = _mm512_loadu_ps(acc.add(x * d + c + m * W));
            }
        }
        for jp in 0..njp {
            let (a0, a1) = fp8_bf16(l, _mm512_loadu_si512(v[2 * jp].add(c) as *const _));
            let (b0, b1) = fp8_bf16(l, _mm512_loadu_si512(v[2 * jp + 1].add(c) as *const _));
            // key pairs per dword: vector m, lane 4 L + i = dimension 16 L + 4 m + i
            let xs = [
                _mm512_unpacklo_epi16(a0, b0),
                _mm512_unpackhi_epi16(a0, b0),
                _mm512_unpacklo_epi16(a1, b1),
                _mm512_unpackhi_epi16(a1, b1),
            ];
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

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni")]
    unsafe fn qk_pv_vnni(k: &[*const u8; W], q: &[f32], p: &mut [f32], acc: &mut [f32]) {
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
