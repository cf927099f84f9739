//! Decode attention on AMX tiles: a bf16 cache, one query token per item, the GQA group's query
//! heads of a KV head (up to 16 rows) together; two passes over the item's key range per KV head.
//!
//!   pass 1   S[key][row] = K . Q^T    per 16 keys: K rows loaded as A tiles straight from the
//!            block (16 x 32 dims, the row stride apart; a tile across blocks or with missing
//!            keys is copied into scratch first), Q^T as B tiles (dimension pairs x rows, loaded
//!            once per head), one C tile stored as 16 x rows floats: the whole range's scores
//!            are one flat [key][row] array, no transpose of K.
//!   max      over the flat array, a vector per lane phase (lane i of vector v holds row
//!            (16 v + i) % rows), then per row
//!   pass 2   per 16 keys and row: the row's scores gathered, scaled (soft-capped), exp against
//!            the final max (no rescaling of the accumulator), P as bf16 pairs; P.V with V rows
//!            paired in registers straight from the cache (`Simd::pv_pairs_direct`).
//!
//! Compared with `attend::run_item`'s decode path (a 16 x 16 transpose of each K tile, one
//! broadcast dot product per row and dimension pair, an online softmax per tile), the scores
//! cost two tile products per 16 keys (head dim 64). Rounding: products in fp32 as `vdpbf16ps`,
//! summed in another order; the max is exact (two passes) rather than running.
//!
//! Invariants: the caller checked `eligible`; tile state is loaded on entry (`ldtilecfg`, shapes
//! for this item's row count) and released on exit. Masked keys (beyond the range, released
//! blocks, outside the window) get a score of -inf and a zero V row (a released block is never
//! read). Scratch is per thread, grown, never freed.
//!
//! The idea of taking the scores for a whole key range before the softmax is flash-decoding's
//! split (scores, then a single normalisation), applied within one work item.

#![cfg(target_arch = "x86_64")]

use crate::attend::{prefetch_keys, Call, Dt, PREFETCH_KEYS};
use crate::simd::{Avx512, Simd, W};
use std::arch::asm;
use std::arch::x86_64::*;

type V = Avx512<true>;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

thread_local! {
    /// A decode item's scratch (here and in `dec_lean.rs`; never two at once on a thread):
    /// scores, query pairs, a gathered K tile, P, per-row sums and accumulators. Grown.
    static BUF: std::cell::RefCell<Vec<Line>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// This thread's `BUF`, grown to at least `floats`, handed out in parts that each start on a
/// 64-byte line (`take`).
pub(crate) struct Scratch {
    buf: *mut f32,
    at: usize,
}

impl Scratch {
    pub(crate) fn new(floats: usize) -> Self {
        let buf = BUF.with(|cell| {
            let mut v = cell.borrow_mut();
            let lines = floats.div_ceil(16);
            if v.len() < lines {
                v.resize(lines, Line([0.0; 16]));
            }
            v.as_mut_ptr() as *mut f32
        });
        Scratch { buf, at: 0 }
    }
    /// The next `n` floats (the caller asked `new` for room for every part, each rounded up to
    /// 16 floats).
    pub(crate) unsafe fn take(&mut self, n: usize) -> *mut f32 {
        let p = self.buf.add(self.at);
        self.at += n.div_ceil(16) * 16;
        p
    }
}

/// The keys of the tile `k0 .. k0 + 16` that a query at `qpos` sees (causal, and within
/// `window` where it is positive), as lane bits.
#[inline(always)]
pub(crate) fn key_mask(qpos: i64, k0: i64, window: i64) -> u16 {
    let hi = (qpos - k0 + 1).clamp(0, W as i64) as u32;
    let lo = if window > 0 {
        (qpos - window + 1 - k0).clamp(0, W as i64) as u32
    } else {
        0
    };
    if hi > lo {
        (((1u64 << hi) - 1) & !((1u64 << lo) - 1)) as u16
    } else {
        0
    }
}

/// Whether `run` takes an item of `ntok` query tokens with `g` query heads per KV head: AMX on
/// (`c.amx`, `c.dec`: `KVCORE_NATIVE_ISA=nodec` turns this path off alone), bf16 queries, one token, up to 16 rows, head dim a multiple of 32 up to 128, no
/// ALiBi. (The cache format, bf16, is the caller's check.)
pub fn eligible(c: &Call, ntok: usize, g: usize) -> bool {
    c.amx
        && c.dec
        && c.dt == Dt::Bf16
        && ntok == 1
        && g <= 16
        && c.head_dim % 32 == 0
        && c.head_dim <= 128
        && c.alibi.is_null()
        && c.fp8_scale.is_null()
}

#[repr(C, align(64))]
struct Palette([u8; 64]);

/// Tiles: C 0-1 (16 keys x `g` floats, in turn per key tile), K 2-3 (16 keys x 32 dims, in turn
/// per 32 dims), Q^T 4-7 (16 dimension pairs x `g` rows, one per 32 dims).
fn palette(g: usize, nd: usize) -> Palette {
    let mut p = [0u8; 64];
    p[0] = 1;
    let mut set = |t: usize, colsb: usize| {
        p[16 + 2 * t] = colsb as u8;
        p[16 + 2 * t + 1] = (colsb >> 8) as u8;
        p[48 + t] = 16;
    };
    set(0, 4 * g);
    set(1, 4 * g);
    set(2, 64);
    set(3, 64);
    for dk in 0..nd {
        set(4 + dk, 4 * g);
    }
    Palette(p)
}

macro_rules! tl {
    ($n:literal, $p:expr, $s:expr) => {
        asm!(
            concat!("tileloadd tmm", $n, ", [{p} + {s} * 1]"),
            p = in(reg) $p,
            s = in(reg) $s,
            options(nostack, readonly)
        )
    };
}

/// Query tile `dk` (register 4 + dk).
#[inline(always)]
unsafe fn load_q(dk: usize, p: *const u8, s: usize) {
    match dk {
        0 => tl!("4", p, s),
        1 => tl!("5", p, s),
        2 => tl!("6", p, s),
        _ => tl!("7", p, s),
    }
}

/// K tile of dims 32 dk .. 32 dk + 32 (register 2 or 3 in turn).
#[inline(always)]
unsafe fn load_k(dk: usize, p: *const u8, s: usize) {
    if dk % 2 == 0 {
        tl!("2", p, s)
    } else {
        tl!("3", p, s)
    }
}

macro_rules! dp {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem)
        )
    };
}

/// C tile `cc` += K tile (of `dk`) . Q tile `dk`.
#[inline(always)]
unsafe fn dot(cc: usize, dk: usize) {
    match (cc, dk) {
        (0, 0) => dp!("0", "2", "4"),
        (0, 1) => dp!("0", "3", "5"),
        (0, 2) => dp!("0", "2", "6"),
        (0, _) => dp!("0", "3", "7"),
        (_, 0) => dp!("1", "2", "4"),
        (_, 1) => dp!("1", "3", "5"),
        (_, 2) => dp!("1", "2", "6"),
        (_, _) => dp!("1", "3", "7"),
    }
}

#[inline(always)]
unsafe fn zero_store(cc: usize, p: *mut f32, s: usize, store: bool) {
    match (cc, store) {
        (0, false) => asm!("tilezero tmm0", options(nostack, nomem)),
        (_, false) => asm!("tilezero tmm1", options(nostack, nomem)),
        (0, true) => asm!(
            "tilestored [{p} + {s} * 1], tmm0",
            p = in(reg) p,
            s = in(reg) s,
            options(nostack)
        ),
        (_, true) => asm!(
            "tilestored [{p} + {s} * 1], tmm1",
            p = in(reg) p,
            s = in(reg) s,
            options(nostack)
        ),
    }
}

/// The keys of one tile: which are real (in range, block not released), whether all 16 are real
/// and in one block, and each real key's byte offset of its row in head 0.
pub(crate) struct TileKeys {
    pub(crate) real: u16,
    pub(crate) one_block: bool,
    pub(crate) off: [usize; W],
}

/// Walk the block table from (`blk`, `t`) over the next `n` keys (as `attend::run_item`; also
/// `dec_lean.rs`).
#[inline(always)]
pub(crate) unsafe fn tile_keys(
    c: &Call,
    table: *const i64,
    blk: &mut usize,
    t: &mut usize,
    n: usize,
) -> TileKeys {
    let mut k = TileKeys {
        real: 0,
        one_block: false,
        off: [0; W],
    };
    let b0 = *table.add(*blk);
    if n == W && *t + W <= c.block_size && !(b0 == 0 && c.released) {
        let base = b0 as usize * c.stride_block + *t * c.stride_tok;
        for j in 0..W {
            k.off[j] = base + j * c.stride_tok;
        }
        k.real = u16::MAX;
        k.one_block = true;
        *t += W;
        if *t == c.block_size {
            *t = 0;
            *blk += 1;
        }
        return k;
    }
    for j in 0..n {
        let b = *table.add(*blk);
        let tok = *t;
        *t += 1;
        if *t == c.block_size {
            *t = 0;
            *blk += 1;
        }
        if b == 0 && c.released {
            continue;
        }
        k.off[j] = b as usize * c.stride_block + tok * c.stride_tok;
        k.real |= 1 << j;
    }
    k
}

/// One decode item (`attend::run_item`'s contract: output rows, or the partial when the item
/// is a split).
///
/// # Safety
/// `eligible(c, 1, g)` and a bf16 cache; AMX granted on this thread's process; `c` describes
/// live memory.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")]
pub unsafe fn run(
    c: &Call,
    item: usize,
    heads: (usize, usize),
    next: Option<(usize, (usize, usize))>,
) {
    let w = std::slice::from_raw_parts(c.work.add(6 * item), 6);
    let (req, tok0) = (w[0] as usize, w[1] as usize);
    let (key_lo, key_hi, part) = (w[3], w[4], w[5]);
    let d = c.head_dim;
    let hk = c.num_kv_heads;
    let g = c.num_q_heads / hk;
    let nd = d / 32;
    let nt = ((key_hi - key_lo).max(0) as usize).div_ceil(W);
    // scratch (floats): S, Q^T, a K tile, P, row sums, accumulators, a zero row, tile masks
    let (s_n, qt_n, kb_n, pb_n, lv_n, acc_n) =
        (nt * W * g, d / 2 * g, W * d / 2, g * W / 2, g * W, g * d);
    let need = s_n + qt_n + kb_n + pb_n + lv_n + acc_n + d + nt;
    let mut sc = Scratch::new(need + 8 * 16);
    let mut take = |n: usize| sc.take(n);
    let s = take(s_n);
    let qt = take(qt_n) as *mut u32;
    let kb = take(kb_n) as *mut u16;
    let pb = take(pb_n) as *mut u32;
    let lv = take(lv_n);
    let acc = take(acc_n);
    let zero = take(d);
    let tmask = take(nt) as *mut u16;
    std::ptr::write_bytes(zero, 0, d);
    let zero_row = zero as *const u8;

    let seq_len = *c.seq_lens.add(req);
    let q_len = *c.qsl.add(req + 1) - *c.qsl.add(req);
    let qpos = seq_len - q_len + (tok0 as i64 - *c.qsl.add(req));
    let table = c.table.add(req * c.table_stride);
    let bs = c.block_size;
    let row_bytes = d * 2;
    let pal = palette(g, nd);
    asm!("ldtilecfg [{}]", in(reg) pal.0.as_ptr(), options(nostack, readonly));
    let gidx = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(g as i32),
    );
    let next = next.filter(|_| c.prefetch_next).map(|(it, nh)| {
        let w = std::slice::from_raw_parts(c.work.add(6 * it), 6);
        (c.table.add(w[0] as usize * c.table_stride), w[3], w[4], nh)
    });
    let mut nx_key = next.map_or(0, |n| n.1);
    let scale = c.scale;
    let cap = c.soft_cap;

    for hh in heads.0..heads.1 {
        let head = c.kv.add(hh * c.stride_head);
        // Q^T: qt[dp][r] = dword dp of query row r
        for r in 0..g {
            let row =
                c.q.add((tok0 * c.q_stride_tok + (hh * g + r) * c.q_stride_head) * 2) as *const u32;
            for dpi in 0..d / 2 {
                *qt.add(dpi * g + r) = row.add(dpi).read_unaligned();
            }
        }
        for dk in 0..nd {
            load_q(dk, qt.add(dk * 16 * g) as *const u8, 4 * g);
        }

        // pass 1: scores
        let (mut blk, mut t) = ((key_lo / bs as i64) as usize, (key_lo % bs as i64) as usize);
        let mut pf_key = key_lo;
        let mut k0 = key_lo;
        let mut ti = 0;
        while k0 < key_hi {
            let n = (key_hi - k0).min(W as i64) as usize;
            let pf_end = (k0 + W as i64 + PREFETCH_KEYS).min(key_hi);
            if pf_key < pf_end {
                prefetch_keys(
                    c,
                    table,
                    pf_key,
                    pf_end,
                    (hh, hh + 1),
                    row_bytes,
                    false,
                    key_lo,
                );
                pf_key = pf_end;
            }
            let tk = tile_keys(c, table, &mut blk, &mut t, n);
            let mk = key_mask(qpos, k0, c.window) & tk.real;
            *tmask.add(ti) = mk;
            let sd = s.add(ti * W * g);
            if mk == 0 {
                for i in 0..W * g {
                    *sd.add(i) = f32::NEG_INFINITY;
                }
            } else {
                let (kp, ks) = if tk.one_block {
                    (head.add(tk.off[0]), c.stride_tok)
                } else {
                    for j in 0..W {
                        let dst = kb.add(j * d);
                        if tk.real >> j & 1 != 0 {
                            std::ptr::copy_nonoverlapping(
                                head.add(tk.off[j]) as *const u16,
                                dst,
                                d,
                            );
                        } else {
                            std::ptr::write_bytes(dst, 0, d);
                        }
                    }
                    (kb as *const u8, 2 * d)
                };
                let cc = ti % 2;
                zero_store(cc, sd, 0, false);
                for dk in 0..nd {
                    load_k(dk, kp.add(64 * dk), ks);
                    dot(cc, dk);
                }
                zero_store(cc, sd, 4 * g, true);
                if mk != u16::MAX {
                    for j in (0..W).filter(|j| mk >> j & 1 == 0) {
                        for r in 0..g {
                            *sd.add(j * g + r) = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            ti += 1;
            k0 += W as i64;
        }

        // the max per row: a vector per lane phase, then per row
        let period = g / gcd(g, W);
        let mut mx = [_mm512_set1_ps(f32::NEG_INFINITY); W];
        let mut ph = 0;
        for v in 0..nt * g {
            mx[ph] = _mm512_max_ps(mx[ph], _mm512_load_ps(s.add(v * W)));
            ph += 1;
            if ph == period {
                ph = 0;
            }
        }
        let mut m = [f32::NEG_INFINITY; W];
        for (p, v) in mx.iter().enumerate().take(period) {
            let mut lanes = [0f32; W];
            _mm512_storeu_ps(lanes.as_mut_ptr(), *v);
            for (i, x) in lanes.iter().enumerate() {
                let r = (p * W + i) % g;
                m[r] = m[r].max(*x);
            }
        }
        for x in m.iter_mut().take(g) {
            if *x != f32::NEG_INFINITY {
                *x *= scale;
                if cap > 0.0 {
                    *x = cap * (*x / cap).tanh();
                }
            }
        }

        // pass 2: P per tile and row, P.V
        std::ptr::write_bytes(acc, 0, g * d);
        std::ptr::write_bytes(lv, 0, g * W);
        let (mut blk, mut t) = ((key_lo / bs as i64) as usize, (key_lo % bs as i64) as usize);
        let mut vptr = [zero_row; W];
        let mut k0 = key_lo;
        let mut ti = 0;
        while k0 < key_hi {
            let n = (key_hi - k0).min(W as i64) as usize;
            if let (Some((ntable, nlo, nhi, nheads)), true) = (next, hh + 1 == heads.1) {
                // past the item's last keys: the first keys of the task this thread runs next
                // (spreading all its keys over this pass instead: 5-11 % slower cold)
                let want = nlo + (k0 + W as i64 + PREFETCH_KEYS - key_hi).min(nhi - nlo);
                if nx_key < want {
                    prefetch_keys(c, ntable, nx_key, want, nheads, row_bytes, false, nlo);
                    nx_key = want;
                }
            }
            let tk = tile_keys(c, table, &mut blk, &mut t, n);
            let mk = *tmask.add(ti);
            if mk != 0 {
                let sd = s.add(ti * W * g);
                for r in 0..g {
                    let x = _mm512_i32gather_ps::<4>(
                        _mm512_add_epi32(gidx, _mm512_set1_epi32(r as i32)),
                        sd as *const _,
                    );
                    let mut x = _mm512_mul_ps(x, _mm512_set1_ps(scale));
                    if cap > 0.0 {
                        x = crate::simd::tanh(Avx512::<true>(_mm512_mul_ps(
                            x,
                            _mm512_set1_ps(1.0 / cap),
                        )))
                        .mul(Avx512::<true>(_mm512_set1_ps(cap)))
                        .0;
                    }
                    let mr = if m[r] == f32::NEG_INFINITY { 0.0 } else { m[r] };
                    let e = Avx512::<true>(_mm512_sub_ps(x, _mm512_set1_ps(mr))).exp();
                    let e = _mm512_maskz_mov_ps(mk, e.0);
                    let l = lv.add(r * W);
                    _mm512_store_ps(l, _mm512_add_ps(_mm512_load_ps(l), e));
                    Avx512::<true>(e).store_bf16_pairs(pb.add(r * (W / 2)));
                }
                for j in 0..W {
                    vptr[j] = if tk.real >> j & 1 != 0 {
                        head.add(tk.off[j] + c.v_offset)
                    } else {
                        zero_row
                    };
                }
                let njp = (W - tk.real.leading_zeros() as usize).div_ceil(2);
                let mut r = 0;
                while r < g {
                    let (ar, pr) = (acc.add(r * d), pb.add(r * (W / 2)) as *const u32);
                    match g - r {
                        1 => V::pv_pairs_direct::<1>(ar, pr, d, &vptr, njp),
                        2 => V::pv_pairs_direct::<2>(ar, pr, d, &vptr, njp),
                        3 => V::pv_pairs_direct::<3>(ar, pr, d, &vptr, njp),
                        _ => V::pv_pairs_direct::<4>(ar, pr, d, &vptr, njp),
                    }
                    r += 4;
                }
            }
            ti += 1;
            k0 += W as i64;
        }

        // out (or the split's partial): acc / l
        for r in 0..g {
            let l = Avx512::<true>(_mm512_load_ps(lv.add(r * W))).hsum();
            write_row(c, (tok0, part), hh * g + r, acc.add(r * d), m[r], l);
        }
    }
    asm!("tilerelease", options(nostack, nomem));
}

/// Query head `qh`'s row of a one-token decode item (token `tok0`): `acc / l` into the bf16
/// output, or, where the item is a split (`part` >= 0), `(acc, m, l)` into its partial (the
/// layout `attend::merge` reads). Also `dec_lean.rs`'s.
#[inline(always)]
pub(crate) unsafe fn write_row(
    c: &Call,
    (tok0, part): (usize, i64),
    qh: usize,
    acc: *const f32,
    m: f32,
    l: f32,
) {
    let d = c.head_dim;
    if part >= 0 {
        let dst = c.partial.add(part as usize + qh * (d + 2));
        std::ptr::copy_nonoverlapping(acc, dst, d);
        *dst.add(d) = m;
        *dst.add(d + 1) = l;
        return;
    }
    let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
    let dst = c
        .out
        .add((tok0 * c.out_stride_tok + qh * c.out_stride_head) * 2) as *mut u16;
    for cc in (0..d).step_by(W) {
        Avx512::<true>(_mm512_mul_ps(
            _mm512_loadu_ps(acc.add(cc)),
            _mm512_set1_ps(inv),
        ))
        .store_bf16(dst.add(cc));
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
