//! Decode attention off AMX tiles on AVX-512 BF16 (Zen 4; AVX-512 Xeons with AMX off), the lean
//! path: one query token per item, every KV head of the task in one pass over the item's
//! blocks, two passes per segment of up to `SEG` kept key tiles, for a bf16 cache (up to 4 query
//! heads per KV head), an int8 one (up to `vnni::MAX_ROWS`, AVX-512 VNNI) or an fp8 one (up to
//! 4, VNNI and VBMI). `F` is the format code (`attend::fmt_code`: 1 bf16, 3 int8, 4 / 5 fp8).
//!
//!   pass 1   per 16 keys and KV head: the scores of the head's rows against the 16 K rows read
//!            in place (bf16: each 32-dimension chunk transposed 16 x 16 dwords in registers,
//!            one broadcast bf16-pair dot product per row and pair; int8: `vnni::qk`'s integer
//!            dot products, times the keys' scales; fp8: `vnni::fp8_qk`), scaled, soft-capped,
//!            masked and kept (int8: the keys' V scales kept too). The K lines of the tile
//!            `RUN_AHEAD` tiles on are prefetched a KV head's share at a time (int8 / fp8:
//!            `Q_AHEAD` tiles on; fp8 its V lines too).
//!   max      per row over the segment; the running max, sum and accumulator rescaled once if
//!            the max rose
//!   pass 2   per tile, then KV head: `exp` against the max, then P.V on V read in place (bf16:
//!            P in bf16 pairs, V rows paired in registers; int8: P times the V scales,
//!            `vnni::pv`; fp8: P in bf16 pairs, `vnni::fp8_pv`), a full one-block tile's rows
//!            addressed by their stride; V's lines `V_AHEAD` tiles on prefetched a head's share
//!            at a time (int8: `QV_AHEAD`; fp8: none, see pass 1).
//!
//! For a bf16 cache the arithmetic and its order are those of `attend::run_item`'s two-pass path
//! (`two_pass`, `two_pass_flush`), so the outputs are bit-identical to it
//! (`KVCORE_NATIVE_ISA=tileloop` runs that path, for A/B runs). For int8 and fp8 the tile loop
//! runs a one-pass online softmax (`tileloop` again): the same dot products, with the max, sum
//! and rescale per tile instead of per segment, so the two agree to rounding (int8: P's uint8
//! steps are per tile and row against a different max). What this file drops is that loop's
//! bookkeeping: the transposed K tile stored and reloaded by `qk_pairs`, per-tile key,
//! V-address and key-position arrays, and a block-table division per prefetch point (the
//! bookkeeping was ~40 % of a bf16 decode tile there), and, for int8 / fp8, the horizontal max,
//! sum, scalar `exp` and rescale per tile and row; and V is prefetched for pass 2 in pass 2
//! (see `V_AHEAD`).
//!
//! int8 / fp8 items whose row stride is 64 or 128 bytes run an instance with that stride
//! compiled in (`run_quant`): the row addresses become immediate offsets.
//!
//! Invariants: the caller checked `eligible` and holds a cache of format `F`; a key outside the
//! range, the window or a released block scores -inf and is read as a zero row by P.V (a
//! released block is never read). Scratch per thread, grown, never freed. Costs per 16 keys and
//! KV head (head dim 64, `g` rows), bf16: 32 row loads and 128 shuffles, then 32 `g` dot
//! products for the scores; 32 loads, 32 permutes and 32 `g` dot products for P.V (int8 and
//! fp8: `vnni.rs`'s header).
//!
//! Flash-decoding's split of the scores from one normalisation, within one work item.

#![cfg(target_arch = "x86_64")]

use crate::attend::{prefetch_keys, prefetch_row, Call, Dt, PREFETCH_KEYS};
use crate::dec_amx::{key_mask, tile_keys, write_row, Scratch, TileKeys};
use crate::simd::{fp8_bias, pv_pairs_rows, Avx512, Simd, FP8_PRE, W};
use crate::vnni::{self, Rows, Strided};
use std::arch::x86_64::*;

type V = Avx512<true>;

/// Kept key tiles per segment: pass 1's K and V rows (512 keys; 3 KV heads of 64-dim bf16 rows:
/// 384 KiB) stay in L2 for pass 2 (the tile loop's `TWO_SEG`, and the same segment boundaries).
const SEG: usize = 32;

/// Where a tile's rows are one address run per K and V (a full one-block tile of a task over
/// every KV head), pass 1 prefetches the K run `RUN_AHEAD` tiles on and pass 2 the V run
/// `V_AHEAD` kept tiles on. V prefetched in pass 1 with K (the tile loop's way) had not arrived
/// by pass 2: on a Zen 4, 48 x 288 decode over 30 caches (cold), pass 2 alone took 0.58 ms
/// against 0.16 warm. Measured there (1 thread, cold, alternated with the tile loop): K 1 / 2
/// / 3 / 4 tiles and V 2 tiles on: 1.09 / 1.18 / 1.17 / 1.16x the tile loop; V 1 / 2 / 3 / 4 / 8
/// (K 2): 1.10-1.14 / 1.16-1.20 / 1.17 / 1.07 / 1.00x.
const RUN_AHEAD: usize = 2;
const V_AHEAD: usize = 2;

/// int8 / fp8 rows are half a bf16 row: their K rows are prefetched `Q_AHEAD` tiles on in pass
/// 1, a head's rows at a time (a head's rows of a block are adjacent in those caches); int8's V
/// rows `QV_AHEAD` kept tiles on in pass 2, fp8's in pass 1 with the K rows. Measured on a Zen
/// 4 (1 thread, each call after another format's, so its bytes come from DRAM), fp8's V in
/// pass 1 against pass 2: 8 x 16K 1.10x, 8 x 4K 1.04x, 1 x 16K 0.99x, 48 x 288 0.97x (after
/// a 64 MB copy, 8 x 4K: 1.04x at 1 thread, 1.07x at 2); int8's: 0.96-0.97x.
const Q_AHEAD: usize = 4;
const QV_AHEAD: usize = 4;

/// Whether `run` (`F` = 1) or `run_quant::<F>` takes an item of `ntok` query tokens with `g`
/// query heads per KV head: the lean path on (`c.lean`: not `onepass` nor `tileloop`), bf16
/// queries, one token, no ALiBi; bf16: up to 4 rows per KV head, head dim a multiple of 32, no
/// fp8 scales; int8: up to `vnni::MAX_ROWS` rows, fp8: up to 4, head dim a multiple of 64.
/// (The CPU's features and the cache's format are the caller's checks; AMX's decode, where
/// granted, is tried first.)
pub fn eligible<const F: u8>(c: &Call, ntok: usize, g: usize) -> bool {
    let fmt = match F {
        1 => (1..=4).contains(&g) && c.head_dim % 32 == 0 && c.fp8_scale.is_null(),
        3 => (1..=vnni::MAX_ROWS).contains(&g) && c.head_dim % 64 == 0,
        4 | 5 => (1..=4).contains(&g) && c.head_dim % 64 == 0,
        _ => false,
    };
    fmt && c.lean && c.dt == Dt::Bf16 && ntok == 1 && c.alibi.is_null()
}

/// A kept tile of a segment: its mask (keys in range, window and real blocks), whether all 16
/// keys are real and in one block, each real key's byte offset of its row in head 0.
#[derive(Clone, Copy)]
struct Tile {
    mk: u16,
    real: u16,
    one_block: bool,
    off: [usize; W],
}

/// Keys ahead of the current tile whose K and V lines pass 1 prefetches: for a task over `nh`
/// KV heads about the bytes one head has `PREFETCH_KEYS` ahead, in whole tiles (`attend`'s
/// `pf_ahead` for bf16 rows).
fn keys_ahead(nh: usize) -> i64 {
    if nh <= 1 {
        return PREFETCH_KEYS;
    }
    let w = W as i64;
    (PREFETCH_KEYS / nh as i64).max(w) / w * w
}

/// The scores of one tile and KV head for `NR` query rows: `(q . k) * scale` per key, K's rows at
/// `rows[j] + 64 dk` for chunk `dk` (32 dimensions), `q` the rows' dimension pairs (`d / 2`
/// apart). Two accumulators per row (even / odd pairs), as `Simd::qk_pairs`.
#[inline(always)]
unsafe fn scores<const NR: usize>(
    q: *const u32,
    d: usize,
    rows: &[*const u8; W],
    scale: __m512,
    out: &mut [__m512; 4],
) {
    let dp = d / 2;
    let mut s0 = [_mm512_setzero_ps(); NR];
    let mut s1 = [_mm512_setzero_ps(); NR];
    for dk in 0..d / 32 {
        let mut t = [V::splat(0.0); W];
        for (x, &r) in t.iter_mut().zip(rows.iter()) {
            *x = Avx512(_mm512_loadu_ps(r.add(64 * dk) as *const f32));
        }
        V::transpose(&mut t); // t[i] = dimension pair 16 dk + i of the 16 keys
        for i in (0..W).step_by(2) {
            let k0: __m512bh = std::mem::transmute(t[i].0);
            let k1: __m512bh = std::mem::transmute(t[i + 1].0);
            let p = 16 * dk + i;
            for x in 0..NR {
                let q0: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*q.add(x * dp + p) as i32));
                let q1: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*q.add(x * dp + p + 1) as i32));
                s0[x] = _mm512_dpbf16_ps(s0[x], q0, k0);
                s1[x] = _mm512_dpbf16_ps(s1[x], q1, k1);
            }
        }
    }
    for x in 0..NR {
        out[x] = _mm512_mul_ps(_mm512_add_ps(s0[x], s1[x]), scale);
    }
}

/// Pass 2 of a segment's `tiles` (kept, in key order) for the task's `nh` KV heads from
/// `h0` (`g` rows each, head dim `d`): per row the segment's max, the running max, sum and
/// accumulator rescaled once if it rose; then per tile and head `exp` against it and P.V on V
/// read in place (bf16: `attend::two_pass_flush`'s arithmetic, in its order per head: the
/// heads' accumulators and sums are apart, so tiles outer changes no bit). `runs`: a full bf16
/// tile's V rows are one address run (prefetched `V_AHEAD` tiles on); int8 / fp8 tiles' V rows
/// are prefetched per head `QV_AHEAD` tiles on. `vsc`: int8, the kept tiles' V scales
/// (`W` per tile and head); `pb`: room for P of `g` rows (`g` `W` floats).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn flush<const F: u8, const S: usize>(
    c: &Call,
    tiles: &[Tile],
    (s, vsc): (*const f32, *const f32),
    (h0, nh, g, d): (usize, usize, usize, usize),
    (m, l, acc): (*mut f32, *mut f32, *mut f32),
    (pb, rsum): (*mut u32, *mut f32),
    zero_row: *const u8,
    runs: bool,
) {
    for i in 0..nh {
        let hq0 = i * g;
        let acch = acc.add(hq0 * d);
        for r in 0..g {
            let mut vm = _mm512_set1_ps(f32::NEG_INFINITY);
            for t in 0..tiles.len() {
                vm = _mm512_max_ps(vm, _mm512_load_ps(s.add(((t * nh + i) * g + r) * W)));
            }
            let m_old = *m.add(hq0 + r);
            let m_new = m_old.max(Avx512::<true>(vm).hmax());
            if m_new > m_old && m_old != f32::NEG_INFINITY {
                let alpha = (m_old - m_new).exp();
                *l.add(hq0 + r) *= alpha;
                let a = _mm512_set1_ps(alpha);
                for cc in (0..d).step_by(W) {
                    let pa = acch.add(r * d + cc);
                    _mm512_storeu_ps(pa, _mm512_mul_ps(_mm512_loadu_ps(pa), a));
                }
            }
            *m.add(hq0 + r) = m_new;
        }
    }
    // per tile, every head (bf16: a full tile's V rows, a contiguous run over the heads, are read
    // in address order; the run `V_AHEAD` tiles on is prefetched a head's share at a time)
    let head0 = c.kv.add(h0 * c.stride_head + c.v_offset);
    let rows = nh * g;
    std::ptr::write_bytes(rsum, 0, rows * W);
    let run_lines = W * c.stride_tok / 64;
    if F == 1 && runs {
        for tile in tiles.iter().take(V_AHEAD).filter(|t| t.one_block) {
            let v = c.kv.add(tile.off[0] + c.v_offset);
            for ln in 0..run_lines {
                _mm_prefetch::<_MM_HINT_T1>(v.add(64 * ln) as *const i8);
            }
        }
    }
    let row_bytes = c.head_dim * if F == 1 { 2 } else { 1 };
    if F == 3 {
        for tile in tiles.iter().take(QV_AHEAD).filter(|t| t.one_block) {
            for i in 0..nh {
                prefetch_rows::<S>(head0.add(i * c.stride_head + tile.off[0]), c, row_bytes);
            }
        }
    }
    let fp8_pre = _mm512_set1_ps((2f32).powi(FP8_PRE));
    for (t, tile) in tiles.iter().enumerate() {
        let pf = tiles
            .get(t + V_AHEAD)
            .filter(|x| F == 1 && runs && x.one_block)
            .map(|x| c.kv.add(x.off[0] + c.v_offset));
        let qpf = tiles
            .get(t + QV_AHEAD)
            .filter(|x| F == 3 && x.one_block)
            .map(|x| head0.add(x.off[0]));
        for i in 0..nh {
            if let Some(v) = pf {
                for ln in i * run_lines / nh..(i + 1) * run_lines / nh {
                    _mm_prefetch::<_MM_HINT_T1>(v.add(64 * ln) as *const i8);
                }
            }
            if let Some(v) = qpf {
                prefetch_rows::<S>(v.add(i * c.stride_head), c, row_bytes);
            }
            let hq0 = i * g;
            let acch = acc.add(hq0 * d);
            let vhead = head0.add(i * c.stride_head);
            let vs = vsc.wrapping_add((t * nh + i) * W);
            for r in 0..g {
                // a row that has seen no key keeps m = -inf, l = 0 and a zero accumulator
                let mr = *m.add(hq0 + r);
                let neg_m = _mm512_set1_ps(if mr == f32::NEG_INFINITY { 0.0 } else { -mr });
                let x = _mm512_load_ps(s.add(((t * nh + i) * g + r) * W));
                let mut e = V::exp_softmax(Avx512(_mm512_add_ps(x, neg_m)));
                if tile.mk != u16::MAX {
                    e = e.select(tile.mk, V::splat(0.0));
                }
                let rp = rsum.add((hq0 + r) * W);
                _mm512_store_ps(rp, _mm512_add_ps(_mm512_load_ps(rp), e.0));
                match F {
                    // int8: P times the keys' V scales, as floats (`vnni::pv` quantizes them)
                    3 => _mm512_storeu_ps(
                        (pb as *mut f32).add(r * W),
                        _mm512_mul_ps(e.0, _mm512_load_ps(vs)),
                    ),
                    // fp8: V's codes are read 2^bias too small (`vnni::fp8_words`)
                    4 | 5 => Avx512::<true>(_mm512_mul_ps(e.0, fp8_pre))
                        .store_bf16_pairs(pb.add(r * (W / 2))),
                    _ => e.store_bf16_pairs(pb.add(r * (W / 2))),
                }
            }
            if tile.one_block {
                let v = Strided::<S> {
                    base: vhead.add(tile.off[0]),
                    stride: c.stride_tok,
                };
                match F {
                    1 => match g {
                        1 => pv_pairs_rows::<1, _>(acch, pb, d, &v, W / 2),
                        2 => pv_pairs_rows::<2, _>(acch, pb, d, &v, W / 2),
                        3 => pv_pairs_rows::<3, _>(acch, pb, d, &v, W / 2),
                        _ => pv_pairs_rows::<4, _>(acch, pb, d, &v, W / 2),
                    },
                    _ => pv_quant::<F, _>(acch, pb, d, g, &v, W),
                }
            } else {
                let mut vrow = [zero_row; W];
                for (j, x) in vrow.iter_mut().enumerate() {
                    if tile.real >> j & 1 != 0 {
                        *x = vhead.add(tile.off[j]);
                    }
                }
                let nk = W - tile.real.leading_zeros() as usize;
                let njp = nk.div_ceil(2);
                match F {
                    1 => match g {
                        1 => V::pv_pairs_direct::<1>(acch, pb, d, &vrow, njp),
                        2 => V::pv_pairs_direct::<2>(acch, pb, d, &vrow, njp),
                        3 => V::pv_pairs_direct::<3>(acch, pb, d, &vrow, njp),
                        _ => V::pv_pairs_direct::<4>(acch, pb, d, &vrow, njp),
                    },
                    _ => pv_quant::<F, _>(acch, pb, d, g, &vrow, nk),
                }
            }
        }
    }
    for r in 0..rows {
        *l.add(r) += Avx512::<true>(_mm512_load_ps(rsum.add(r * W))).hsum();
    }
}

/// int8 / fp8 P.V of `g` rows (`acc` rows `d` apart) over the first `nk` keys of `v`: int8 P
/// as floats (`W` apart, times the V scales), in groups of 4 keys and up to `vnni::NR_MAX`
/// rows a call; fp8 P as bf16 pairs (`W / 2` dwords apart).
#[inline(always)]
unsafe fn pv_quant<const F: u8, R: Rows>(
    acc: *mut f32,
    pb: *const u32,
    d: usize,
    g: usize,
    v: &R,
    nk: usize,
) {
    if F == 3 {
        let mut r = 0;
        while r < g {
            let nr = (g - r).min(vnni::NR_MAX);
            let p = (pb as *const f32).add(r * W);
            vnni::pv(acc.add(r * d), p, d, nr, v, nk.div_ceil(4));
            r += nr;
        }
    } else {
        vnni::fp8_pv::<F, _>(acc, pb, d, g, v, nk.div_ceil(2));
    }
}

/// Prefetch the 16 rows of `row_bytes` from `p`, `S` bytes apart (`c.stride_tok` for `S` = 0),
/// into L2.
#[inline(always)]
unsafe fn prefetch_rows<const S: usize>(p: *const u8, c: &Call, row_bytes: usize) {
    let stride = if S != 0 { S } else { c.stride_tok };
    for j in 0..W {
        prefetch_row(p.add(j * stride), row_bytes);
    }
}

/// One bf16 decode item (`attend::run_item`'s contract: the output rows, or the partial when
/// the item is a split) for KV heads `heads`.
///
/// # Safety
/// `eligible::<1>(c, 1, g)`, a bf16 cache, AVX-512 BF16 on this CPU; `c` describes live memory.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")]
pub unsafe fn run(
    c: &Call,
    item: usize,
    heads: (usize, usize),
    next: Option<(usize, (usize, usize))>,
) {
    run_impl::<1, 0>(c, item, heads, next)
}

/// One int8 (`F` = 3) or fp8 (4, 5) decode item, as `run`; inlined into `attend::run_item`'s
/// VNNI (int8) and VBMI (fp8) instances, whose target features it needs. A row stride of 64
/// or 128 bytes (head dim 64 or 128: these caches keep a head's rows of a block together) is
/// compiled in (`run_impl`'s `S`, `Strided<S>`). Read at run time, it left the compiler keeping
/// each tile's row offsets (K, V, prefetches) in stack slots, reloaded per tile: on a Zen 4, 8 x
/// 2K decode (warm, 1 thread) took 0.736 ms for fp8 and 0.598 for int8, against 0.528 and
/// 0.487 compiled in.
///
/// # Safety
/// `eligible::<F>(c, 1, g)`, a cache of format `F`, AVX-512 BF16 and VNNI (and VBMI for fp8)
/// enabled in the caller; `c` describes live memory.
#[inline(always)]
pub unsafe fn run_quant<const F: u8>(
    c: &Call,
    item: usize,
    heads: (usize, usize),
    next: Option<(usize, (usize, usize))>,
) {
    match c.stride_tok {
        64 => run_impl::<F, 64>(c, item, heads, next),
        128 => run_impl::<F, 128>(c, item, heads, next),
        _ => run_impl::<F, 0>(c, item, heads, next),
    }
}

/// int8: the K and V scales of the tile's keys in head `hh` (its first key at block-table index
/// `bi`, token `t0`; zero for keys that are not real).
#[inline(always)]
unsafe fn int8_scales(
    c: &Call,
    table: *const i64,
    (bi, t0): (usize, usize),
    tk: &TileKeys,
    n: usize,
    hh: usize,
) -> (__m512, __m512) {
    let seg = c.kv.add(hh * c.stride_head + c.scale_offset);
    let bs = c.block_size;
    if tk.one_block {
        let sp = seg.add(*table.add(bi) as usize * c.stride_block + 2 * t0);
        let ks = _mm512_cvtph_ps(_mm256_loadu_si256(sp as *const __m256i));
        let vs = _mm512_cvtph_ps(_mm256_loadu_si256(sp.add(2 * bs) as *const __m256i));
        return (ks, vs);
    }
    let (mut ks, mut vs) = ([0u16; W], [0u16; W]);
    let (mut b, mut t) = (bi, t0);
    for j in 0..n {
        if tk.real >> j & 1 != 0 {
            let sp = seg.add(*table.add(b) as usize * c.stride_block + 2 * t) as *const u16;
            ks[j] = sp.read_unaligned();
            vs[j] = sp.add(bs).read_unaligned();
        }
        t += 1;
        if t == bs {
            t = 0;
            b += 1;
        }
    }
    (
        _mm512_cvtph_ps(_mm256_loadu_si256(ks.as_ptr() as *const __m256i)),
        _mm512_cvtph_ps(_mm256_loadu_si256(vs.as_ptr() as *const __m256i)),
    )
}

#[inline(always)]
unsafe fn run_impl<const F: u8, const S: usize>(
    c: &Call,
    item: usize,
    heads: (usize, usize),
    next: Option<(usize, (usize, usize))>,
) {
    let w = std::slice::from_raw_parts(c.work.add(6 * item), 6);
    let (req, tok0) = (w[0] as usize, w[1] as usize);
    let (key_lo, key_hi, part) = (w[3], w[4], w[5]);
    let d = c.head_dim;
    let g = c.num_q_heads / c.num_kv_heads;
    let (h0, h1) = heads;
    let nh = h1 - h0;
    let rows = nh * g;
    let int8 = F == 3;
    // scratch (floats): scores, query pairs (int8: hi and lo codes, a float row and the
    // rows' `quantize_q` meta), accumulators, max, sums, P, int8 V scales, a zero row
    let (s_n, acc_n) = (SEG * rows * W, rows * d);
    let q_n = if int8 {
        rows * d / 2 + d + 3 * rows
    } else {
        rows * d / 2
    };
    let vsc_n = if int8 { SEG * nh * W } else { 0 };
    let need = s_n + q_n + acc_n + 2 * rows + g * W + rows * W + vsc_n + d + 9 * 16; // 9 parts
    let mut sc = Scratch::new(need);
    let mut take = |n: usize| sc.take(n);
    let s = take(s_n);
    let qp = take(q_n) as *mut u32;
    let acc = take(acc_n);
    let m = take(rows);
    let l = take(rows);
    let pb = take(g * W) as *mut u32;
    let rsum = take(rows * W);
    let vsc = take(vsc_n);
    let zero = take(d);
    std::ptr::write_bytes(zero, 0, d);
    std::ptr::write_bytes(acc, 0, acc_n);
    std::ptr::write_bytes(l, 0, rows);
    for r in 0..rows {
        *m.add(r) = f32::NEG_INFINITY;
    }
    let zero_row = zero as *const u8;
    // int8 query rows: `vnni::quantize_q`'s hi and lo codes (`rows * d` bytes each) and meta
    let (q8h, q8l) = (qp as *mut i8, (qp as *mut i8).add(rows * d));
    let qf = (qp as *mut f32).add(rows * d / 2);
    let qmeta = qf.add(d);
    let fp8_pre = (2f32).powi(FP8_PRE);
    for i in 0..nh {
        for r in 0..g {
            let x = i * g + r;
            let row =
                c.q.add((tok0 * c.q_stride_tok + ((h0 + i) * g + r) * c.q_stride_head) * 2)
                    as *const u16;
            match F {
                1 => std::ptr::copy_nonoverlapping(row as *const u32, qp.add(x * d / 2), d / 2),
                3 => {
                    for e in (0..d).step_by(W) {
                        V::load_bf16(row.add(e))
                            .mul(V::splat(c.scale))
                            .store(qf.add(e));
                    }
                    let qr = std::slice::from_raw_parts(qf, d);
                    let meta = vnni::quantize_q_avx512(
                        qr,
                        std::slice::from_raw_parts_mut(q8h.add(x * d), d),
                        std::slice::from_raw_parts_mut(q8l.add(x * d), d),
                    );
                    std::ptr::copy_nonoverlapping(meta.as_ptr(), qmeta.add(3 * x), 3);
                }
                _ => {
                    // times 2^FP8_PRE: exact, a power of two (`vnni::fp8_qk`)
                    let dst = qp.add(x * d / 2) as *mut u16;
                    for e in 0..d {
                        let y = crate::simd::bf16_to_f32(*row.add(e)) * fp8_pre;
                        *dst.add(e) = (y.to_bits() >> 16) as u16;
                    }
                }
            }
        }
    }
    // fp8: the per-head K scales and the codes' 2^bias folded into the scores' scale
    let fp8_post = (2f32).powi(fp8_bias(F) - FP8_PRE);
    let fp8_scale = |i: usize, kv: usize| {
        if c.fp8_scale.is_null() {
            1.0
        } else {
            *c.fp8_scale.add(kv * c.num_kv_heads + h0 + i)
        }
    };

    let seq_len = *c.seq_lens.add(req);
    let q_len = *c.qsl.add(req + 1) - *c.qsl.add(req);
    let qpos = seq_len - q_len + (tok0 as i64 - *c.qsl.add(req));
    let table = c.table.add(req * c.table_stride);
    let bs = c.block_size;
    let row_bytes = d * if F == 1 { 2 } else { 1 };
    let scale = _mm512_set1_ps(c.scale);
    let cap = c.soft_cap;
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let (mut blk, mut t) = ((key_lo / bs as i64) as usize, (key_lo % bs as i64) as usize);
    // Prefetches in pass 1: the tile `ahead` keys on, its block found by a walker of its own (no
    // division per tile). bf16: a full one-block tile of a task over every KV head is one
    // address run of K rows (a token's heads are adjacent), a head's share of its lines
    // prefetched at each head (V's run in pass 2); any other tile's K and V rows go through
    // `prefetch_keys`. int8 / fp8: a full one-block tile's K rows (and int8 scales) of each
    // head at that head (V's in pass 2), any other through `prefetch_keys`.
    let runs = if F == 1 {
        h0 == 0 && h1 == c.num_kv_heads && c.stride_tok == nh * c.stride_head
    } else {
        true
    };
    let ahead = if F != 1 {
        (Q_AHEAD * W) as i64
    } else if runs {
        (RUN_AHEAD * W) as i64
    } else {
        keys_ahead(nh)
    };
    let run_lines = W * c.stride_tok / 64;
    prefetch_keys(
        c,
        table,
        key_lo,
        (key_lo + ahead).min(key_hi),
        heads,
        row_bytes,
        int8,
        key_lo,
    );
    let pk0 = key_lo + ahead;
    let (mut pblk, mut pt) = ((pk0 / bs as i64) as usize, (pk0 % bs as i64) as usize);
    // the task this thread runs next: its first keys prefetched over the last tiles of pass 1
    let next = next.filter(|_| c.prefetch_next).map(|(it, nh)| {
        let w = std::slice::from_raw_parts(c.work.add(6 * it), 6);
        (c.table.add(w[0] as usize * c.table_stride), w[3], w[4], nh)
    });
    let mut nx_key = next.map_or(0, |n| n.1);

    let mut tiles = [const { std::mem::MaybeUninit::<Tile>::uninit() }; SEG];
    let mut kept = 0;
    let mut k0 = key_lo;
    while k0 < key_hi {
        let n = (key_hi - k0).min(W as i64) as usize;
        // the prefetch tile: keys k0 + ahead ..
        let pk = k0 + ahead;
        let pf_run = if pk < key_hi && runs && (key_hi - pk) >= W as i64 && pt + W <= bs {
            let b = *table.add(pblk);
            if b == 0 && c.released {
                None
            } else {
                Some(c.kv.add(b as usize * c.stride_block + pt * c.stride_tok))
            }
        } else {
            None
        };
        if pf_run.is_none() && pk < key_hi {
            let end = (pk + W as i64).min(key_hi);
            prefetch_keys(c, table, pk, end, heads, row_bytes, int8, key_lo);
        }
        // past the item's last keys: the first keys of the task this thread runs next (as the
        // tile loop: over pass 1's last tiles, so that they arrive during pass 2)
        if let Some((ntable, nlo, nhi, nheads)) = next {
            let want = nlo + (k0 + W as i64 + ahead - key_hi).min(nhi - nlo);
            if nx_key < want {
                prefetch_keys(c, ntable, nx_key, want, nheads, row_bytes, int8, nlo);
                nx_key = want;
            }
        }
        // int8: the prefetch tile's K and V scales, from its block's first head
        let pf_scales = pf_run
            .filter(|_| int8)
            .map(|kb| kb.sub(pt * c.stride_tok).add(c.scale_offset + 2 * pt));
        pt += W;
        while pt >= bs {
            pt -= bs;
            pblk += 1;
        }
        let at = (blk, t);
        let tk = tile_keys(c, table, &mut blk, &mut t, n);
        let mk = key_mask(qpos, k0, c.window) & tk.real;
        if mk != 0 {
            tiles[kept].write(Tile {
                mk,
                real: tk.real,
                one_block: tk.one_block,
                off: tk.off,
            });
        }
        for i in 0..nh {
            if let Some(kb) = pf_run {
                if F == 1 {
                    // lines [i, i + 1) / nh of the run, K's and V's
                    let (a, b) = (i * run_lines / nh, (i + 1) * run_lines / nh);
                    for ln in a..b {
                        _mm_prefetch::<_MM_HINT_T1>(kb.add(64 * ln) as *const i8);
                    }
                } else {
                    // this head's K rows (int8: and the tile's scales)
                    prefetch_rows::<S>(kb.add((h0 + i) * c.stride_head), c, row_bytes);
                    if F != 3 {
                        // fp8: and its V rows (`Q_AHEAD`)
                        let vb = kb.add((h0 + i) * c.stride_head + c.v_offset);
                        prefetch_rows::<S>(vb, c, row_bytes);
                    }
                    if let Some(sp) = pf_scales {
                        let sp = sp.add((h0 + i) * c.stride_head);
                        _mm_prefetch::<_MM_HINT_T1>(sp as *const i8);
                        _mm_prefetch::<_MM_HINT_T1>(sp.add(2 * bs) as *const i8);
                    }
                }
            }
            if mk == 0 {
                continue;
            }
            let head = c.kv.add((h0 + i) * c.stride_head);
            let mut krow = [zero_row; W];
            if tk.one_block {
                let r0 = head.add(tk.off[0]);
                for (j, x) in krow.iter_mut().enumerate() {
                    *x = r0.add(j * if S != 0 { S } else { c.stride_tok });
                }
            } else {
                for (j, x) in krow.iter_mut().enumerate() {
                    if tk.real >> j & 1 != 0 {
                        *x = head.add(tk.off[j]);
                    }
                }
            }
            let sd = s.add((kept * nh + i) * g * W);
            let mut sv = [ninf; 4];
            let pr = pb as *mut f32; // int8 / fp8 scores, before their soft-cap and mask
            let mut ks = _mm512_set1_ps(1.0);
            match F {
                1 => {
                    let q = qp.add(i * g * d / 2) as *const u32;
                    match g {
                        1 => scores::<1>(q, d, &krow, scale, &mut sv),
                        2 => scores::<2>(q, d, &krow, scale, &mut sv),
                        3 => scores::<3>(q, d, &krow, scale, &mut sv),
                        _ => scores::<4>(q, d, &krow, scale, &mut sv),
                    }
                }
                3 => {
                    let (kss, vss) = int8_scales(c, table, at, &tk, n, h0 + i);
                    ks = kss;
                    _mm512_store_ps(vsc.add((kept * nh + i) * W), vss);
                    let mut r = 0;
                    while r < g {
                        let nr = (g - r).min(vnni::NR_MAX);
                        let x = i * g + r;
                        let (qh, ql) = (q8h.add(x * d) as *const i8, q8l.add(x * d) as *const i8);
                        let meta = qmeta.add(3 * x) as *const f32;
                        if tk.one_block {
                            let k = Strided::<S> {
                                base: krow[0],
                                stride: c.stride_tok,
                            };
                            vnni::qk(&k, d, nr, qh, ql, meta, pr.add(r * W));
                        } else {
                            vnni::qk(&krow, d, nr, qh, ql, meta, pr.add(r * W));
                        }
                        r += nr;
                    }
                }
                _ => {
                    let q = qp.add(i * g * d / 2) as *const u32;
                    let qs = c.scale * fp8_scale(i, 0) * fp8_post;
                    if tk.one_block {
                        let k = Strided::<S> {
                            base: krow[0],
                            stride: c.stride_tok,
                        };
                        vnni::fp8_qk::<F, _>(&k, d, g, q, qs, pr);
                    } else {
                        vnni::fp8_qk::<F, _>(&krow, d, g, q, qs, pr);
                    }
                }
            }
            for r in 0..g {
                let mut x = if F == 1 {
                    Avx512::<true>(sv[r])
                } else {
                    Avx512::<true>(_mm512_mul_ps(_mm512_loadu_ps(pr.add(r * W)), ks))
                };
                if cap > 0.0 {
                    x = crate::simd::tanh(x.mul(V::splat(1.0 / cap))).mul(V::splat(cap));
                }
                if mk != u16::MAX {
                    x = x.select(mk, Avx512(ninf));
                }
                _mm512_store_ps(sd.add(r * W), x.0);
            }
        }
        if mk != 0 {
            kept += 1;
        }
        k0 += W as i64;
        if kept == SEG || (k0 >= key_hi && kept > 0) {
            // SAFETY: tiles[..kept] were written above, in this segment
            let kept_tiles = std::slice::from_raw_parts(tiles.as_ptr() as *const Tile, kept);
            flush::<F, S>(
                c,
                kept_tiles,
                (s, vsc),
                (h0, nh, g, d),
                (m, l, acc),
                (pb, rsum),
                zero_row,
                runs,
            );
            kept = 0;
        }
    }

    // out (or the split's partial): acc / l; int8's accumulator back to dimension order, fp8's
    // times 2^(bias - FP8_PRE) and (out only: `attend::merge` scales a partial) the V scale
    for i in 0..nh {
        let post = if part >= 0 { 1.0 } else { fp8_scale(i, 1) } * fp8_post;
        for r in 0..g {
            let x = i * g + r;
            let row = acc.add(x * d);
            if int8 {
                vnni::unpermute(std::slice::from_raw_parts_mut(row, d));
            } else if F != 1 {
                let sv = _mm512_set1_ps(post);
                for cc in (0..d).step_by(W) {
                    _mm512_storeu_ps(row.add(cc), _mm512_mul_ps(_mm512_loadu_ps(row.add(cc)), sv));
                }
            }
            write_row(c, (tok0, part), (h0 + i) * g + r, row, *m.add(x), *l.add(x));
        }
    }
}
