//! Row-wise argmax of bf16 values (greedy sampling over a step's bf16 logits, without widening
//! them to fp32 first).
//!
//! Each value maps to an order-preserving 16-bit key (`key`): a larger value has a larger key,
//! -0 and +0 share one, any NaN is above everything. The answer is the first index of the
//! largest key per row: NumPy's and torch's argmax (first index on ties, the first NaN where a
//! row has one). AVX-512 BW: 32 keys per vector, per lane the best key and the first block
//! where it was seen, then the lanes reduced; AVX2: the same over 16 lanes, on signed keys (`key`
//! xor 0x8000, as AVX2 compares 16-bit lanes signed only); elsewhere a scalar loop. One pass
//! over the row, nothing allocated. The AVX2 loop is 19-60x the scalar one (48 x 49,152 logits
//! on a Zen 3: 0.19 ms against 3.6-11.3 ms, the scalar loop's branch on each value's sign
//! mispredicted).

/// The order-preserving key of bf16 bits `b`.
#[inline(always)]
pub fn key(b: u16) -> u16 {
    if b & 0x7fff > 0x7f80 {
        return 0xffff; // NaN
    }
    let b = if b == 0x8000 { 0 } else { b }; // -0 as +0
    if b & 0x8000 != 0 {
        !b
    } else {
        b | 0x8000
    }
}

/// First index of the largest key of `row` (0 for an empty row).
pub fn argmax_portable(row: &[u16]) -> usize {
    let mut best = 0;
    let mut bk = 0u16;
    for (i, &b) in row.iter().enumerate() {
        let k = key(b);
        if k > bk || i == 0 {
            bk = k;
            best = i;
        }
    }
    best
}

/// `argmax_portable` of the `n` values at `p`, 32 at a time.
///
/// # Safety
/// AVX-512 BW on this CPU; `p` points to `n` readable bf16 values; `n / 32 <= u16::MAX`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn argmax_avx512(p: *const u16, n: usize) -> usize {
    use std::arch::x86_64::*;
    let nb = n / 32;
    if nb == 0 {
        return argmax_portable(std::slice::from_raw_parts(p, n));
    }
    let top = _mm512_set1_epi16(0x8000u16 as i16);
    let abs = _mm512_set1_epi16(0x7fff);
    let inf = _mm512_set1_epi16(0x7f80);
    let ones = _mm512_set1_epi16(-1);
    let zero = _mm512_setzero_si512();
    let mut best = zero; // below every key (the lowest, -inf's, is 0x007f)
    let mut bidx = zero;
    for blk in 0..nb {
        let v = _mm512_loadu_si512(p.add(32 * blk) as *const _);
        let v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(v, top), zero);
        let k = _mm512_xor_si512(v, _mm512_or_si512(_mm512_srai_epi16::<15>(v), top));
        let nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(v, abs), inf);
        let k = _mm512_mask_mov_epi16(k, nan, ones);
        let gt = _mm512_cmpgt_epu16_mask(k, best);
        best = _mm512_mask_mov_epi16(best, gt, k);
        bidx = _mm512_mask_mov_epi16(bidx, gt, _mm512_set1_epi16(blk as u16 as i16));
    }
    let mut keys = [0u16; 32];
    let mut blks = [0u16; 32];
    _mm512_storeu_si512(keys.as_mut_ptr() as *mut _, best);
    _mm512_storeu_si512(blks.as_mut_ptr() as *mut _, bidx);
    reduce_lanes(&keys, &blks, p, n)
}

/// The first index of the largest key: each lane's best key `keys[lane]`, first seen in block
/// `blks[lane]` (blocks of `keys.len()` values), then the values after the last whole block.
///
/// # Safety
/// `p` points to `n` readable bf16 values.
#[cfg(target_arch = "x86_64")]
unsafe fn reduce_lanes(keys: &[u16], blks: &[u16], p: *const u16, n: usize) -> usize {
    let w = keys.len();
    let (mut bk, mut bi) = (0u16, usize::MAX);
    for (lane, (&k, &b)) in keys.iter().zip(blks).enumerate() {
        let i = b as usize * w + lane;
        if k > bk || (k == bk && i < bi) {
            bk = k;
            bi = i;
        }
    }
    for i in n / w * w..n {
        let k = key(*p.add(i));
        if k > bk {
            bk = k;
            bi = i;
        }
    }
    bi
}

/// `argmax_portable` of the `n` values at `p`, 16 at a time, on signed keys: `key(b) ^ 0x8000`
/// is `b ^ (0x7fff if b < 0)` (after -0 -> +0), NaN 0x7fff, so a signed compare orders them.
///
/// # Safety
/// AVX2 on this CPU; `p` points to `n` readable bf16 values; `n / 16 <= u16::MAX`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub unsafe fn argmax_avx2(p: *const u16, n: usize) -> usize {
    use std::arch::x86_64::*;
    let nb = n / 16;
    if nb == 0 {
        return argmax_portable(std::slice::from_raw_parts(p, n));
    }
    let top = _mm256_set1_epi16(0x8000u16 as i16);
    let abs = _mm256_set1_epi16(0x7fff);
    let inf = _mm256_set1_epi16(0x7f80);
    let mut best = _mm256_set1_epi16(i16::MIN); // below every key (-inf's is -32641)
    let mut bidx = _mm256_setzero_si256();
    for blk in 0..nb {
        let v = _mm256_loadu_si256(p.add(16 * blk) as *const _);
        let v = _mm256_andnot_si256(_mm256_cmpeq_epi16(v, top), v); // -0 as +0
        let k = _mm256_xor_si256(v, _mm256_and_si256(_mm256_srai_epi16::<15>(v), abs));
        let nan = _mm256_cmpgt_epi16(_mm256_and_si256(v, abs), inf);
        let k = _mm256_blendv_epi8(k, abs, nan);
        let gt = _mm256_cmpgt_epi16(k, best); // strict: a lane keeps its first block on ties
        best = _mm256_max_epi16(best, k);
        bidx = _mm256_blendv_epi8(bidx, _mm256_set1_epi16(blk as u16 as i16), gt);
    }
    // back to unsigned keys
    let best = _mm256_xor_si256(best, top);
    let mut keys = [0u16; 16];
    let mut blks = [0u16; 16];
    _mm256_storeu_si256(keys.as_mut_ptr() as *mut _, best);
    _mm256_storeu_si256(blks.as_mut_ptr() as *mut _, bidx);
    reduce_lanes(&keys, &blks, p, n)
}

/// `out[r]` = the argmax of row `r` (`rows` rows of `n` values, `stride` elements apart).
///
/// # Safety
/// `x` holds the rows, `out` has `rows` writable slots.
pub unsafe fn argmax_rows(x: *const u16, rows: usize, n: usize, stride: usize, out: *mut i64) {
    #[cfg(target_arch = "x86_64")]
    let fast = crate::has_avx512() && n / 32 <= u16::MAX as usize;
    #[cfg(target_arch = "x86_64")]
    let avx2 = !fast && crate::has_avx2() && n / 16 <= u16::MAX as usize;
    #[cfg(not(target_arch = "x86_64"))]
    let fast = false;
    for r in 0..rows {
        let p = x.add(r * stride);
        #[cfg(target_arch = "x86_64")]
        let i = if fast {
            argmax_avx512(p, n)
        } else if avx2 {
            argmax_avx2(p, n)
        } else {
            argmax_portable(std::slice::from_raw_parts(p, n))
        };
        #[cfg(not(target_arch = "x86_64"))]
        let i = argmax_portable(std::slice::from_raw_parts(p, n));
        *out.add(r) = i as i64;
    }
    let _ = fast;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(x: f32) -> u16 {
        (x.to_bits() >> 16) as u16
    }

    #[test]
    fn keys_order_values_and_put_nan_on_top() {
        let xs = [
            f32::NEG_INFINITY,
            -3.0,
            -1.0,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in xs.windows(2) {
            let (a, b) = (key(bits(w[0])), key(bits(w[1])));
            if w[0] == w[1] {
                assert_eq!(a, b);
            } else {
                assert!(a < b, "{} {}", w[0], w[1]);
            }
        }
        assert_eq!(key(bits(f32::NAN)), 0xffff);
        assert_eq!(key(bits(-f32::NAN)), 0xffff);
    }

    #[test]
    fn vector_paths_match_the_scalar_one() {
        #[cfg(target_arch = "x86_64")]
        {
            type Path = unsafe fn(*const u16, usize) -> usize;
            let paths: [(bool, Path); 2] = [
                (crate::has_avx512(), argmax_avx512),
                (crate::has_avx2(), argmax_avx2),
            ];
            let mut seed = 7u64;
            for n in [1usize, 5, 15, 16, 17, 31, 32, 33, 64, 100, 1000, 4099] {
                for case in 0..40 {
                    let row: Vec<u16> = (0..n)
                        .map(|_| {
                            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                            let v = ((seed >> 33) % 9) as f32 - 4.0; // many ties
                            match (seed >> 20) % 97 {
                                0 if case % 3 == 0 => bits(f32::NAN),
                                1 if case % 5 == 0 => bits(-f32::NAN),
                                2 => bits(-0.0),
                                3 => bits(f32::NEG_INFINITY),
                                4 if case % 2 == 0 => bits(f32::INFINITY),
                                _ => bits(v),
                            }
                        })
                        .collect();
                    let want = argmax_portable(&row);
                    for (on, f) in paths {
                        if on {
                            let got = unsafe { f(row.as_ptr(), n) };
                            assert_eq!(got, want, "n {n} case {case}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn avx2_picks_the_max_in_the_tail_and_the_first_of_equal_lanes() {
        #[cfg(target_arch = "x86_64")]
        if crate::has_avx2() {
            // the largest value after the last whole block of 16; then every value equal
            let mut row = [bits(-1.0); 37];
            row[36] = bits(2.0);
            assert_eq!(unsafe { argmax_avx2(row.as_ptr(), 37) }, 36);
            let row = [bits(-3.0); 50];
            assert_eq!(unsafe { argmax_avx2(row.as_ptr(), 50) }, 0);
            // -0 and +0 tie: the first wins; all -inf: index 0; a negative NaN beats +inf
            let row = [bits(-0.0), bits(0.0), bits(-1.0)].repeat(11);
            assert_eq!(unsafe { argmax_avx2(row.as_ptr(), 33) }, 0);
            let row = [bits(f32::NEG_INFINITY); 40];
            assert_eq!(unsafe { argmax_avx2(row.as_ptr(), 40) }, 0);
            let mut row = [bits(f32::INFINITY); 40];
            row[21] = bits(-f32::NAN);
            assert_eq!(unsafe { argmax_avx2(row.as_ptr(), 40) }, 21);
        }
    }
}
