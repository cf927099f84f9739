//! Decode attention on AVX-512 BF16 without AMX tiles (Zen 4; AVX-512 Xeons with AMX off): a
//! bf16 cache, one query token per item, up to 4 query heads per KV head, every KV head of the
//! task in one pass over the item's blocks; two passes per segment of up to `SEG` kept key tiles.
//!
//!   pass 1   per 16 keys and KV head: each 32-dimension chunk of the 16 K rows loaded straight
//!            from the block, transposed 16 x 16 dwords in registers (dimension pairs x keys),
//!            one broadcast bf16-pair dot product per query row and pair; the scores scaled,
//!            soft-capped, masked and kept. K's lines `RUN_AHEAD` tiles on are prefetched a KV
//!            head's share at a time (a full tile's K rows are one address run).
//!   max      per row over the segment; the running max, sum and accumulator rescaled once if
//!            the max rose
//!   pass 2   per tile, then KV head: `exp` against the max, P in bf16 pairs, P.V on V rows
//!            paired in registers, a full one-block tile's rows addressed by their stride; V's
//!            lines `V_AHEAD` tiles on prefetched a head's share at a time.
//!
//! The arithmetic and its order are those of `attend::run_item`'s two-pass path (`two_pass`,
//! `two_pass_flush`), so the outputs are bit-identical to it (`KVCORE_NATIVE_ISA=tileloop` runs
//! that path, for A/B runs). What this file drops is that loop's bookkeeping: the transposed K
//! tile stored and reloaded by `qk_pairs`, per-tile key, V-address and key-position arrays, and a
//! block-table division per prefetch point (the bookkeeping was ~40 % of a decode tile there);
//! and V is prefetched for pass 2 in pass 2 (see `V_AHEAD`).
//!
//! Invariants: the caller checked `eligible` and holds a bf16 cache; a key outside the range,
//! the window or a released block scores -inf and is read as a zero row by P.V (a released
//! block is never read). Scratch per thread, grown, never freed. Costs per 16 keys and KV head
//! (head dim 64, `g` rows): 32 row loads and 128 shuffles, then 32 `g` dot products for the
//! scores; 32 loads, 32 permutes and 32 `g` dot products for P.V.
//!
//! Flash-decoding's split of the scores from one normalisation, within one work item.

#![cfg(target_arch = "x86_64")]

use crate::attend::{prefetch_keys, Call, Dt, PREFETCH_KEYS};
use crate::dec_amx::{key_mask, tile_keys, write_row, Scratch};
use crate::simd::{pv_pairs_rows, Avx512, Simd, W};
use crate::vnni::Strided;
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

/// Whether `run` takes an item of `ntok` query tokens with `g` query heads per KV head: the lean
/// path on (`c.lean`: not `onepass` nor `tileloop`), bf16 queries, one token, up to 4 rows per
/// KV head, head dim a multiple of 32, no ALiBi. (AVX-512 BF16 and the bf16 cache are the
/// caller's checks; AMX's decode, where granted, is tried first.)
pub fn eligible(c: &Call, ntok: usize, g: usize) -> bool {
    c.lean
        && c.dt == Dt::Bf16
        && ntok == 1
        && (1..=4).contains(&g)
        && c.head_dim % 32 == 0
        && c.alibi.is_null()
        && c.fp8_scale.is_null()
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
/// accumulator rescaled once if it rose; then per tile and head `exp` against it, P in bf16
/// pairs and P.V on V read in place (`attend::two_pass_flush`'s arithmetic, in its order per
/// head: the heads' accumulators and sums are apart, so tiles outer changes no bit). `runs`:
/// a full tile's V rows are one address run (prefetched `V_AHEAD` tiles on).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn flush(
    c: &Call,
    tiles: &[Tile],
    s: *const f32,
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
    // per tile, every head: a full tile's V rows, a contiguous run over the heads, are read in
    // address order; the run `V_AHEAD` tiles on is prefetched a head's share at a time
    let head0 = c.kv.add(h0 * c.stride_head + c.v_offset);
    let rows = nh * g;
    std::ptr::write_bytes(rsum, 0, rows * W);
    let run_lines = W * c.stride_tok / 64;
    if runs {
        for tile in tiles.iter().take(V_AHEAD).filter(|t| t.one_block) {
            let v = c.kv.add(tile.off[0] + c.v_offset);
            for ln in 0..run_lines {
                _mm_prefetch::<_MM_HINT_T1>(v.add(64 * ln) as *const i8);
            }
        }
    }
    for (t, tile) in tiles.iter().enumerate() {
        let pf = tiles
            .get(t + V_AHEAD)
            .filter(|x| runs && x.one_block)
            .map(|x| c.kv.add(x.off[0] + c.v_offset));
        for i in 0..nh {
            if let Some(v) = pf {
                for ln in i * run_lines / nh..(i + 1) * run_lines / nh {
                    _mm_prefetch::<_MM_HINT_T1>(v.add(64 * ln) as *const i8);
                }
            }
            let hq0 = i * g;
            let acch = acc.add(hq0 * d);
            let vhead = head0.add(i * c.stride_head);
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
                e.store_bf16_pairs(pb.add(r * (W / 2)));
            }
            if tile.one_block {
                let v = Strided {
                    base: vhead.add(tile.off[0]),
                    stride: c.stride_tok,
                };
                match g {
                    1 => pv_pairs_rows::<1, _>(acch, pb, d, &v, W / 2),
                    2 => pv_pairs_rows::<2, _>(acch, pb, d, &v, W / 2),
                    3 => pv_pairs_rows::<3, _>(acch, pb, d, &v, W / 2),
                    _ => pv_pairs_rows::<4, _>(acch, pb, d, &v, W / 2),
                }
            } else {
                let mut vrow = [zero_row; W];
                for (j, x) in vrow.iter_mut().enumerate() {
                    if tile.real >> j & 1 != 0 {
                        *x = vhead.add(tile.off[j]);
                    }
                }
                let njp = (W - tile.real.leading_zeros() as usize).div_ceil(2);
                match g {
                    1 => V::pv_pairs_direct::<1>(acch, pb, d, &vrow, njp),
                    2 => V::pv_pairs_direct::<2>(acch, pb, d, &vrow, njp),
                    3 => V::pv_pairs_direct::<3>(acch, pb, d, &vrow, njp),
                    _ => V::pv_pairs_direct::<4>(acch, pb, d, &vrow, njp),
                }
            }
        }
    }
    for r in 0..rows {
        *l.add(r) += Avx512::<true>(_mm512_load_ps(rsum.add(r * W))).hsum();
    }
}

/// One decode item (`attend::run_item`'s contract: the output rows, or the partial when the
/// item is a split) for KV heads `heads`.
///
/// # Safety
/// `eligible(c, 1, g)`, a bf16 cache, AVX-512 BF16 on this CPU; `c` describes live memory.
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
    let g = c.num_q_heads / c.num_kv_heads;
    let (h0, h1) = heads;
    let nh = h1 - h0;
    let rows = nh * g;
    // scratch (floats): scores, query pairs, accumulators, max, sums, P pairs, a zero row
    let (s_n, q_n, acc_n) = (SEG * rows * W, rows * d / 2, rows * d);
    let need = s_n + q_n + acc_n + 2 * rows + 4 * W / 2 + rows * W + d + 8 * 16; // 8 parts
    let mut sc = Scratch::new(need);
    let mut take = |n: usize| sc.take(n);
    let s = take(s_n);
    let qp = take(q_n) as *mut u32;
    let acc = take(acc_n);
    let m = take(rows);
    let l = take(rows);
    let pb = take(4 * W / 2) as *mut u32;
    let rsum = take(rows * W);
    let zero = take(d);
    std::ptr::write_bytes(zero, 0, d);
    std::ptr::write_bytes(acc, 0, acc_n);
    std::ptr::write_bytes(l, 0, rows);
    for r in 0..rows {
        *m.add(r) = f32::NEG_INFINITY;
    }
    let zero_row = zero as *const u8;
    for i in 0..nh {
        for r in 0..g {
            let row =
                c.q.add((tok0 * c.q_stride_tok + ((h0 + i) * g + r) * c.q_stride_head) * 2);
            std::ptr::copy_nonoverlapping(row as *const u32, qp.add((i * g + r) * d / 2), d / 2);
        }
    }

    let seq_len = *c.seq_lens.add(req);
    let q_len = *c.qsl.add(req + 1) - *c.qsl.add(req);
    let qpos = seq_len - q_len + (tok0 as i64 - *c.qsl.add(req));
    let table = c.table.add(req * c.table_stride);
    let bs = c.block_size;
    let row_bytes = 2 * d;
    let scale = _mm512_set1_ps(c.scale);
    let cap = c.soft_cap;
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let (mut blk, mut t) = ((key_lo / bs as i64) as usize, (key_lo % bs as i64) as usize);
    // Prefetches in pass 1: the tile `ahead` keys on, its block found by a walker of its own (no
    // division per tile). A full one-block tile of a task over every KV head is one address run
    // of K rows (a token's heads are adjacent), a head's share of its lines prefetched at each
    // head (V's run in pass 2); any other tile's K and V rows go through `prefetch_keys`.
    let runs = h0 == 0 && h1 == c.num_kv_heads && c.stride_tok == nh * c.stride_head;
    let ahead = if runs {
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
        false,
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
            prefetch_keys(c, table, pk, end, heads, row_bytes, false, key_lo);
        }
        // past the item's last keys: the first keys of the task this thread runs next (as the
        // tile loop: over pass 1's last tiles, so that they arrive during pass 2)
        if let Some((ntable, nlo, nhi, nheads)) = next {
            let want = nlo + (k0 + W as i64 + ahead - key_hi).min(nhi - nlo);
            if nx_key < want {
                prefetch_keys(c, ntable, nx_key, want, nheads, row_bytes, false, nlo);
                nx_key = want;
            }
        }
        pt += W;
        while pt >= bs {
            pt -= bs;
            pblk += 1;
        }
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
                // lines [i, i + 1) / nh of the run, K's and V's
                let (a, b) = (i * run_lines / nh, (i + 1) * run_lines / nh);
                for ln in a..b {
                    _mm_prefetch::<_MM_HINT_T1>(kb.add(64 * ln) as *const i8);
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
                    *x = r0.add(j * c.stride_tok);
                }
            } else {
                for (j, x) in krow.iter_mut().enumerate() {
                    if tk.real >> j & 1 != 0 {
                        *x = head.add(tk.off[j]);
                    }
                }
            }
            let q = qp.add(i * g * d / 2) as *const u32;
            let mut sv = [ninf; 4];
            match g {
                1 => scores::<1>(q, d, &krow, scale, &mut sv),
                2 => scores::<2>(q, d, &krow, scale, &mut sv),
                3 => scores::<3>(q, d, &krow, scale, &mut sv),
                _ => scores::<4>(q, d, &krow, scale, &mut sv),
            }
            let sd = s.add((kept * nh + i) * g * W);
            for (r, x) in sv.iter().enumerate().take(g) {
                let mut x = Avx512::<true>(*x);
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
            flush(
                c,
                kept_tiles,
                s,
                (h0, nh, g, d),
                (m, l, acc),
                (pb, rsum),
                zero_row,
                runs,
            );
            kept = 0;
        }
    }

    // out (or the split's partial): acc / l
    for i in 0..nh {
        for r in 0..g {
            let x = i * g + r;
            write_row(
                c,
                (tok0, part),
                (h0 + i) * g + r,
                acc.add(x * d),
                *m.add(x),
                *l.add(x),
            );
        }
    }
}
