//! Prefill tiles in blocks of 16 query rows, *transposed*: one vector holds one key's scores
//! for 16 rows, so the online softmax is vertical (no horizontal max or sum, one vector `exp`
//! for the 16 rescale factors) and the accumulator is kept as `acc_t[col][row]`.
//!
//!   scores   s[j][row] = sum_dp K[j] pair dp (broadcast) . q_t[dp][row]   (vdpbf16ps)
//!   softmax  m_new = max(m, max_j s[j]); e[j] = exp(s[j] - m_new); l = l * alpha + sum_j e[j]
//!   P.V      acc_t[c][row] += V pair (2 jp, 2 jp + 1)[c] (broadcast) . P pair jp [row]
//!
//! Needs AVX-512 BF16; `attend::run_item` takes this path for bf16 queries over a bf16 cache (or
//! an int8 / fp8 one converted exactly to bf16 first) when a KV head has >= `COLS_MIN_ROWS` rows.
//! Costs per block and tile: 2 x 16 x d / 2 bf16-pair dot products, 17 vector `exp` (for plain
//! bf16 scores `softmax`'s `exp2_p`: the scale folded into the FMA that subtracts the max,
//! 8 vector ops an exp), no transposes (the queries are laid out once per item, the accumulator
//! transposed back once).
//! P is rounded to bf16 before P.V, as on the row path and in flash attention.
//! `block_amx_d`: the same block with both products on AMX tiles (`amx.rs`), where granted.
//! `head_seg` (AMX, bf16 caches without ALiBi): the loops swapped, per pair of blocks over the
//! head's keys gathered once, in segments of `SEG_TILES` tiles: one max and one accumulator
//! rescale per segment, P.V with the accumulator held in tiles (no per-tile trip to memory).

#![cfg(target_arch = "x86_64")]

use crate::simd::{self, Avx512, W};
use std::arch::x86_64::*;

/// What varies per block and tile besides the data.
pub struct Tile<'a> {
    /// bf16 K rows of the tile, `d` apart (a zero row for keys that are not real)
    pub kb: *const u16,
    /// V tile as key pairs: `njp` rows of `d` dwords (`attend`'s `vp`)
    pub vp: *const u32,
    pub njp: usize,
    /// score scale (softmax scale x fp8 K scale)
    pub qs: f32,
    /// per key: the rows (bits) that see it; `None`: every row sees every key
    pub kmask: Option<&'a [u16; W]>,
    /// int8: per-key K and V scales
    pub kscale: Option<&'a [f32; W]>,
    pub vscale: Option<&'a [f32; W]>,
    pub soft_cap: f32,
    /// ALiBi: per-row slope and query position, and the tile's first key position
    pub alibi: Option<(&'a [f32; W], &'a [f32; W], f32)>,
}

#[inline(always)]
unsafe fn bh(x: __m512i) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(x)
}

/// The 16 vectors combined lane-wise by `op` (a max or a sum), as a balanced tree.
#[inline(always)]
unsafe fn tree(mut v: [__m512; W], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
    let mut w = W / 2;
    while w > 0 {
        for j in 0..w {
            v[j] = op(v[j], v[j + w]);
        }
        w /= 2;
    }
    v[0]
}

/// e^x for softmax arguments (x <= 0; -inf gives ~0): n = round(x log2 e), f = x - n ln 2 in
/// one step, e^f by the degree-5 Taylor polynomial, 2^n by `scalef`. Relative error < 1e-5, far
/// below the bf16 rounding P gets next (2^-9); 9 vector ops against the general `exp`'s 14,
/// which were ~10 % of a prefill tile.
#[inline(always)]
unsafe fn exp_p(x: __m512) -> __m512 {
    let x = _mm512_max_ps(x, _mm512_set1_ps(simd::EXP_RANGE.0));
    let n =
        _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
    let f = _mm512_fnmadd_ps(n, _mm512_set1_ps(std::f32::consts::LN_2), x);
    let mut p = _mm512_set1_ps(1.0 / 120.0);
    for c in [1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// 2^x for `x` in scaled softmax units (finite or NaN; a NaN lane comes out NaN and is masked
/// by the caller): n = round(x), 2^(x - n) by a degree-4 polynomial fitted for relative error
/// on [-1/2, 1/2] (2.7e-6 in fp32 arithmetic, as `exp_p`'s degree-5 Taylor), 2^n by `scalef`.
#[inline(always)]
unsafe fn exp2_p(x: __m512) -> __m512 {
    let n = _mm512_roundscale_ps::<0x08>(x);
    let f = _mm512_sub_ps(x, n);
    let mut p = _mm512_set1_ps(EXP2_POLY[4]);
    for c in [EXP2_POLY[3], EXP2_POLY[2], EXP2_POLY[1], EXP2_POLY[0]] {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// `exp2_p`'s coefficients, constant term first: a weighted least-squares fit on Chebyshev
/// nodes iterated towards the minimax relative error.
const EXP2_POLY: [f32; 5] = [
    0.999_999_3,
    0.693_121_8,
    0.240_247_44,
    0.055_917_86,
    0.009_570_1,
];

/// Sixteen fp32 lanes as bf16 (round to nearest even) in the low halves of 16 dwords.
#[inline(always)]
unsafe fn bf16_low(x: __m512) -> __m512i {
    let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(x));
    _mm512_cvtepu16_epi32(h)
}

/// Head dims this path is compiled for (a constant `D` unrolls every loop).
pub fn supports(d: usize) -> bool {
    matches!(d, 32 | 64 | 96 | 128 | 256)
}

/// `block` for head dim `d` (one of `supports`).
///
/// # Safety
/// As `block`.
#[inline(always)]
pub unsafe fn block_d(
    d: usize,
    t: &Tile,
    q_t: *const u32,
    acc_t: *mut f32,
    m: *mut f32,
    l: *mut f32,
) {
    match d {
        32 => block::<32>(t, q_t, acc_t, m, l),
        64 => block::<64>(t, q_t, acc_t, m, l),
        96 => block::<96>(t, q_t, acc_t, m, l),
        128 => block::<128>(t, q_t, acc_t, m, l),
        _ => block::<256>(t, q_t, acc_t, m, l),
    }
}

/// `block2` for head dim `d` (one of `supports`).
///
/// # Safety
/// As `block2`.
#[inline(always)]
pub unsafe fn block2_d(
    d: usize,
    t0: &Tile,
    t1: &Tile,
    q_t: *const u32,
    acc_t: *mut f32,
    m: *mut f32,
    l: *mut f32,
) {
    match d {
        32 => block2::<32>(t0, t1, q_t, acc_t, m, l),
        64 => block2::<64>(t0, t1, q_t, acc_t, m, l),
        96 => block2::<96>(t0, t1, q_t, acc_t, m, l),
        128 => block2::<128>(t0, t1, q_t, acc_t, m, l),
        _ => block2::<256>(t0, t1, q_t, acc_t, m, l),
    }
}

/// One block of 16 rows over one tile of 16 keys: scores, online softmax and P.V, updating
/// `acc_t` (`D` x 16), `m` and `l` (16 each) in place. `q_t`: `D / 2` x 16 dwords of query pairs.
///
/// # Safety
/// Every pointer covers the stated shapes; the CPU has AVX-512 F/BW/BF16.
#[inline(always)]
pub unsafe fn block<const D: usize>(
    t: &Tile,
    q_t: *const u32,
    acc_t: *mut f32,
    m: *mut f32,
    l: *mut f32,
) {
    // Scores: 16 independent accumulators, one per key.
    let mut s = [_mm512_setzero_ps(); W];
    let kb = t.kb as *const u32;
    for i in 0..D / 2 {
        let q = bh(_mm512_loadu_si512(q_t.add(i * W) as *const _));
        for j in 0..W {
            let k = bh(_mm512_set1_epi32(*kb.add(j * D / 2 + i) as i32));
            s[j] = _mm512_dpbf16_ps(s[j], k, q);
        }
    }
    let (pp, alpha, rescale) = softmax(t, s, m, l);
    // P.V on the transposed accumulator, 16 columns at a time.
    let mut cc = 0;
    while cc < D {
        let mut a = [_mm512_setzero_ps(); W];
        for c in 0..W {
            a[c] = _mm512_loadu_ps(acc_t.add((cc + c) * W));
            if rescale {
                a[c] = _mm512_mul_ps(a[c], alpha);
            }
        }
        for jp in 0..t.njp {
            let p = bh(pp[jp]);
            let v = t.vp.add(jp * D + cc);
            for c in 0..W {
                a[c] = _mm512_dpbf16_ps(a[c], bh(_mm512_set1_epi32(*v.add(c) as i32)), p);
            }
        }
        for c in 0..W {
            _mm512_storeu_ps(acc_t.add((cc + c) * W), a[c]);
        }
        cc += W;
    }
}

/// `block` for two adjacent blocks of rows over the same tile (`t0`, `t1`: their masks and
/// ALiBi positions; the data fields are the same): each broadcast K or V pair feeds both
/// blocks' dot products, half the broadcasts of two `block` calls (a broadcast per dot product
/// held `vdpbf16ps` to ~0.7 of its peak on a Zen 4; one per two runs at peak). Block 1's `q_t`,
/// `acc_t`, `m`, `l` follow block 0's (`D / 2 * 16` dwords, `D * 16` and 16 floats on).
///
/// # Safety
/// As `block`, for both blocks.
#[inline(always)]
pub unsafe fn block2<const D: usize>(
    t0: &Tile,
    t1: &Tile,
    q_t: *const u32,
    acc_t: *mut f32,
    m: *mut f32,
    l: *mut f32,
) {
    let kb = t0.kb as *const u32;
    let q1 = q_t.add(D / 2 * W);
    // Scores, eight keys of both blocks at a time (16 accumulators).
    let mut s = [[_mm512_setzero_ps(); W]; 2];
    for half in 0..2 {
        let mut a = [_mm512_setzero_ps(); W];
        for i in 0..D / 2 {
            let qa = bh(_mm512_loadu_si512(q_t.add(i * W) as *const _));
            let qb = bh(_mm512_loadu_si512(q1.add(i * W) as *const _));
            for j in 0..W / 2 {
                let key = half * W / 2 + j;
                let k = bh(_mm512_set1_epi32(*kb.add(key * D / 2 + i) as i32));
                a[j] = _mm512_dpbf16_ps(a[j], k, qa);
                a[W / 2 + j] = _mm512_dpbf16_ps(a[W / 2 + j], k, qb);
            }
        }
        for j in 0..W / 2 {
            s[0][half * W / 2 + j] = a[j];
            s[1][half * W / 2 + j] = a[W / 2 + j];
        }
    }
    let (pp0, alpha0, rescale0) = softmax(t0, s[0], m, l);
    let (pp1, alpha1, rescale1) = softmax(t1, s[1], m.add(W), l.add(W));
    // P.V, eight columns of both blocks at a time (16 accumulators).
    let acc1 = acc_t.add(D * W);
    let mut cc = 0;
    while cc < D {
        let mut a = [_mm512_setzero_ps(); W];
        for c in 0..W / 2 {
            a[c] = _mm512_loadu_ps(acc_t.add((cc + c) * W));
            a[W / 2 + c] = _mm512_loadu_ps(acc1.add((cc + c) * W));
            if rescale0 {
                a[c] = _mm512_mul_ps(a[c], alpha0);
            }
            if rescale1 {
                a[W / 2 + c] = _mm512_mul_ps(a[W / 2 + c], alpha1);
            }
        }
        for jp in 0..t0.njp {
            let (pa, pb) = (bh(pp0[jp]), bh(pp1[jp]));
            let v = t0.vp.add(jp * D + cc);
            for c in 0..W / 2 {
                let vv = bh(_mm512_set1_epi32(*v.add(c) as i32));
                a[c] = _mm512_dpbf16_ps(a[c], vv, pa);
                a[W / 2 + c] = _mm512_dpbf16_ps(a[W / 2 + c], vv, pb);
            }
        }
        for c in 0..W / 2 {
            _mm512_storeu_ps(acc_t.add((cc + c) * W), a[c]);
            _mm512_storeu_ps(acc1.add((cc + c) * W), a[W / 2 + c]);
        }
        cc += W / 2;
    }
}

/// `block` (`t1` None) or `block2` with both products on AMX tiles (`amx.rs`), for head dim
/// `d` (one of `supports`); `vt`: the tile's V^T (`amx::vt_from_pairs`). The softmax is
/// `block`'s, on the scores the tiles wrote.
///
/// # Safety
/// As `block2`; `amx::configure` ran on this thread.
#[inline(always)]
pub unsafe fn block_amx_d(
    d: usize,
    t0: &Tile,
    t1: Option<&Tile>,
    vt: *const u32,
    q_t: *const u32,
    acc_t: *mut f32,
    m: *mut f32,
    l: *mut f32,
) {
    macro_rules! go {
        ($d:literal) => {
            match t1 {
                Some(t1) => block_amx::<$d, 2>([t0, t1], vt, q_t, acc_t, m, l),
                None => block_amx::<$d, 1>([t0], vt, q_t, acc_t, m, l),
            }
        };
    }
    match d {
        32 => go!(32),
        64 => go!(64),
        96 => go!(96),
        128 => go!(128),
        _ => go!(256),
    }
}

/// `NB` adjacent blocks of 16 rows over one tile, the scores and P.V as tile products.
#[inline(always)]
unsafe fn block_amx<const D: usize, const NB: usize>(
    ts: [&Tile; NB],
    vt: *const u32,
    q_t: *const u32,
    acc_t: *mut f32,
    m: *mut f32,
    l: *mut f32,
) {
    #[repr(C, align(64))]
    struct Scores([f32; 2 * W * W]);
    #[repr(C, align(64))]
    struct Pairs([__m512i; W / 2]);
    let mut sb = std::mem::MaybeUninit::<Scores>::uninit();
    let sp = sb.as_mut_ptr() as *mut f32;
    crate::amx::scores::<D, NB>(ts[0].kb, q_t, sp);
    for b in 0..NB {
        let mut s = [_mm512_setzero_ps(); W];
        for (j, v) in s.iter_mut().enumerate() {
            *v = _mm512_load_ps(sp.add(b * W * W + j * W));
        }
        let (pp, alpha, rescale) = softmax(ts[b], s, m.add(b * W), l.add(b * W));
        let pb = Pairs(pp);
        let acc = acc_t.add(b * D * W);
        if rescale {
            for c in 0..D {
                let a = acc.add(c * W);
                _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), alpha));
            }
        }
        crate::amx::pv::<D>(acc, vt, pb.0.as_ptr() as *const u32);
    }
}

/// The online softmax of one block's scores `s` (one vector per key, lanes = rows): scale,
/// soft cap, ALiBi and masks applied, `m` and `l` updated in place; returns P as bf16 key pairs
/// (V scales applied), the rescale factor of the accumulator and whether any lane needs it.
#[inline(always)]
unsafe fn softmax(
    t: &Tile,
    mut s: [__m512; W],
    m: *mut f32,
    l: *mut f32,
) -> ([__m512i; W / 2], __m512, bool) {
    // Plain scores (no int8 scales, soft cap or ALiBi: the bf16 prefill): the max is taken on
    // the raw scores (m stays in scaled units: the scale is positive), and the scale and
    // log2 e go into the one FMA that subtracts it, then `exp2_p`: 8 vector ops per key and
    // row instead of 12 (FlashAttention-2's exp2 with the scale folded in). Masked keys are
    // -inf in the max and zeroed in P whatever NaN their exp made.
    let plain = t.kscale.is_none() && t.soft_cap <= 0.0 && t.alibi.is_none() && t.qs > 0.0;
    let qs = _mm512_set1_ps(t.qs);
    if !plain {
        for j in 0..W {
            s[j] = _mm512_mul_ps(s[j], qs);
        }
    }
    if let Some(ks) = t.kscale {
        for j in 0..W {
            s[j] = _mm512_mul_ps(s[j], _mm512_set1_ps(ks[j]));
        }
    }
    if t.soft_cap > 0.0 {
        for j in 0..W {
            let x = Avx512::<true>(_mm512_mul_ps(s[j], _mm512_set1_ps(1.0 / t.soft_cap)));
            s[j] = _mm512_mul_ps(simd::tanh(x).0, _mm512_set1_ps(t.soft_cap));
        }
    }
    if let Some((slope, qpos, k0)) = t.alibi {
        let (slope, qpos) = (
            _mm512_loadu_ps(slope.as_ptr()),
            _mm512_loadu_ps(qpos.as_ptr()),
        );
        for j in 0..W {
            let rel = _mm512_sub_ps(_mm512_set1_ps(k0 + j as f32), qpos);
            s[j] = _mm512_fmadd_ps(rel, slope, s[j]);
        }
    }
    if let Some(km) = t.kmask {
        for j in 0..W {
            s[j] = _mm512_mask_blend_ps(km[j], _mm512_set1_ps(f32::NEG_INFINITY), s[j]);
        }
    }
    // Online softmax, vertical: per row (lane) over the tile's keys.
    let m_old = _mm512_loadu_ps(m);
    let s_max = tree(s, |a, b| _mm512_max_ps(a, b));
    let mut e = [_mm512_setzero_ps(); W];
    // A row that has seen no key yet (m = -inf) gets alpha ~ 0 from the clamped exp; its
    // accumulator and sum are zero, so nothing is lost.
    let (m_new, alpha) = if plain {
        let m_new = _mm512_max_ps(m_old, _mm512_mul_ps(s_max, qs));
        let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
        let (c, mc) = (_mm512_mul_ps(qs, log2e), _mm512_mul_ps(m_new, log2e));
        for j in 0..W {
            e[j] = exp2_p(_mm512_fmsub_ps(s[j], c, mc));
        }
        let lo = _mm512_set1_ps(simd::EXP_RANGE.0 * std::f32::consts::LOG2_E);
        let d = _mm512_mul_ps(_mm512_sub_ps(m_old, m_new), log2e);
        (m_new, exp2_p(_mm512_max_ps(d, lo)))
    } else {
        let m_new = _mm512_max_ps(m_old, s_max);
        for j in 0..W {
            e[j] = exp_p(_mm512_sub_ps(s[j], m_new));
        }
        (m_new, exp_p(_mm512_sub_ps(m_old, m_new)))
    };
    if let Some(km) = t.kmask {
        for j in 0..W {
            e[j] = _mm512_maskz_mov_ps(km[j], e[j]);
        }
    }
    let sum = tree(e, |a, b| _mm512_add_ps(a, b));
    // rows that saw no key at all keep m = -inf and l = 0
    let seen = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(m_new, _mm512_set1_ps(f32::NEG_INFINITY));
    let alpha = _mm512_maskz_mov_ps(seen, alpha);
    let alpha = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m_old, m_new),
        alpha,
        _mm512_set1_ps(1.0),
    );
    _mm512_storeu_ps(m, m_new);
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, sum));
    let rescale = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(alpha, _mm512_set1_ps(1.0)) != 0;
    // P as bf16 pairs of keys (2 jp low, 2 jp + 1 high) per row.
    let mut pp = [_mm512_setzero_si512(); W / 2];
    if let Some(vs) = t.vscale {
        for j in 0..W {
            e[j] = _mm512_mul_ps(e[j], _mm512_set1_ps(vs[j]));
        }
    }
    for jp in 0..W / 2 {
        pp[jp] = _mm512_or_si512(
            bf16_low(e[2 * jp]),
            _mm512_slli_epi32::<16>(bf16_low(e[2 * jp + 1])),
        );
    }
    (pp, alpha, rescale)
}

/// The key mask (`masks[token]`, 16 bits) of each row of block `b`, a row being token
/// `row / g` (zero past `hrows`): the block's tokens are 16 consecutive ones from `b * 16 / g`.
///
/// # Safety
/// `masks` holds `b * 16 / g + 16` entries; the CPU has AVX-512 F/BW.
#[inline(always)]
pub unsafe fn lane_masks(masks: *const u16, b: usize, g: usize, hrows: usize) -> __m512i {
    let tk0 = b * W / g;
    let all = _mm512_cvtepu16_epi32(_mm256_loadu_si256(masks.add(tk0) as *const _));
    let rows = _mm512_add_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((b * W) as i32),
    );
    // token = floor(row / g), exact in fp32 for these small integers
    let tok = _mm512_cvttps_epi32(_mm512_div_ps(
        _mm512_add_ps(_mm512_cvtepi32_ps(rows), _mm512_set1_ps(0.5)),
        _mm512_set1_ps(g as f32),
    ));
    let idx = _mm512_sub_epi32(tok, _mm512_set1_epi32(tk0 as i32));
    let valid = _mm512_cmplt_epi32_mask(rows, _mm512_set1_epi32(hrows as i32));
    _mm512_maskz_permutexvar_epi32(valid, idx, all)
}

/// Per key `j`, the lanes (rows) whose mask has bit `j`; true when every lane sees every key.
///
/// # Safety
/// The CPU has AVX-512 F.
#[inline(always)]
pub unsafe fn key_masks(mv: __m512i, out: &mut [u16; W]) -> bool {
    if _mm512_cmpeq_epi32_mask(mv, _mm512_set1_epi32(0xffff)) == 0xffff {
        return true;
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = _mm512_test_epi32_mask(mv, _mm512_set1_epi32(1 << j));
    }
    false
}

/// Key tiles per segment of `head_seg` (256 keys: the scores of two blocks, 32 KiB, and their P
/// stay in L1; even, so that a segment's 32-key P.V chunks start on a tile pair).
pub const SEG_TILES: usize = 16;

/// One KV head of an item for `head_seg`: its key range gathered once (K rows and V^T) and
/// what decides which keys a row sees.
pub struct Seg<'a> {
    /// `[nt][16][D]` bf16 K rows: tile `t` holds keys `key_lo + 16 t ..` (zero rows for keys
    /// that are not real)
    pub kb: *const u16,
    /// `[nt.div_ceil(2)][D][16]` dwords: V^T of 32 keys as bf16 key pairs (tile `2 u` in dwords
    /// 0-7, tile `2 u + 1` in 8-15; zero for a missing last tile)
    pub vt: *const u32,
    /// per tile: its real keys (bits)
    pub tmask: &'a [u16],
    pub key_lo: i64,
    /// position of the item's first query token
    pub first_pos: i64,
    /// query heads per KV head (rows `r = token * g + head`)
    pub g: usize,
    /// real rows of the head (the last block may be padded)
    pub hrows: usize,
    pub window: i64,
    /// score scale
    pub qs: f32,
    pub soft_cap: f32,
}

/// `head_seg` for head dim `d` (one of `supports`).
///
/// # Safety
/// As `head_seg`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub unsafe fn head_seg_d(
    d: usize,
    s: &Seg,
    nblk: usize,
    q_t: *const u32,
    acc_t: *mut f32,
    m: *mut f32,
    l: *mut f32,
    sbuf: *mut f32,
    pbuf: *mut u32,
) {
    match d {
        32 => head_seg::<32>(s, nblk, q_t, acc_t, m, l, sbuf, pbuf),
        64 => head_seg::<64>(s, nblk, q_t, acc_t, m, l, sbuf, pbuf),
        96 => head_seg::<96>(s, nblk, q_t, acc_t, m, l, sbuf, pbuf),
        128 => head_seg::<128>(s, nblk, q_t, acc_t, m, l, sbuf, pbuf),
        _ => head_seg::<256>(s, nblk, q_t, acc_t, m, l, sbuf, pbuf),
    }
}

/// The transposed path on AMX with the loops swapped: per pair of 16-row blocks, the keys they
/// see in segments of up to `SEG_TILES` tiles: all the segment's scores (tile products), one
/// max per row, P for the whole segment, and its P.V with the accumulator held in tiles
/// (`amx::pv_seg`). The accumulator is rescaled once per segment instead of once per tile and
/// makes one trip to memory per segment instead of two per tile and block (PyTorch's CPU flash
/// attention blocks its keys the same way). Same `acc_t`, `m`, `l` layouts as `block_amx`;
/// masks: a key is seen by a row if real, at most its position and (window) within it.
///
/// # Safety
/// `amx::configure_full` ran on this thread; `q_t`, `acc_t`, `m`, `l` cover `nblk` blocks; `sbuf`
/// `SEG_TILES * 512` floats, `pbuf` `2 * SEG_TILES * 128` dwords; `s` as documented.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn head_seg<const D: usize>(
    s: &Seg,
    nblk: usize,
    q_t: *const u32,
    acc_t: *mut f32,
    m: *mut f32,
    l: *mut f32,
    sbuf: *mut f32,
    pbuf: *mut u32,
) {
    let nt = s.tmask.len();
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let qs = _mm512_set1_ps(s.qs);
    let mut b = 0;
    while b < nblk {
        let nb = (nblk - b).min(2);
        // each lane's query position, relative to key_lo (a padded lane copies the last row)
        let mut qpos = [[0i32; W]; 2];
        let (mut qmin, mut qmax) = ([i64::MAX; 2], [i64::MIN; 2]);
        for i in 0..nb {
            for lane in 0..W {
                let rl = ((b + i) * W + lane).min(s.hrows - 1);
                let p = s.first_pos + (rl / s.g) as i64 - s.key_lo;
                qpos[i][lane] = p as i32;
                qmin[i] = qmin[i].min(p);
                qmax[i] = qmax[i].max(p);
            }
        }
        let top = qmax[0].max(qmax[1]);
        let bottom = qmin[0].min(qmin[1]);
        let hi = (top + 1).min(16 * nt as i64); // keys past every row's position: unseen
        let lo = if s.window > 0 {
            (bottom - s.window + 1).max(0)
        } else {
            0
        };
        if lo >= hi {
            b += nb;
            continue;
        }
        let t_hi = (hi as usize).div_ceil(W);
        let mut t0 = (lo as usize / W) & !1;
        while t0 < t_hi {
            let t1 = (t0 + SEG_TILES).min(t_hi);
            let qt = q_t.add(b * D / 2 * W);
            for t in (t0..t1).filter(|_| D != 64 || nb == 1) {
                let out = sbuf.add((t - t0) * 2 * W * W);
                if nb == 2 {
                    crate::amx::scores::<D, 2>(s.kb.add(t * W * D), qt, out);
                } else {
                    crate::amx::scores::<D, 1>(s.kb.add(t * W * D), qt, out);
                }
            }
            if D == 64 && nb == 2 {
                crate::amx::scores_seg64(s.kb.add(t0 * W * D), qt, sbuf, t1 - t0);
            }
            for i in 0..nb {
                let qv = _mm512_loadu_si512(qpos[i].as_ptr() as *const _);
                let qlow = _mm512_sub_epi32(qv, _mm512_set1_epi32(s.window as i32));
                let (mi, li) = (m.add((b + i) * W), l.add((b + i) * W));
                let mut mx = ninf;
                for t in t0..t1 {
                    let sp = sbuf.add((t - t0) * 2 * W * W + i * W * W);
                    let k0 = (t * W) as i64;
                    let full = s.tmask[t] == u16::MAX
                        && k0 + W as i64 - 1 <= qmin[i]
                        && (s.window <= 0 || k0 > qmax[i] - s.window);
                    for j in 0..W {
                        let mut x = _mm512_mul_ps(_mm512_load_ps(sp.add(j * W)), qs);
                        if s.soft_cap > 0.0 {
                            let y = _mm512_mul_ps(x, _mm512_set1_ps(1.0 / s.soft_cap));
                            x = _mm512_mul_ps(
                                simd::tanh(Avx512::<true>(y)).0,
                                _mm512_set1_ps(s.soft_cap),
                            );
                        }
                        if !full {
                            let key = _mm512_set1_epi32((k0 + j as i64) as i32);
                            let mut vis = if s.tmask[t] >> j & 1 != 0 {
                                _mm512_cmple_epi32_mask(key, qv)
                            } else {
                                0
                            };
                            if s.window > 0 {
                                vis &= _mm512_cmpgt_epi32_mask(key, qlow);
                            }
                            x = _mm512_mask_blend_ps(vis, ninf, x);
                        }
                        _mm512_store_ps(sp.add(j * W), x);
                        mx = _mm512_max_ps(mx, x);
                    }
                }
                let m_old = _mm512_loadu_ps(mi);
                let m_new = _mm512_max_ps(m_old, mx);
                let seen = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(m_new, ninf);
                let alpha = _mm512_maskz_mov_ps(seen, exp_p(_mm512_sub_ps(m_old, m_new)));
                let alpha = _mm512_mask_blend_ps(
                    _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m_old, m_new),
                    alpha,
                    _mm512_set1_ps(1.0),
                );
                if _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(alpha, _mm512_set1_ps(1.0)) != 0 {
                    let acc = acc_t.add((b + i) * D * W);
                    for c in 0..D {
                        let a = acc.add(c * W);
                        _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), alpha));
                    }
                }
                let mut sum = _mm512_setzero_ps();
                let pb = pbuf.add(i * SEG_TILES * 8 * W);
                for t in t0..t1 {
                    let sp = sbuf.add((t - t0) * 2 * W * W + i * W * W);
                    let pt = pb.add((t - t0) * 8 * W);
                    for jp in 0..W / 2 {
                        let mut e = [_mm512_setzero_ps(); 2];
                        for (h, eh) in e.iter_mut().enumerate() {
                            let x = _mm512_load_ps(sp.add((2 * jp + h) * W));
                            let real = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(x, ninf);
                            *eh = _mm512_maskz_mov_ps(real, exp_p(_mm512_sub_ps(x, m_new)));
                        }
                        sum = _mm512_add_ps(sum, _mm512_add_ps(e[0], e[1]));
                        let pair = _mm512_or_si512(
                            bf16_low(e[0]),
                            _mm512_slli_epi32::<16>(bf16_low(e[1])),
                        );
                        _mm512_store_si512(pt.add(jp * W) as *mut _, pair);
                    }
                }
                if (t1 - t0) % 2 == 1 {
                    // the chunk's missing second tile: P zero (its V^T is zero too)
                    let pt = pb.add((t1 - t0) * 8 * W);
                    for jp in 0..W / 2 {
                        _mm512_store_si512(pt.add(jp * W) as *mut _, _mm512_setzero_si512());
                    }
                }
                _mm512_storeu_ps(mi, m_new);
                _mm512_storeu_ps(li, _mm512_fmadd_ps(_mm512_loadu_ps(li), alpha, sum));
            }
            let nch = (t1 - t0).div_ceil(2);
            for i in 0..nb {
                let pb = pbuf.add(i * SEG_TILES * 8 * W);
                let acc = acc_t.add((b + i) * D * W);
                crate::amx::pv_seg::<D>(acc, s.vt.add(t0 / 2 * D * W), pb, nch);
            }
            t0 = t1;
        }
        b += nb;
    }
}
