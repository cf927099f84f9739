//! Paged attention of one work item: one request, one KV head, a run of query tokens, a key range.
//!
//! K and V are read in place through the block table, sixteen keys at a time (a *tile*; keys of a
//! tile may sit in different blocks: each key's row address is computed from its block-table
//! entry). All query heads of the KV head (the GQA group) and all the item's query tokens are the
//! rows of one online softmax in fp32, so each K and V row is read once per item::
//!
//!   rows r = i * G + g      (query token i of the item, query head h * G + g)
//!   tile     keys k0 .. k0+15 of [key_lo, key_hi)
//!   K tile   decoded to fp32 and transposed: kt[d][j]        (16 x 16 register transposes)
//!   scores   s[r][j] = sum_d q[r][d] * kt[d][j]               (q pre-scaled; no horizontal sums)
//!   P.V      acc[r][:] += p[r][j] * v[j][:]                   (v decoded once per tile)
//!
//! With AVX-512 BF16 and bf16 queries (bf16 caches; int8 / fp8 ones converted to bf16) the K
//! tile is re-laid as dimension pairs instead (`kp[dp][j]`, a 16 x 16 dword transpose per 32
//! dimensions) and each score row is `d / 2` broadcast `vdpbf16ps`; prefill rows do P.V the same
//! way on V re-laid as key pairs, with P rounded to bf16 (as flash attention's P.V). An item with
//! at least `COLS_MIN_ROWS` rows per KV head on that path runs in transposed blocks of 16 rows
//! instead (`cols.rs`: scores of one key for 16 rows per vector, a vertical online softmax).
//! On AMX with a bf16 cache and no ALiBi, the tile loop only gathers each head's K rows and
//! V^T for the item's whole key range; `cols::head_seg` then runs the blocks over it in 256-key
//! segments (thread-local buffers, grown, never freed).
//!
//! On AMX with a bf16 cache, a decode item (one query token, up to 16 query heads per KV head,
//! no ALiBi) runs in `dec_amx.rs` instead: its scores as tile products over K rows read in
//! place, a two-pass softmax, P.V as below. Without AMX, a bf16 item of up to 4 rows per KV head
//! on AVX-512 BF16 takes two passes per 512-key segment (`two_pass`): the tile loop keeps each
//! tile's scores and V row addresses (thread-local, grown, never freed), then per row one max
//! and rescale per segment, and per tile exp, P in bf16 pairs and P.V: no per-tile horizontal
//! max and sum, scalar `exp` or accumulator rescale. Such bf16 decode items, and int8 / fp8
//! ones on AVX-512 VNNI / VBMI, run those two passes out of this loop, in `dec_lean.rs` (the
//! loop's own paths stay for A/B runs, `KVCORE_NATIVE_ISA=tileloop`, and other items).
//!
//! Without either (AVX2), an item with at most `DIRECT_MAX_ROWS` rows per KV head (decode) and
//! any cache format skips the K tile's transpose: `qk_direct` dots each query row
//! with K rows read in place, eight lanes of partial sums per key summed by horizontal adds
//! (bf16 and fp8 rows widened as their even and odd dimensions, so the query rows are re-laid
//! to match; fp8 codes read raw, `raw_v`), and P.V keeps two sets of accumulators (even and
//! odd keys) for its FMA latency.
//!
//! A key is visible to a row if it lies in [qpos - window + 1, qpos] and its block is not
//! released (block-table entry 0 inside the sequence, when the call says blocks were released):
//! a bit mask per row and tile. Masked or missing keys point at a zero row, so the null block is
//! never read and no NaN beyond a sequence's end reaches the accumulator.
//!
//! Items whose key range is a split of a longer one write (acc, m, l) to a partial buffer that
//! `merge` combines (flash-decoding's split-KV). A *cascade* item is one whose query tokens
//! belong to consecutive decode requests sharing the blocks of its key range (a cached prefix):
//! the prefix's K/V rows are read once for all of them, and each request's partial is merged
//! with that of its own keys (FlashInfer's cascade attention). Scratch is per thread, grown,
//! never freed.
//!
//! Loops over SIMD values are plain loops, never closures (`array::from_fn`): a closure is not
//! compiled with the caller's target features, so the intrinsics in it become calls (an fp8
//! decode tile built that way ran ~4x slower).

use crate::simd::{self, fp8_bias, Simd, FP8_PRE, W};

/// How K and V elements are stored.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fmt {
    F32,
    Bf16,
    F16,
    /// int8 codes with a float16 scale per token (per head, per K/V).
    I8,
    E4m3,
    E5m2,
}

/// Element type of the query and the output.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dt {
    F32,
    Bf16,
    F16,
}

impl Dt {
    pub fn size(self) -> usize {
        if self == Dt::F32 {
            4
        } else {
            2
        }
    }
    #[inline(always)]
    unsafe fn read(self, p: *const u8, i: usize) -> f32 {
        match self {
            Dt::F32 => (p as *const f32).add(i).read_unaligned(),
            Dt::Bf16 => simd::bf16_to_f32((p as *const u16).add(i).read_unaligned()),
            Dt::F16 => simd::f16_to_f32((p as *const u16).add(i).read_unaligned()),
        }
    }
    #[inline(always)]
    unsafe fn write(self, p: *mut u8, i: usize, x: f32) {
        match self {
            Dt::F32 => (p as *mut f32).add(i).write_unaligned(x),
            Dt::Bf16 => (p as *mut u16).add(i).write_unaligned(simd::f32_to_bf16(x)),
            Dt::F16 => (p as *mut u16).add(i).write_unaligned(simd::f32_to_f16(x)),
        }
    }
}

/// One call: pointers, strides (bytes for the cache, elements for q / out) and options.
#[derive(Clone, Copy)]
pub struct Call {
    pub q: *const u8,
    pub q_stride_tok: usize,
    pub q_stride_head: usize,
    pub out: *mut u8,
    pub out_stride_tok: usize,
    pub out_stride_head: usize,
    pub dt: Dt,
    pub kv: *const u8,
    pub fmt: Fmt,
    pub stride_block: usize,
    pub stride_tok: usize,
    pub stride_head: usize,
    /// bytes from a K row to the V row of the same slot
    pub v_offset: usize,
    /// int8: bytes from a head segment's start to its K scales (V scales follow after bs)
    pub scale_offset: usize,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub qsl: *const i64,
    pub seq_lens: *const i64,
    pub table: *const i64,
    pub table_stride: usize,
    pub scale: f32,
    pub window: i64,
    pub soft_cap: f32,
    pub alibi: *const f32,
    /// fp8: float32 [2, num_kv_heads] (K then V) per-head scales, or null
    pub fp8_scale: *const f32,
    /// float32 [head_dim, head_dim] or null: `lib::run` rotates the query rows by it first
    /// (`rotate_rows`; a cache that stores K rotated, `QuantKVCache.rotate_in`)
    pub q_rot: *const f32,
    pub released: bool,
    /// work items, 6 int64 each: req, tok0, ntok, key_lo, key_hi, partial offset (-1: none)
    pub work: *const i64,
    /// merge groups, 5 int64 each: tok0, ntok, num_splits, partial offset of the first split,
    /// floats from one split's partial to the next (a cascade's shared-prefix partial and a
    /// request's own one are not adjacent)
    pub merges: *const i64,
    pub partial: *mut f32,
    /// whether an item prefetches the first keys of the task its thread runs next as it ends
    pub prefetch_next: bool,
    /// whether the transposed path's products run on AMX tiles (`lib::run` sets it)
    pub amx: bool,
    /// with `amx`: whether bf16 items without ALiBi run by row blocks (`cols::head_seg`)
    pub seg: bool,
    /// with `amx`: whether bf16 decode items run on tiles (`dec_amx.rs`)
    pub dec: bool,
    /// whether bf16 decode items off AMX take two passes over their keys (`lib::run` sets it)
    pub two_pass: bool,
    /// with `two_pass`: whether eligible items take `dec_lean.rs` rather than the tile loop
    pub lean: bool,
}

unsafe impl Sync for Call {}
unsafe impl Send for Call {}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Align64([u32; 16]);

thread_local! {
    /// `cols::head_seg`'s buffers (`seg_len`): grown, never freed.
    static SEG: std::cell::RefCell<Vec<Align64>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The two-pass decode's kept tiles (`TwoPass`): grown, never freed.
    static TWO: std::cell::RefCell<TwoPass> = const {
        std::cell::RefCell::new(TwoPass { s: Vec::new(), v: Vec::new(), tiles: Vec::new() })
    };
}

/// What the two-pass decode (`run_item`'s `two_pass`) keeps of each key tile between its
/// passes: the scores of every row (`[head][tile][row]`, 16 lanes each; masked keys -inf), the V
/// row addresses (`[head][tile]`, 16 each) and per tile the rows' key masks and real keys.
struct TwoPass {
    s: Vec<Align64>,
    v: Vec<[usize; W]>,
    tiles: Vec<([u16; 4], usize)>,
}

/// 64-byte units of `cols::head_seg`'s buffers for `nt` key tiles of `heads` KV heads: K rows
/// and V^T per head, a segment's scores and P, the tile masks.
fn seg_len(nt: usize, d: usize, heads: usize) -> usize {
    let dwords = heads * (nt * W * d / 2 + nt.div_ceil(2) * d * W)
        + crate::cols::SEG_TILES * 2 * W * W
        + 2 * crate::cols::SEG_TILES * 8 * W
        + nt.div_ceil(2);
    dwords.div_ceil(16) + 1
}

/// Floats of scratch one thread needs for items of up to `rows` rows of `heads` KV heads.
pub fn scratch_len(rows: usize, d: usize, heads: usize) -> usize {
    let padded = rows + (W - 1) * heads; // the transposed path's rows, 16 per block
    2 * rows * d
        + 2 * rows
        + 2 * W * d
        + rows * W
        + 2 * W
        + d
        + rows * d / 2
        + W * d
        + rows * W / 2
        + padded * (3 * d / 2 + 2)
        + 3 * rows
}

/// Whether instance `S` reads fp8 V rows raw (`Simd::load_fp8_raw`: AVX2, whose exact read
/// costs 8 ops per 16 codes, the raw one 6): P is scaled up by 2^`FP8_PRE` and the
/// accumulator by 2^(`fp8_bias` - `FP8_PRE`) once per item (as on the AVX-512 fp8 path).
#[inline(always)]
const fn raw_v<S: Simd, const F: u8>() -> bool {
    S::QK_DIRECT && (F == 4 || F == 5)
}

/// Columns `c .. c + 16` of a V row: `load_row`, or raw where `raw_v`.
#[inline(always)]
unsafe fn load_v<S: Simd, const F: u8>(p: *const u8, c: usize) -> S {
    if raw_v::<S, F>() {
        S::load_fp8_raw::<F>(p.add(c))
    } else {
        load_row::<S, F>(p, c)
    }
}

#[inline(always)]
unsafe fn load_row<S: Simd, const F: u8>(p: *const u8, c: usize) -> S {
    match F {
        0 => S::load((p as *const f32).add(c)),
        1 => S::load_bf16((p as *const u16).add(c)),
        2 => S::load_f16((p as *const u16).add(c)),
        3 => S::load_i8((p as *const i8).add(c)),
        4 => S::load_e4m3(p.add(c)),
        _ => S::load_e5m2(p.add(c)),
    }
}

/// The tile's V rows as key pairs: `vp[jp][c]` = (V[2 jp][c], V[2 jp + 1][c]) as a bf16 pair,
/// `njp` rows of `d` dwords (exact for bf16, int8 and fp8 values; a non-real key is a zero row).
#[inline(always)]
unsafe fn relay_v_pairs<S: Simd, const F: u8>(
    v: &[*const u8; W],
    njp: usize,
    d: usize,
    vp: *mut u32,
) {
    for jp in 0..njp {
        for cc in (0..d).step_by(W) {
            S::store_pair_rows(
                load_row::<S, F>(v[2 * jp], cc),
                load_row::<S, F>(v[2 * jp + 1], cc),
                vp.add(jp * d + cc),
            );
        }
    }
}

/// Rows of one KV head from which an item takes the transposed path (`cols.rs`).
const COLS_MIN_ROWS: usize = 16;

/// Rows of one KV head up to which an item takes `qk_direct` where the instance has it.
const DIRECT_MAX_ROWS: usize = 8;

/// A query row re-laid for `qk_direct` on bf16 K rows: each 16-dimension chunk as its 8 even
/// dimensions, then its 8 odd ones.
#[inline(always)]
pub(crate) fn evenodd_row(row: &mut [f32]) {
    for chunk in row.chunks_exact_mut(16) {
        let mut t = [0f32; 16];
        for i in 0..8 {
            t[i] = chunk[2 * i];
            t[8 + i] = chunk[2 * i + 1];
        }
        chunk.copy_from_slice(&t);
    }
}

/// Keys ahead of the current tile whose K and V rows are prefetched (one head; `pf_ahead`).
pub(crate) const PREFETCH_KEYS: i64 = 64;

/// Keys ahead for a task over `nh` heads of `elem_bytes` elements: `PREFETCH_KEYS` for one head;
/// for several, about the bytes one bf16 head has ahead, in whole tiles (bf16 over 3 heads: 16
/// keys; int8 / fp8: 32). A task over a block's 3 heads on a Zen 3 (AVX2, bf16, 8 x 16K decode,
/// one thread, prefetches evenly spread): 16 keys ahead 10.7-11.5 ms, 32: 11.1-11.9, 64:
/// 12.0-12.2.
fn pf_ahead(nh: usize, elem_bytes: usize) -> i64 {
    let w = W as i64;
    if nh <= 1 {
        return PREFETCH_KEYS;
    }
    (PREFETCH_KEYS * 2 / (nh * elem_bytes) as i64).max(w) / w * w
}
/// Keys of a tile's next 16 prefetched at its start and after the first head's scores (the
/// rest after its softmax), by element bytes (2-4: 4-8 lines a key and head; 1: 2 lines).
/// Measured per format, interleaved (8 x 4K and 1 x 16K decode, warm): bf16 rows 12 % faster
/// in three parts than in two (8 / 8), int8 rows 15 % slower.
const fn pf_split(elem_bytes: usize) -> (i64, i64) {
    if elem_bytes == 1 {
        (8, 16)
    } else {
        (6, 11)
    }
}

/// Keys of a tile's next 16 prefetched by its prefetch point `pt`: 0 at the tile's start, then
/// `2 i + 1` after head `i`'s scores and `2 i + 2` after its softmax, for `nh` heads a task.
/// One head: `pf_split`. Several (a task over a block's heads, `fuse_heads`): the 16 keys spread
/// evenly over the `2 nh + 1` points, as a steady stream of a few lines at a time (in a probe of
/// this access pattern on a Zen 3, bursts of a whole block's lines read at 9-11 GB/s, evenly
/// spread ones at 16-17, a plain sequential read at 18).
#[inline(always)]
fn pf_goal(elem_bytes: usize, nh: usize, pt: usize) -> i64 {
    let w = W as i64;
    if nh == 1 {
        let (a, b) = pf_split(elem_bytes);
        return [a, b, w][pt.min(2)];
    }
    let pts = 2 * nh as i64 + 1;
    ((w * (pt as i64 + 1) + pts - 1) / pts).min(w)
}

/// Bytes per stored element of format `F`.
#[inline(always)]
fn elem_bytes(f: u8) -> usize {
    match f {
        0 => 4,
        1 | 2 => 2,
        _ => 1,
    }
}

/// Ask for the cache lines of a row into L2 (`prefetcht1`; a hint: no fault, no effect on
/// results). Not L1: the rows of the keys ahead (48 KiB at 64 keys and 3 KV heads) outgrow a
/// 32 KiB L1, and `prefetcht0` there evicted lines before their use: AVX2 on a Zen 3, cold
/// decode 2-8 % slower; AVX-512 BF16 on a Zen 4, cold decode **2x slower** (1 x 16K 2.78 ->
/// 1.40 ms, 64 x 512 5.65 -> 2.85 ms; prefill unchanged).
#[inline(always)]
pub(crate) unsafe fn prefetch_row(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T1>(p.add(o) as *const i8);
            o += 64;
        }
    }
    let _ = (p, bytes);
}

/// Prefetch keys `key0 .. key1` through block table `table` (K and V rows of heads `heads`; at a
/// block's first key, or at `first`, an int8 block's scales too), a run of a block's keys at a
/// time: one table read per run, then a row stride per key (a table read and the address per
/// key cost ~14 % of a bf16 or int8 decode tile).
#[inline(always)]
pub(crate) unsafe fn prefetch_keys(
    c: &Call,
    table: *const i64,
    key0: i64,
    key1: i64,
    heads: (usize, usize),
    row_bytes: usize,
    int8: bool,
    first: i64,
) {
    let bs = c.block_size as i64;
    let mut k = key0;
    while k < key1 {
        let (bi, t0) = ((k / bs) as usize, (k % bs) as usize);
        let t1 = (t0 as i64 + key1 - k).min(bs) as usize;
        let blk = *table.add(bi);
        if !(blk == 0 && c.released) {
            let b = c.kv.add(blk as usize * c.stride_block);
            // in address order (a token's heads, then the next token; K's run, then V's)
            for off in [0, c.v_offset] {
                let mut r = b.add(t0 * c.stride_tok + off);
                for _ in t0..t1 {
                    for hh in heads.0..heads.1 {
                        prefetch_row(r.add(hh * c.stride_head), row_bytes);
                    }
                    r = r.add(c.stride_tok);
                }
            }
            if int8 && (t0 == 0 || k == first) {
                for hh in heads.0..heads.1 {
                    // the block's scales of this head: K's then V's (2 bs halves, maybe 2 lines)
                    prefetch_row(
                        b.add(hh * c.stride_head + c.scale_offset),
                        4 * c.block_size + 63,
                    );
                }
            }
        }
        k += (t1 - t0) as i64;
    }
}

/// Format as the const generic `run_item` is instantiated with.
pub fn fmt_code(f: Fmt) -> u8 {
    match f {
        Fmt::F32 => 0,
        Fmt::Bf16 => 1,
        Fmt::F16 => 2,
        Fmt::I8 => 3,
        Fmt::E4m3 => 4,
        Fmt::E5m2 => 5,
    }
}

/// `p[x][:] = sum_dd q[x][dd] * kt[dd][:]` for `NR` rows (q rows `d` apart, p rows `W` apart),
/// two accumulators per row (even / odd `dd`) to keep eight FMA chains in flight, or one
/// (`S::QK_TWO_CHAINS` false: two registers per accumulator already).
#[inline(always)]
unsafe fn qk_rows<S: Simd, const NR: usize>(q: *const f32, d: usize, kt: *const f32, p: *mut f32) {
    let mut s0 = [S::splat(0.0); NR];
    if !S::QK_TWO_CHAINS {
        for dd in 0..d {
            let k = S::load(kt.add(dd * W));
            for x in 0..NR {
                s0[x] = S::splat(*q.add(x * d + dd)).fma(k, s0[x]);
            }
        }
        for x in 0..NR {
            s0[x].store(p.add(x * W));
        }
        return;
    }
    let mut s1 = [S::splat(0.0); NR];
    let mut dd = 0;
    while dd < d {
        let k0 = S::load(kt.add(dd * W));
        let k1 = S::load(kt.add((dd + 1) * W));
        for x in 0..NR {
            s0[x] = S::splat(*q.add(x * d + dd)).fma(k0, s0[x]);
            s1[x] = S::splat(*q.add(x * d + dd + 1)).fma(k1, s1[x]);
        }
        dd += 2;
    }
    for x in 0..NR {
        s0[x].add(s1[x]).store(p.add(x * W));
    }
}

/// `acc[x][:] += sum_j p[x][j] * vt[j][:]` for `NR` rows, 32 columns at a time (16 for an odd
/// first chunk, and for every chunk where `S::PV_PAIRED` is false).
#[inline(always)]
unsafe fn pv_rows<S: Simd, const NR: usize>(
    acc: *mut f32,
    p: *const f32,
    d: usize,
    vt: *const f32,
    nk: usize,
) {
    let mut cc = 0;
    // 16-column passes: all of them where `S` pairs none, else an odd first one
    let singles = if S::PV_PAIRED { (d / W) % 2 } else { d / W };
    for _ in 0..singles {
        let mut a = [S::splat(0.0); NR];
        for x in 0..NR {
            a[x] = S::load(acc.add(x * d + cc));
        }
        for j in 0..nk {
            let v = S::load(vt.add(j * d + cc));
            for x in 0..NR {
                a[x] = S::splat(*p.add(x * W + j)).fma(v, a[x]);
            }
        }
        for x in 0..NR {
            a[x].store(acc.add(x * d + cc));
        }
        cc += W;
    }
    while cc < d {
        let mut a0 = [S::splat(0.0); NR];
        let mut a1 = [S::splat(0.0); NR];
        for x in 0..NR {
            a0[x] = S::load(acc.add(x * d + cc));
            a1[x] = S::load(acc.add(x * d + cc + W));
        }
        for j in 0..nk {
            let v0 = S::load(vt.add(j * d + cc));
            let v1 = S::load(vt.add(j * d + cc + W));
            for x in 0..NR {
                let pj = S::splat(*p.add(x * W + j));
                a0[x] = pj.fma(v0, a0[x]);
                a1[x] = pj.fma(v1, a1[x]);
            }
        }
        for x in 0..NR {
            a0[x].store(acc.add(x * d + cc));
            a1[x].store(acc.add(x * d + cc + W));
        }
        cc += 2 * W;
    }
}

/// `pv_rows` reading V rows of format `F` in place (`vptr`), each widened once per 16 columns.
#[inline(always)]
unsafe fn pv_direct<S: Simd, const F: u8, const NR: usize>(
    acc: *mut f32,
    p: *const f32,
    d: usize,
    vptr: &[*const u8; W],
    nk: usize,
) {
    let mut cc = 0;
    while cc < d {
        let two = S::PV_PAIRED && cc + 2 * W <= d;
        if !two && NR <= 3 {
            // one 16-column pass (AVX2): even and odd keys into two sets of accumulators, so
            // that 4 * NR FMA chains (two registers per value) are in flight, not 2 * NR
            let mut a0 = [S::splat(0.0); NR];
            let mut a1 = [S::splat(0.0); NR];
            for x in 0..NR {
                a0[x] = S::load(acc.add(x * d + cc));
            }
            let mut j = 0;
            while j + 1 < nk {
                let v0 = load_v::<S, F>(vptr[j], cc);
                let v1 = load_v::<S, F>(vptr[j + 1], cc);
                for x in 0..NR {
                    a0[x] = S::splat(*p.add(x * W + j)).fma(v0, a0[x]);
                    a1[x] = S::splat(*p.add(x * W + j + 1)).fma(v1, a1[x]);
                }
                j += 2;
            }
            if j < nk {
                let v0 = load_v::<S, F>(vptr[j], cc);
                for x in 0..NR {
                    a0[x] = S::splat(*p.add(x * W + j)).fma(v0, a0[x]);
                }
            }
            for x in 0..NR {
                a0[x].add(a1[x]).store(acc.add(x * d + cc));
            }
            cc += W;
            continue;
        }
        let mut a0 = [S::splat(0.0); NR];
        let mut a1 = [S::splat(0.0); NR];
        for x in 0..NR {
            a0[x] = S::load(acc.add(x * d + cc));
            if two {
                a1[x] = S::load(acc.add(x * d + cc + W));
            }
        }
        for (j, &v) in vptr.iter().enumerate().take(nk) {
            let v0 = load_v::<S, F>(v, cc);
            let v1 = if two { load_v::<S, F>(v, cc + W) } else { v0 };
            for x in 0..NR {
                let pj = S::splat(*p.add(x * W + j));
                a0[x] = pj.fma(v0, a0[x]);
                if two {
                    a1[x] = pj.fma(v1, a1[x]);
                }
            }
        }
        for x in 0..NR {
            a0[x].store(acc.add(x * d + cc));
            if two {
                a1[x].store(acc.add(x * d + cc + W));
            }
        }
        cc += if two { 2 * W } else { W };
    }
}

/// The query rows of tokens `0..n_tok` (every query head) rotated: `dst` row `(t, h)` (`d`
/// elements of the query's dtype, rows `d` apart) = the row of `c.q` times `c.q_rot` (float32
/// `[d, d]` row-major), in fp32 with k ascending (one FMA chain per output element, as a
/// plain matrix product's), rounded to the dtype (`QuantKVCache.rotate_in`). `lib::run` does
/// this once per call, before the items, when `c.q_rot` is set; `x` holds `d` floats.
#[inline(always)]
pub unsafe fn rotate_rows<S: Simd>(c: &Call, n_tok: usize, dst: *mut u8, x: &mut [f32]) {
    let d = c.head_dim;
    for t in 0..n_tok {
        for h in 0..c.num_q_heads {
            let row =
                c.q.add((t * c.q_stride_tok + h * c.q_stride_head) * c.dt.size());
            for (e, v) in x.iter_mut().enumerate() {
                *v = c.dt.read(row, e);
            }
            let out = dst.add((t * c.num_q_heads + h) * d * c.dt.size());
            let mut cc = 0;
            while cc < d {
                let n = ((d - cc) / W).min(4); // 64 outputs at a time, in registers
                let mut a = [S::splat(0.0); 4];
                for (k, &xk) in x.iter().enumerate() {
                    let (xk, rk) = (S::splat(xk), c.q_rot.add(k * d + cc));
                    for (i, ai) in a.iter_mut().enumerate().take(n) {
                        *ai = xk.fma(S::load(rk.add(i * W)), *ai);
                    }
                }
                let mut o = [0f32; W];
                for (i, ai) in a.iter().enumerate().take(n) {
                    ai.store(o.as_mut_ptr());
                    for (l, &v) in o.iter().enumerate() {
                        c.dt.write(out, cc + i * W + l, v);
                    }
                }
                cc += n * W;
            }
        }
    }
}

/// Key tiles of a two-pass decode segment (`run_item`'s `two_pass`): 512 keys, whose K and V
/// rows (3 KV heads of bf16 rows of 64: 384 KiB) stay in L2 from pass 1 to pass 2. A whole
/// 8 x 16K item in one segment ran 1.3x the one-pass time (V read from memory twice).
const TWO_SEG: usize = 32;

/// Pass 2 of a two-pass decode segment of `n` kept tiles (`tp`: their scores, `stride` tiles
/// apart per KV head, V row addresses, row masks and real keys) for `heads` KV heads of `hrows`
/// rows (`g` per token), head dim `d`: per row the segment's max, the running max, sum and
/// accumulator rescaled once if it rose (an online softmax by segments), then per tile `exp`
/// against it, P in bf16 pairs (`pb`, `hrows * W / 2` dwords) and P.V on V read in place.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn two_pass_flush<S: Simd>(
    tp: (*const f32, *const [usize; W], *const ([u16; 4], usize)),
    n: usize,
    stride: usize,
    (heads, hrows, g, d): (usize, usize, usize, usize),
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    pb: *mut u32,
) {
    let (tp_s, tp_v, tp_tiles) = tp;
    let tiles = std::slice::from_raw_parts(tp_tiles, n);
    for hh in 0..heads {
        let hq0 = hh * hrows;
        let sh = tp_s.add(hh * stride * hrows * W);
        let acch = acc.as_mut_ptr().add(hq0 * d);
        let mut neg_m = [S::splat(0.0); 4];
        let mut rsum = [S::splat(0.0); 4];
        for r in 0..hrows {
            let mut vm = S::splat(f32::NEG_INFINITY);
            for t in 0..n {
                vm = vm.max(S::load(sh.add((t * hrows + r) * W)));
            }
            let (m_old, m_new) = (m[hq0 + r], m[hq0 + r].max(vm.hmax()));
            if m_new > m_old && m_old != f32::NEG_INFINITY {
                let alpha = (m_old - m_new).exp();
                l[hq0 + r] *= alpha;
                let a = S::splat(alpha);
                for cc in (0..d).step_by(W) {
                    let pa = acch.add(r * d + cc);
                    S::load(pa).mul(a).store(pa);
                }
            }
            m[hq0 + r] = m_new;
            // a row that has seen no key keeps m = -inf, l = 0 and a zero accumulator
            neg_m[r] = S::splat(if m_new == f32::NEG_INFINITY {
                0.0
            } else {
                -m_new
            });
        }
        for (t, &(mk, nk)) in tiles.iter().enumerate() {
            for r in 0..hrows {
                let s = S::load(sh.add((t * hrows + r) * W));
                let mut e = s.add(neg_m[r]).exp_softmax();
                let rm = mk[r / g];
                if rm != u16::MAX {
                    e = e.select(rm, S::splat(0.0));
                }
                rsum[r] = rsum[r].add(e);
                e.store_bf16_pairs(pb.add(r * (W / 2)));
            }
            let vrow = &*(tp_v.add(hh * stride + t) as *const [*const u8; W]);
            let njp = nk.div_ceil(2);
            match hrows {
                1 => S::pv_pairs_direct::<1>(acch, pb, d, vrow, njp),
                2 => S::pv_pairs_direct::<2>(acch, pb, d, vrow, njp),
                3 => S::pv_pairs_direct::<3>(acch, pb, d, vrow, njp),
                _ => S::pv_pairs_direct::<4>(acch, pb, d, vrow, njp),
            }
        }
        for r in 0..hrows {
            l[hq0 + r] += rsum[r].hsum();
        }
    }
}

/// Attention of work item `item` for KV heads `heads.0 .. heads.1` (one task); with all heads
/// the item streams through its blocks once (a token's heads are adjacent in the cache).
/// `scratch` holds `scratch_len(rows, d)` floats, `rows` = the item's query rows of those heads.
#[inline(always)]
pub unsafe fn run_item<S: Simd, const F: u8>(
    c: &Call,
    item: usize,
    heads: (usize, usize),
    next: Option<(usize, (usize, usize))>,
    scratch: &mut [f32],
) {
    let w = std::slice::from_raw_parts(c.work.add(6 * item), 6);
    let (req, tok0, ntok) = (w[0] as usize, w[1] as usize, w[2] as usize);
    let (key_lo, key_hi, part) = (w[3], w[4], w[5]);
    let d = c.head_dim;
    let hk = c.num_kv_heads;
    let g = c.num_q_heads / hk;
    let hrows = ntok * g; // rows of one KV head: r = i * g + gg
                          // bf16 decode on AMX tiles (`dec_amx.rs`)
    #[cfg(target_arch = "x86_64")]
    if S::DPBF16 && F == 1 && crate::dec_amx::eligible(c, ntok, g) {
        return crate::dec_amx::run(c, item, heads, next);
    }
    // ... else off AMX, the same two passes without the tile loop's bookkeeping (`dec_lean.rs`)
    #[cfg(target_arch = "x86_64")]
    if S::DPBF16 && F == 1 && crate::dec_lean::eligible::<1>(c, ntok, g) {
        return crate::dec_lean::run(c, item, heads, next);
    }
    // ... and int8 / fp8 decode on VNNI (VBMI) likewise, its dot products `vnni.rs`'s
    #[cfg(target_arch = "x86_64")]
    if S::VNNI && F >= 3 && crate::dec_lean::eligible::<F>(c, ntok, g) {
        return crate::dec_lean::run_quant::<F>(c, item, heads, next);
    }
    let (h0, h1) = heads; // this task's KV heads
    let rows = (h1 - h0) * hrows; // head hh's rows start at (hh - h0) * hrows
    let nc = d / W;
    let (q, rest) = scratch.split_at_mut(rows * d);
    let (acc, rest) = rest.split_at_mut(rows * d);
    let (m, rest) = rest.split_at_mut(rows);
    let (l, rest) = rest.split_at_mut(rows);
    let (kt, rest) = rest.split_at_mut(W * d);
    let (vt, rest) = rest.split_at_mut(W * d);
    let (p, rest) = rest.split_at_mut(hrows * W);
    let (kscale, rest) = rest.split_at_mut(W);
    let (vscale, rest) = rest.split_at_mut(W);
    let (zero, rest) = rest.split_at_mut(d);
    zero.fill(0.0);
    // bf16 queries dot bf16 K rows without widening (AVX-512 BF16): bf16 caches in place,
    // int8 / fp8 tiles after an exact conversion to bf16 (in registers; `kb` on the `cols` path).
    let dpbf16 = S::DPBF16 && d % 32 == 0 && (F == 1 || (F >= 3 && c.dt == Dt::Bf16));
    let (qb_f, rest) = rest.split_at_mut(rows * d / 2);
    let qb = qb_f.as_mut_ptr() as *mut u16; // [rows, d] bf16 query rows (dpbf16 only)
    let (kb_f, rest) = rest.split_at_mut(W * d / 2);
    let kb = kb_f.as_mut_ptr() as *mut u16; // [W, d] the K tile as bf16 rows (`cols` path)
    let (vp_f, rest) = rest.split_at_mut(W * d / 2);
    let vp = vp_f.as_mut_ptr() as *mut u32; // [W / 2, d] V tile as key pairs (dpbf16 prefill)

    // The transposed path (`cols`): KV heads with many rows, in blocks of 16 rows (padded).
    #[cfg(target_arch = "x86_64")]
    let cols = dpbf16 && hrows >= COLS_MIN_ROWS && crate::cols::supports(d);
    #[cfg(not(target_arch = "x86_64"))]
    let cols = false;
    // ... with its two products on AMX tiles (`amx.rs`): V^T per tile in `vt` (free there)
    let amx = cols && c.amx;
    // ... and for bf16 caches without ALiBi, by row blocks over the whole key range
    // (`cols::head_seg`): the tile loop below only gathers each head's K rows and V^T.
    let seg = amx && c.seg && F == 1 && c.alibi.is_null();
    #[cfg(target_arch = "x86_64")]
    if seg {
        crate::amx::configure_full();
    } else if amx {
        crate::amx::configure();
    }
    let nt = if seg {
        ((w[4] - w[3]) as usize).div_ceil(W)
    } else {
        0
    };
    let seg_buf = if seg {
        SEG.with(|cell| {
            let mut v = cell.borrow_mut();
            let need = seg_len(nt, d, heads.1 - heads.0);
            if v.len() < need {
                v.resize(need, Align64([0; 16]));
            }
            v.as_mut_ptr() as *mut u32
        })
    } else {
        std::ptr::null_mut()
    };
    // [heads][nt][16][d] bf16 K, [heads][nt / 2][d][16] V^T pairs, S, P, tile masks
    let seg_kb = seg_buf as *mut u16;
    let seg_vt = seg_buf.wrapping_add((heads.1 - heads.0) * nt * W * d / 2);
    let seg_vt_head = nt.div_ceil(2) * d * W;
    let seg_s = seg_vt.wrapping_add((heads.1 - heads.0) * seg_vt_head) as *mut f32;
    let seg_p = seg_s.wrapping_add(crate::cols::SEG_TILES * 2 * W * W) as *mut u32;
    let seg_tmask = seg_p.wrapping_add(2 * crate::cols::SEG_TILES * 8 * W) as *mut u16;
    // Few rows per KV head (decode) on the AVX2 instance, which widens every K format in
    // registers: scores straight from the K rows (`qk_direct`), no transposed K tile.
    let direct = S::QK_DIRECT && !dpbf16 && d % 16 == 0 && hrows <= DIRECT_MAX_ROWS;
    // int8 decode with AVX-512 VNNI: integer dot products of the codes (`vnni.rs`); the query
    // rows as two int8 parts in `qb`'s space, the accumulator in its permuted layout.
    #[cfg(target_arch = "x86_64")]
    let vnni =
        S::VNNI && dpbf16 && F == 3 && !cols && hrows <= crate::vnni::MAX_ROWS && d % 64 == 0;
    #[cfg(not(target_arch = "x86_64"))]
    let vnni = false;
    let (q8h, q8l) = (qb as *mut i8, (qb as *mut i8).add(rows * d));
    // fp8 decode with AVX-512 VBMI: K and V codes made bf16 by shift and mask in registers, K
    // transposed as codes, V paired as codes (`vnni::fp8_*`); the accumulator in dimension order.
    #[cfg(target_arch = "x86_64")]
    let fp8dec = S::VNNI && dpbf16 && (F == 4 || F == 5) && !cols && hrows <= 4 && d % 64 == 0;
    #[cfg(not(target_arch = "x86_64"))]
    let fp8dec = false;
    // fp8 codes are read too small by 2^bias (`vnni::fp8_words`, and AVX2's `load_fp8_raw` on
    // the direct path for K, always for V): the query and P are scaled up by 2^FP8_PRE, the
    // scores and the accumulator by the rest.
    let fp8_pre = (2f32).powi(FP8_PRE);
    let fp8_post = (2f32).powi(fp8_bias(F) - FP8_PRE);
    let raw_k = direct && (F == 4 || F == 5);
    // bf16 decode off AMX (up to 4 rows per KV head, bf16 cache): two passes per segment of
    // `TWO_SEG` tiles, as `dec_amx.rs` on tiles: pass 1 keeps every tile's scores and V row
    // addresses, pass 2 (`two_pass_flush`) takes each row's max and rescale once per segment,
    // then exp, P in bf16 pairs and P.V per tile. No horizontal max, sum or scalar `exp` per
    // tile (the online softmax's per-tile cost; flash-decoding's split of scores and
    // normalisation).
    let two_pass = S::DPBF16 && F == 1 && c.two_pass && !cols && dpbf16 && hrows <= 4;
    let two_tiles = if two_pass {
        ((key_hi - key_lo) as usize).div_ceil(W).min(TWO_SEG)
    } else {
        0
    };
    let (tp_s, tp_v, tp_tiles) = if two_pass {
        TWO.with(|cell| {
            let mut b = cell.borrow_mut();
            let heads = h1 - h0;
            if b.s.len() < heads * two_tiles * hrows {
                b.s.resize(heads * two_tiles * hrows, Align64([0; 16]));
            }
            if b.v.len() < heads * two_tiles {
                b.v.resize(heads * two_tiles, [0; W]);
            }
            if b.tiles.len() < two_tiles {
                b.tiles.resize(two_tiles, ([0; 4], 0));
            }
            (
                b.s.as_mut_ptr() as *mut f32,
                b.v.as_mut_ptr(),
                b.tiles.as_mut_ptr(),
            )
        })
    } else {
        (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    let tp = (
        tp_s as *const f32,
        tp_v as *const [usize; W],
        tp_tiles as *const _,
    );
    let mut two_n = 0; // tiles kept so far
    let nblk = if cols { hrows.div_ceil(W) } else { 0 };
    let prow = (h1 - h0) * nblk * W;
    let (acc_t, rest) = rest.split_at_mut(prow * d); // [head][block][d][16]
    let (q_t_f, rest) = rest.split_at_mut(prow * d / 2);
    let q_t = q_t_f.as_mut_ptr() as *mut u32; // [head][block][d / 2][16] query pairs
    let (m_t, rest) = rest.split_at_mut(prow);
    let (l_t, rest) = rest.split_at_mut(prow);
    let (qmeta, rest) = rest.split_at_mut(3 * rows); // int8 decode: `vnni::quantize_q` per row
    let pb = rest.as_mut_ptr() as *mut u32; // [hrows, W / 2] probabilities as bf16 pairs
    let zero_row = zero.as_ptr() as *const u8; // zero in every format

    let seq_len = *c.seq_lens.add(req);
    let q_len = *c.qsl.add(req + 1) - *c.qsl.add(req);
    let first_pos = seq_len - q_len + (tok0 as i64 - *c.qsl.add(req));
    let kscale_of = |hh: usize| {
        if c.fp8_scale.is_null() {
            1.0
        } else {
            *c.fp8_scale.add(hh)
        }
    };
    for hh in (h0..h1).filter(|_| !cols) {
        let qscale = c.scale * kscale_of(hh) * if raw_k { fp8_pre } else { 1.0 };
        for i in 0..ntok {
            let src = c.q.add((tok0 + i) * c.q_stride_tok * c.dt.size());
            for gg in 0..g {
                let row = src.add((hh * g + gg) * c.q_stride_head * c.dt.size());
                let r = (hh - h0) * hrows + i * g + gg;
                let dst = &mut q[r * d..][..d];
                for (e, x) in dst.iter_mut().enumerate() {
                    *x = c.dt.read(row, e) * qscale;
                }
                if vnni {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `vnni` only on the AVX-512 VNNI instance
                    qmeta[3 * r..3 * r + 3].copy_from_slice(&crate::vnni::quantize_q_avx512(
                        dst,
                        std::slice::from_raw_parts_mut(q8h.add(r * d), d),
                        std::slice::from_raw_parts_mut(q8l.add(r * d), d),
                    ));
                } else if dpbf16 {
                    std::ptr::copy_nonoverlapping(row as *const u16, qb.add(r * d), d);
                    #[cfg(target_arch = "x86_64")]
                    if fp8dec {
                        for e in 0..d {
                            let x = c.dt.read(row, e) * fp8_pre; // exact: a power of two
                            *qb.add(r * d + e) = (x.to_bits() >> 16) as u16;
                        }
                    }
                }
                if direct && (F == 1 || raw_k) {
                    evenodd_row(dst);
                }
            }
        }
    }
    acc.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    if cols {
        acc_t.fill(0.0);
        m_t.fill(f32::NEG_INFINITY);
        l_t.fill(0.0);
        // q_t[dp][lane] = dword dp (a pair of dimensions) of the block's row `lane`: 16 x 16
        // dword transposes; padded rows are zero.
        let dp = d / 2;
        for hh in h0..h1 {
            for b in 0..nblk {
                let dst = q_t.add(((hh - h0) * nblk + b) * dp * W);
                let mut rows = [zero_row; W];
                for (lane, row) in rows.iter_mut().enumerate().take(hrows - b * W) {
                    let rl = b * W + lane; // row of this head: token rl / g, query head rl % g
                    *row = c.q.add(
                        ((tok0 + rl / g) * c.q_stride_tok + (hh * g + rl % g) * c.q_stride_head)
                            * c.dt.size(),
                    );
                }
                for c2 in (0..dp).step_by(W) {
                    let mut tile = [S::splat(0.0); W];
                    for (t, &row) in tile.iter_mut().zip(rows.iter()) {
                        *t = S::load((row as *const f32).add(c2));
                    }
                    S::transpose(&mut tile);
                    for (i, v) in tile.iter().enumerate() {
                        v.store(dst.add((c2 + i) * W) as *mut f32);
                    }
                }
            }
        }
    }
    let table = c.table.add(req * c.table_stride);
    let bs = c.block_size as i64;
    let int8 = F == 3;
    let row_bytes = d * elem_bytes(F);
    // Keys `ahead` of the tile are prefetched (K and V rows of every head): a request's blocks
    // are scattered, so the hardware prefetcher cannot guess them.
    let ahead = pf_ahead(h1 - h0, elem_bytes(F));
    let mut pf_key = key_lo;
    // The task this thread runs next (`pool::for_each_ahead`): its block table, keys, heads.
    let next = next.filter(|_| c.prefetch_next).map(|(it, nh)| {
        let w = std::slice::from_raw_parts(c.work.add(6 * it), 6);
        (c.table.add(w[0] as usize * c.table_stride), w[3], w[4], nh)
    });
    let mut nx_key = next.map_or(0, |n| n.1);
    let (mut cur_blk, mut cur_t) = ((key_lo / bs) as usize, (key_lo % bs) as usize);
    let mut base = [0usize; W]; // byte offset of key j's K row of head 0 (real keys)
    let mut kptr = [zero_row; W];
    let mut vptr = [zero_row; W];
    let mut masks = [0u16; 256 + W]; // per query token; W spare for `cols::lane_masks`
    let mut k0 = key_lo;
    while k0 < key_hi {
        let n = (key_hi - k0).min(W as i64) as usize;
        // Part of the keys ahead now, the rest later in the tile (`pf_goal`): a burst of all
        // 16 keys' lines (64 for bf16 rows of 128 bytes) overflowed the misses the core keeps
        // in flight (bf16 decode 1.05-1.36x the time of prefetches spread per key).
        // (all of them on the transposed path, which never reaches the later points)
        let pf_first = if cols {
            W as i64
        } else {
            pf_goal(elem_bytes(F), h1 - h0, 0)
        };
        let pf_end = (k0 + pf_first + ahead).min(key_hi);
        if pf_key < pf_end {
            prefetch_keys(c, table, pf_key, pf_end, (h0, h1), row_bytes, int8, key_lo);
            pf_key = pf_end;
        }
        // Past the item's last key: the first keys of the item this thread runs next.
        if let Some((ntable, nlo, nhi, nheads)) = next {
            let want = nlo + (k0 + W as i64 + ahead - key_hi).min(nhi - nlo);
            if nx_key < want {
                prefetch_keys(c, ntable, nx_key, want, nheads, row_bytes, int8, nlo);
                nx_key = want;
            }
        }
        let mut tile_mask: u16 = 0;
        let mut tok = [0usize; W];
        let blk0 = *table.add(cur_blk);
        if n == W && cur_t + W <= c.block_size && !(blk0 == 0 && c.released) {
            // the common case: 16 real keys in one block
            for j in 0..W {
                tok[j] = cur_t + j;
                base[j] = blk0 as usize * c.stride_block;
            }
            tile_mask = u16::MAX;
            cur_t += W;
            if cur_t == c.block_size {
                cur_t = 0;
                cur_blk += 1;
            }
        }
        for j in 0..if tile_mask == 0 { n } else { 0 } {
            let blk = *table.add(cur_blk);
            tok[j] = cur_t;
            cur_t += 1;
            if cur_t == c.block_size {
                cur_t = 0;
                cur_blk += 1;
            }
            if blk == 0 && c.released {
                continue;
            }
            base[j] = blk as usize * c.stride_block;
            tile_mask |= 1 << j;
        }
        // Tokens that see some key of the tile: qpos >= k0 and qpos - window < k0 + n - 1.
        let mut r_lo = hrows;
        let mut r_hi = 0;
        // (`head_seg` masks by itself: without a window, the last token sees every tile)
        let seen_all = seg && c.window <= 0 && tile_mask != 0 && first_pos + ntok as i64 > k0;
        if seen_all {
            (r_lo, r_hi) = (0, hrows);
        }
        for i in (0..ntok).filter(|_| !seen_all) {
            let qpos = first_pos + i as i64;
            let hi = (qpos - k0 + 1).clamp(0, W as i64) as u32; // lanes < hi: key <= qpos
            let lo = if c.window > 0 {
                (qpos - c.window + 1 - k0).clamp(0, W as i64) as u32
            } else {
                0
            };
            let range = if hi > lo {
                (((1u32 << hi) - 1) & !((1u32 << lo) - 1)) as u16
            } else {
                0
            };
            let mk = range & tile_mask;
            masks[i] = mk;
            if mk != 0 {
                r_lo = r_lo.min(i * g);
                r_hi = r_hi.max((i + 1) * g);
            }
        }
        let ti = ((k0 - key_lo) / W as i64) as usize;
        if r_lo >= r_hi {
            if seg {
                // no row sees the tile: zero keys (`head_seg` masks them all)
                *seg_tmask.add(ti) = 0;
                for hh in 0..h1 - h0 {
                    std::ptr::write_bytes(seg_kb.add((hh * nt + ti) * W * d), 0, W * d);
                    let vt0 = seg_vt.add(hh * seg_vt_head + ti / 2 * d * W + ti % 2 * 8);
                    for cc in 0..d {
                        std::ptr::write_bytes(vt0.add(cc * W), 0, 8);
                    }
                }
            }
            k0 += W as i64;
            continue;
        }
        if seg {
            *seg_tmask.add(ti) = tile_mask;
        }
        let nk = W - tile_mask.leading_zeros() as usize; // last real key + 1
        let keys = {
            let mut a = [0f32; W];
            for (j, x) in a.iter_mut().enumerate() {
                *x = (k0 + j as i64) as f32;
            }
            S::load(a.as_ptr())
        };
        // Every key of the tile real and in one block: its int8 scales are 16 adjacent halves.
        let one_block = tile_mask == u16::MAX && tok[W - 1] == tok[0] + W - 1;
        for hh in h0..h1 {
            let head = c.kv.add(hh * c.stride_head);
            if int8 && one_block {
                let s = head.add(base[0] + c.scale_offset) as *const u16;
                S::load_f16(s.add(tok[0])).store(kscale.as_mut_ptr());
                S::load_f16(s.add(c.block_size + tok[0])).store(vscale.as_mut_ptr());
            }
            // One-block decode tiles on the int8 / fp8 (`vnni::Strided`) and bf16 two-pass paths
            // form their row addresses at use: no 16-address arrays stored and reloaded.
            let r0 = if one_block {
                head.add(base[0] + tok[0] * c.stride_tok)
            } else {
                head
            };
            let strided = (fp8dec || vnni) && one_block;
            if two_pass && one_block {
                let mut kr = r0;
                for kj in kptr.iter_mut() {
                    *kj = kr;
                    kr = kr.add(c.stride_tok);
                }
            }
            if one_block && !strided && !two_pass {
                for j in 0..W {
                    kptr[j] = r0.add(j * c.stride_tok);
                    vptr[j] = kptr[j].add(c.v_offset);
                }
            }
            for j in 0..if one_block { 0 } else { W } {
                let real = tile_mask >> j & 1 != 0;
                kptr[j] = if real {
                    head.add(base[j] + tok[j] * c.stride_tok)
                } else {
                    zero_row
                };
                vptr[j] = if real {
                    kptr[j].add(c.v_offset)
                } else {
                    zero_row
                };
                if int8 && !one_block {
                    let (mut ks, mut vs) = (0.0, 0.0);
                    if real {
                        let s = head.add(base[j] + c.scale_offset) as *const u16;
                        ks = simd::f16_to_f32(s.add(tok[j]).read_unaligned());
                        vs = simd::f16_to_f32(s.add(c.block_size + tok[j]).read_unaligned());
                    }
                    kscale[j] = ks;
                    vscale[j] = vs;
                }
            }
            #[cfg(target_arch = "x86_64")]
            if cols {
                let kbp = if seg {
                    seg_kb.add(((hh - h0) * nt + ti) * W * d)
                } else {
                    kb
                };
                for (j, kr) in kptr.iter().enumerate() {
                    let dst = kbp.add(j * d);
                    if F == 1 {
                        for cc in (0..d / 2).step_by(W) {
                            S::load((*kr as *const f32).add(cc)).store((dst as *mut f32).add(cc));
                        }
                        continue;
                    }
                    let mut cc = 0;
                    while cc < d {
                        let lo = load_row::<S, F>(*kr, cc);
                        S::store_bf16x2(lo, load_row::<S, F>(*kr, cc + W), dst.add(cc));
                        cc += 2 * W;
                    }
                }
                if seg {
                    let vt0 = seg_vt.add((hh - h0) * seg_vt_head + ti / 2 * d * W + ti % 2 * 8);
                    crate::amx::vt_from_rows_at(&vptr, d, vt0, W);
                    continue;
                }
                let njp = nk.div_ceil(2);
                let vtp = vt.as_mut_ptr() as *mut u32;
                if amx && F == 1 {
                    crate::amx::vt_from_rows(&vptr, d, vtp); // bf16 rows: one transpose
                } else {
                    relay_v_pairs::<S, F>(&vptr, njp, d, vp);
                    if amx {
                        crate::amx::vt_from_pairs(vp, njp, d, vtp);
                    }
                }
                let ksc = &*(kscale.as_ptr() as *const [f32; W]);
                let vsc = &*(vscale.as_ptr() as *const [f32; W]);
                let active = |b: usize| b < nblk && b * W < r_hi && (b + 1) * W > r_lo;
                let mut b = 0;
                while b < nblk {
                    if !active(b) {
                        b += 1; // no row of this block sees a key of the tile
                        continue;
                    }
                    // Two adjacent blocks that both see the tile run together (`block2`).
                    let nb = if active(b + 1) { 2 } else { 1 };
                    let (mut slope, mut qpos) = ([[0f32; W]; 2], [[0f32; W]; 2]);
                    let mut kmask = [[0u16; W]; 2];
                    let mut full = [true; 2];
                    for i in 0..nb {
                        let bb = b + i;
                        if !c.alibi.is_null() {
                            for lane in 0..W.min(hrows - bb * W) {
                                let rl = bb * W + lane;
                                qpos[i][lane] = (first_pos + (rl / g) as i64) as f32;
                                slope[i][lane] = *c.alibi.add(hh * g + rl % g);
                            }
                        }
                        let lanes = crate::cols::lane_masks(masks.as_ptr(), bb, g, hrows);
                        full[i] = crate::cols::key_masks(lanes, &mut kmask[i]);
                    }
                    let tile = |i: usize| crate::cols::Tile {
                        kb: kbp,
                        vp,
                        njp,
                        qs: c.scale * kscale_of(hh),
                        kmask: if full[i] { None } else { Some(&kmask[i]) },
                        kscale: if int8 { Some(ksc) } else { None },
                        vscale: if int8 { Some(vsc) } else { None },
                        soft_cap: c.soft_cap,
                        alibi: if c.alibi.is_null() {
                            None
                        } else {
                            Some((&slope[i], &qpos[i], k0 as f32))
                        },
                    };
                    let at = ((hh - h0) * nblk + b) * W;
                    let (qa, aa) = (q_t.add(at * d / 2), acc_t.as_mut_ptr().add(at * d));
                    let (ma, la) = (m_t.as_mut_ptr().add(at), l_t.as_mut_ptr().add(at));
                    if amx {
                        let t1 = if nb == 2 { Some(tile(1)) } else { None };
                        let t0 = tile(0);
                        crate::cols::block_amx_d(d, &t0, t1.as_ref(), vtp, qa, aa, ma, la);
                    } else if nb == 2 {
                        crate::cols::block2_d(d, &tile(0), &tile(1), qa, aa, ma, la);
                    } else {
                        crate::cols::block_d(d, &tile(0), qa, aa, ma, la);
                    }
                    b += nb;
                }
                continue;
            }
            let hq0 = (hh - h0) * hrows; // this head's first row
            let (qh, acch) = (q.as_ptr().add(hq0 * d), acc.as_mut_ptr().add(hq0 * d));
            // Scores of the visible rows.
            if vnni {
                #[cfg(target_arch = "x86_64")]
                {
                    let mut r = r_lo;
                    while r < r_hi {
                        let nr = (r_hi - r).min(crate::vnni::NR_MAX);
                        let at = (hq0 + r) * d;
                        let (qh8, ql8) = (q8h.add(at) as *const i8, q8l.add(at) as *const i8);
                        let (qm, pr) =
                            (qmeta.as_ptr().add(3 * (hq0 + r)), p.as_mut_ptr().add(r * W));
                        if strided {
                            let k = crate::vnni::Strided::<0> {
                                base: r0,
                                stride: c.stride_tok,
                            };
                            crate::vnni::qk(&k, d, nr, qh8, ql8, qm, pr);
                        } else {
                            crate::vnni::qk(&kptr, d, nr, qh8, ql8, qm, pr);
                        }
                        r += nr;
                    }
                }
            } else if fp8dec {
                // fp8 codes transposed, converted and dotted in registers (`vnni::fp8_qk`)
                #[cfg(target_arch = "x86_64")]
                {
                    let qr = qb.add((hq0 + r_lo) * d) as *const u32;
                    let qs = c.scale * kscale_of(hh) * fp8_post;
                    let pr = p.as_mut_ptr().add(r_lo * W);
                    let n = r_hi - r_lo;
                    if strided {
                        let k = crate::vnni::Strided::<0> {
                            base: r0,
                            stride: c.stride_tok,
                        };
                        crate::vnni::fp8_qk::<F, _>(&k, d, n, qr, qs, pr);
                    } else {
                        crate::vnni::fp8_qk::<F, _>(&kptr, d, n, qr, qs, pr);
                    }
                }
            } else if dpbf16 {
                let qs = S::splat(c.scale * kscale_of(hh));
                // K tile as dimension pairs (a 16 x 16 dword transpose per 32 dimensions):
                // kp[dp][j] = (K[j][2 dp], K[j][2 dp + 1]), then broadcast dot products. An
                // int8 row is converted to bf16 in registers on the way in.
                let kp = kt.as_mut_ptr() as *mut u32; // kt is free on this path
                for c2 in 0..d / (2 * W) {
                    let mut tile = [S::splat(0.0); W];
                    for (t, &kr) in tile.iter_mut().zip(kptr.iter()) {
                        *t = if F >= 3 {
                            let lo = load_row::<S, F>(kr, 2 * W * c2);
                            S::bf16x2(lo, load_row::<S, F>(kr, 2 * W * c2 + W))
                        } else {
                            S::load((kr as *const f32).add(c2 * W))
                        };
                    }
                    S::transpose(&mut tile);
                    for (i, v) in tile.iter().enumerate() {
                        v.store(kp.add((c2 * W + i) * W) as *mut f32);
                    }
                }
                let mut r = r_lo;
                while r < r_hi {
                    let qr = qb.add((hq0 + r) * d) as *const u32;
                    let pr = p.as_mut_ptr().add(r * W);
                    match r_hi - r {
                        1 => S::qk_pairs::<1>(qr, d, kp, qs, pr),
                        2 => S::qk_pairs::<2>(qr, d, kp, qs, pr),
                        3 => S::qk_pairs::<3>(qr, d, kp, qs, pr),
                        _ => S::qk_pairs::<4>(qr, d, kp, qs, pr),
                    }
                    r += 4;
                }
            } else if direct {
                let mut r = r_lo;
                while r < r_hi {
                    let (qr, pr) = (qh.add(r * d), p.as_mut_ptr().add(r * W));
                    match r_hi - r {
                        1 => S::qk_direct::<F, 1>(qr, d, &kptr, nk, pr),
                        2 => S::qk_direct::<F, 2>(qr, d, &kptr, nk, pr),
                        3 => S::qk_direct::<F, 3>(qr, d, &kptr, nk, pr),
                        _ => S::qk_direct::<F, 4>(qr, d, &kptr, nk, pr),
                    }
                    r += 4;
                }
            } else {
                // K tile, transposed: kt[dd * W + j] = K[j][dd]
                for cc in 0..nc {
                    let mut tile = [S::splat(0.0); W];
                    for (t, &kr) in tile.iter_mut().zip(kptr.iter()) {
                        *t = load_row::<S, F>(kr, cc * W);
                    }
                    S::transpose(&mut tile);
                    for (i, v) in tile.iter().enumerate() {
                        v.store(kt.as_mut_ptr().add((cc * W + i) * W));
                    }
                }
                let mut r = r_lo;
                while r < r_hi {
                    let (qr, pr) = (qh.add(r * d), p.as_mut_ptr().add(r * W));
                    match r_hi - r {
                        1 => qk_rows::<S, 1>(qr, d, kt.as_ptr(), pr),
                        2 => qk_rows::<S, 2>(qr, d, kt.as_ptr(), pr),
                        3 => qk_rows::<S, 3>(qr, d, kt.as_ptr(), pr),
                        _ => qk_rows::<S, 4>(qr, d, kt.as_ptr(), pr),
                    }
                    r += 4;
                }
            }
            {
                let pt = 1 + 2 * (hh - h0);
                let pf_end = (k0 + pf_goal(elem_bytes(F), h1 - h0, pt) + ahead).min(key_hi);
                if pf_key < pf_end {
                    prefetch_keys(c, table, pf_key, pf_end, (h0, h1), row_bytes, int8, key_lo);
                    pf_key = pf_end;
                }
            }
            if two_pass {
                // pass 1: the tile's scores as the softmax will take them, masked keys -inf
                let e = (hh - h0) * two_tiles + two_n;
                let sd = tp_s.add(e * hrows * W);
                for r in 0..hrows {
                    let mk = masks[r / g];
                    let mut s = S::load(p.as_ptr().add(r * W));
                    if mk != 0 && c.soft_cap > 0.0 {
                        s = simd::tanh(s.mul(S::splat(1.0 / c.soft_cap))).mul(S::splat(c.soft_cap));
                    }
                    if mk != 0 && !c.alibi.is_null() {
                        let slope = *c.alibi.add(hh * g + r % g);
                        let qpos = (first_pos + (r / g) as i64) as f32;
                        s = keys.add(S::splat(-qpos)).fma(S::splat(slope), s);
                    }
                    if mk != u16::MAX {
                        s = s.select(mk, S::splat(f32::NEG_INFINITY));
                    }
                    s.store(sd.add(r * W));
                }
                let vd = &mut *tp_v.add(e);
                if one_block {
                    let mut vr = r0.add(c.v_offset) as usize;
                    for dst in vd.iter_mut() {
                        *dst = vr;
                        vr += c.stride_tok;
                    }
                } else {
                    for (dst, src) in vd.iter_mut().zip(vptr.iter()) {
                        *dst = *src as usize;
                    }
                }
                continue;
            }
            // Online softmax of the visible rows.
            let ks = S::load(kscale.as_ptr());
            let vsc = S::load(vscale.as_ptr());
            for r in r_lo..r_hi {
                let mk = masks[r / g];
                let pr = p.as_mut_ptr().add(r * W);
                if mk == 0 {
                    S::splat(0.0).store(pr);
                    continue;
                }
                let mut s = S::load(pr);
                if int8 {
                    s = s.mul(ks);
                } else if raw_k {
                    s = s.mul(S::splat(fp8_post));
                }
                if c.soft_cap > 0.0 {
                    s = simd::tanh(s.mul(S::splat(1.0 / c.soft_cap))).mul(S::splat(c.soft_cap));
                }
                if !c.alibi.is_null() {
                    let slope = *c.alibi.add(hh * g + r % g);
                    let qpos = (first_pos + (r / g) as i64) as f32;
                    s = keys.add(S::splat(-qpos)).fma(S::splat(slope), s);
                }
                // a tile every key of which the row sees (most of a prefill's): no selects
                let full = mk == u16::MAX;
                if !full {
                    s = s.select(mk, S::splat(f32::NEG_INFINITY));
                }
                let (mr, lr) = (&mut m[hq0 + r], &mut l[hq0 + r]);
                let m_new = mr.max(s.hmax());
                let alpha = if *mr == m_new {
                    1.0 // the max did not move: no exp, no rescale
                } else if *mr == f32::NEG_INFINITY {
                    0.0
                } else {
                    (*mr - m_new).exp()
                };
                let mut e = s.add(S::splat(-m_new)).exp_softmax();
                if !full {
                    e = e.select(mk, S::splat(0.0));
                }
                *lr = *lr * alpha + e.hsum();
                *mr = m_new;
                if alpha != 1.0 {
                    let a = S::splat(alpha);
                    for cc in 0..nc {
                        let pa = acch.add(r * d + cc * W);
                        S::load(pa).mul(a).store(pa);
                    }
                }
                if int8 {
                    e.mul(vsc).store(pr);
                } else if raw_v::<S, F>() {
                    e.mul(S::splat(fp8_pre)).store(pr);
                } else {
                    e.store(pr);
                }
            }
            {
                let pt = 2 + 2 * (hh - h0);
                let pf_end = (k0 + pf_goal(elem_bytes(F), h1 - h0, pt) + ahead).min(key_hi);
                if pf_key < pf_end {
                    prefetch_keys(c, table, pf_key, pf_end, (h0, h1), row_bytes, int8, key_lo);
                    pf_key = pf_end;
                }
            }
            // P.V
            #[cfg(target_arch = "x86_64")]
            if fp8dec {
                for r in r_lo..r_hi {
                    S::load(p.as_ptr().add(r * W))
                        .mul(S::splat(fp8_pre))
                        .store_bf16_pairs(pb.add(r * (W / 2)));
                }
                let (ar, pr) = (acch.add(r_lo * d), pb.add(r_lo * (W / 2)) as *const u32);
                let (n, njp) = (r_hi - r_lo, nk.div_ceil(2));
                if strided {
                    let v = crate::vnni::Strided::<0> {
                        base: r0.add(c.v_offset),
                        stride: c.stride_tok,
                    };
                    crate::vnni::fp8_pv::<F, _>(ar, pr, d, n, &v, njp);
                } else {
                    crate::vnni::fp8_pv::<F, _>(ar, pr, d, n, &vptr, njp);
                }
                continue;
            }
            if vnni {
                #[cfg(target_arch = "x86_64")]
                {
                    let ng = nk.div_ceil(4);
                    let mut r = r_lo;
                    while r < r_hi {
                        let nr = (r_hi - r).min(crate::vnni::NR_MAX);
                        let (ar, pr) = (acch.add(r * d), p.as_ptr().add(r * W));
                        if strided {
                            let v = crate::vnni::Strided::<0> {
                                base: r0.add(c.v_offset),
                                stride: c.stride_tok,
                            };
                            crate::vnni::pv(ar, pr, d, nr, &v, ng);
                        } else {
                            crate::vnni::pv(ar, pr, d, nr, &vptr, ng);
                        }
                        r += nr;
                    }
                }
                continue;
            }
            if r_hi - r_lo <= 4 && dpbf16 && F == 1 {
                // Few rows (decode), bf16 cache: V rows paired in registers straight from the
                // cache, P in bf16 pairs, one bf16-pair dot product per two keys.
                for r in r_lo..r_hi {
                    S::load(p.as_ptr().add(r * W)).store_bf16_pairs(pb.add(r * (W / 2)));
                }
                let (ar, pr) = (acch.add(r_lo * d), pb.add(r_lo * (W / 2)) as *const u32);
                let njp = nk.div_ceil(2);
                match r_hi - r_lo {
                    1 => S::pv_pairs_direct::<1>(ar, pr, d, &vptr, njp),
                    2 => S::pv_pairs_direct::<2>(ar, pr, d, &vptr, njp),
                    3 => S::pv_pairs_direct::<3>(ar, pr, d, &vptr, njp),
                    _ => S::pv_pairs_direct::<4>(ar, pr, d, &vptr, njp),
                }
                continue;
            }
            if r_hi - r_lo <= 4 {
                // Few rows (decode): V rows widened straight from the cache into the FMAs.
                let (ar, pr) = (acch.add(r_lo * d), p.as_ptr().add(r_lo * W));
                match r_hi - r_lo {
                    1 => pv_direct::<S, F, 1>(ar, pr, d, &vptr, nk),
                    2 => pv_direct::<S, F, 2>(ar, pr, d, &vptr, nk),
                    3 => pv_direct::<S, F, 3>(ar, pr, d, &vptr, nk),
                    _ => pv_direct::<S, F, 4>(ar, pr, d, &vptr, nk),
                }
                continue;
            }
            if dpbf16 {
                // Many rows (prefill): P in bf16 (as flash attention's P.V), V re-laid as key
                // pairs, one bf16-pair dot product per two keys: half the FMAs of fp32.
                let njp = nk.div_ceil(2);
                relay_v_pairs::<S, F>(&vptr, njp, d, vp);
                for r in r_lo..r_hi {
                    S::load(p.as_ptr().add(r * W)).store_bf16_pairs(pb.add(r * (W / 2)));
                }
                let mut r = r_lo;
                while r < r_hi {
                    let (ar, pr) = (acch.add(r * d), pb.add(r * (W / 2)) as *const u32);
                    match r_hi - r {
                        1 => S::pv_pairs::<1>(ar, pr, d, vp, njp),
                        2 => S::pv_pairs::<2>(ar, pr, d, vp, njp),
                        3 => S::pv_pairs::<3>(ar, pr, d, vp, njp),
                        _ => S::pv_pairs::<4>(ar, pr, d, vp, njp),
                    }
                    r += 4;
                }
                continue;
            }
            for j in 0..nk {
                for cc in 0..nc {
                    load_v::<S, F>(vptr[j], cc * W).store(vt.as_mut_ptr().add(j * d + cc * W));
                }
            }
            let mut r = r_lo;
            while r < r_hi {
                let (ar, pr) = (acch.add(r * d), p.as_ptr().add(r * W));
                match r_hi - r {
                    1 => pv_rows::<S, 1>(ar, pr, d, vt.as_ptr(), nk),
                    2 => pv_rows::<S, 2>(ar, pr, d, vt.as_ptr(), nk),
                    3 => pv_rows::<S, 3>(ar, pr, d, vt.as_ptr(), nk),
                    _ => pv_rows::<S, 4>(ar, pr, d, vt.as_ptr(), nk),
                }
                r += 4;
            }
        }
        if two_pass {
            let mut mk = [0u16; 4];
            mk[..ntok].copy_from_slice(&masks[..ntok]);
            *tp_tiles.add(two_n) = (mk, nk);
            two_n += 1;
            if two_n == two_tiles {
                two_pass_flush::<S>(tp, two_n, two_tiles, (h1 - h0, hrows, g, d), m, l, acc, pb);
                two_n = 0;
            }
        }
        k0 += W as i64;
    }
    if two_pass && two_n > 0 {
        two_pass_flush::<S>(tp, two_n, two_tiles, (h1 - h0, hrows, g, d), m, l, acc, pb);
    }
    #[cfg(target_arch = "x86_64")]
    if seg {
        let tmask = std::slice::from_raw_parts(seg_tmask, nt);
        for hh in h0..h1 {
            let vth = seg_vt.add((hh - h0) * seg_vt_head);
            if nt % 2 == 1 {
                // the last chunk's missing second tile: V^T zero (0 x V must stay finite)
                for cc in 0..d {
                    std::ptr::write_bytes(vth.add(nt / 2 * d * W + cc * W + 8), 0, 8);
                }
            }
            let sg = crate::cols::Seg {
                kb: seg_kb.add((hh - h0) * nt * W * d),
                vt: vth,
                tmask,
                key_lo,
                first_pos,
                g,
                hrows,
                window: c.window,
                qs: c.scale * kscale_of(hh),
                soft_cap: c.soft_cap,
            };
            let at = (hh - h0) * nblk * W;
            crate::cols::head_seg_d(
                d,
                &sg,
                nblk,
                q_t.add(at * d / 2),
                acc_t.as_mut_ptr().add(at * d),
                m_t.as_mut_ptr().add(at),
                l_t.as_mut_ptr().add(at),
                seg_s,
                seg_p,
            );
        }
    }
    #[cfg(target_arch = "x86_64")]
    if amx {
        crate::amx::release();
    }
    if cols {
        // back to row-major (acc[r][e], m[r], l[r]): 16 x 16 transposes
        for hh in h0..h1 {
            for b in 0..nblk {
                let at = ((hh - h0) * nblk + b) * W;
                let r0 = (hh - h0) * hrows + b * W;
                let n = W.min(hrows - b * W);
                for cc in (0..d).step_by(W) {
                    let mut tile = [S::splat(0.0); W];
                    for (i, t) in tile.iter_mut().enumerate() {
                        *t = S::load(acc_t.as_ptr().add(at * d + (cc + i) * W));
                    }
                    S::transpose(&mut tile);
                    for (lane, v) in tile.iter().enumerate().take(n) {
                        v.store(acc.as_mut_ptr().add((r0 + lane) * d + cc));
                    }
                }
                m[r0..r0 + n].copy_from_slice(&m_t[at..at + n]);
                l[r0..r0 + n].copy_from_slice(&l_t[at..at + n]);
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if vnni {
        for row in acc.chunks_exact_mut(d) {
            crate::vnni::unpermute(row);
        }
    }
    if fp8dec || raw_v::<S, F>() {
        for x in acc.iter_mut() {
            *x *= fp8_post;
        }
    }
    if part >= 0 {
        // Partial layout, token-major: [token][query head][d + 2] = (acc, m, l), so the block
        // of a multi-request (cascade) item is the single-token blocks of its requests.
        let tok_block = hk * g * (d + 2);
        for hh in h0..h1 {
            for i in 0..ntok {
                for gg in 0..g {
                    let r = (hh - h0) * hrows + i * g + gg;
                    let dst = c
                        .partial
                        .add(part as usize + i * tok_block + (hh * g + gg) * (d + 2));
                    std::ptr::copy_nonoverlapping(acc.as_ptr().add(r * d), dst, d);
                    *dst.add(d) = m[r];
                    *dst.add(d + 1) = l[r];
                }
            }
        }
        return;
    }
    for hh in h0..h1 {
        let vs = if c.fp8_scale.is_null() {
            1.0
        } else {
            *c.fp8_scale.add(hk + hh)
        };
        for i in 0..ntok {
            for gg in 0..g {
                let r = (hh - h0) * hrows + i * g + gg;
                let inv = if l[r] > 0.0 { vs / l[r] } else { 0.0 };
                let dst = c.out.add(
                    ((tok0 + i) * c.out_stride_tok + (hh * g + gg) * c.out_stride_head)
                        * c.dt.size(),
                );
                // A vector at a time for fp32 and bf16 (a scalar write with its dtype match
                // per element was ~5 % of a 256-token prefill).
                let (ar, sv) = (acc.as_ptr().add(r * d), S::splat(inv));
                match c.dt {
                    Dt::F32 => {
                        for cc in 0..nc {
                            let v = S::load(ar.add(cc * W)).mul(sv);
                            v.store((dst as *mut f32).add(cc * W));
                        }
                    }
                    Dt::Bf16 => {
                        for cc in 0..nc {
                            let v = S::load(ar.add(cc * W)).mul(sv);
                            v.store_bf16((dst as *mut u16).add(cc * W));
                        }
                    }
                    _ => {
                        for e in 0..d {
                            c.dt.write(dst, e, acc[r * d + e] * inv);
                        }
                    }
                }
            }
        }
    }
}

/// Combine the splits of merge group `grp` for KV head `h` into the output.
pub unsafe fn merge(c: &Call, grp: usize, h: usize) {
    let w = std::slice::from_raw_parts(c.merges.add(5 * grp), 5);
    let (tok0, ntok, nsplit) = (w[0] as usize, w[1] as usize, w[2] as usize);
    let (part, stride) = (w[3] as usize, w[4] as usize);
    let d = c.head_dim;
    let g = c.num_q_heads / c.num_kv_heads;
    let rows = ntok * g;
    let tok_block = c.num_kv_heads * g * (d + 2);
    let vs = if c.fp8_scale.is_null() {
        1.0
    } else {
        *c.fp8_scale.add(c.num_kv_heads + h)
    };
    for r in 0..rows {
        let at = |s: usize| {
            c.partial
                .add(part + s * stride + (r / g) * tok_block + (h * g + r % g) * (d + 2))
        };
        let mut m = f32::NEG_INFINITY;
        for s in 0..nsplit {
            m = m.max(*at(s).add(d));
        }
        let mut l = 0.0f32;
        let mut wts = [0f32; 256];
        for (s, wt) in wts.iter_mut().enumerate().take(nsplit) {
            let ms = *at(s).add(d);
            *wt = if ms == f32::NEG_INFINITY {
                0.0
            } else {
                (ms - m).exp()
            };
            l += *wt * *at(s).add(d + 1);
        }
        let inv = if l > 0.0 { vs / l } else { 0.0 };
        let (i, gg) = (r / g, r % g);
        let dst = c
            .out
            .add(((tok0 + i) * c.out_stride_tok + (h * g + gg) * c.out_stride_head) * c.dt.size());
        for e in 0..d {
            let mut o = 0.0f32;
            for (s, wt) in wts.iter().enumerate().take(nsplit) {
                o += *wt * *at(s).add(e);
            }
            c.dt.write(dst, e, o * inv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prefetch schedule of a tile: one head keeps its measured split; several spread the 16
    /// keys over every point (rising, a few keys each, all 16 by the last head's softmax).
    #[test]
    fn prefetch_points_cover_the_tile_evenly() {
        for eb in [1, 2, 4] {
            let (a, b) = pf_split(eb);
            assert_eq!([0, 1, 2].map(|pt| pf_goal(eb, 1, pt)), [a, b, W as i64]);
            assert_eq!(pf_ahead(1, eb), PREFETCH_KEYS);
            for nh in 2..=8 {
                let goals: Vec<i64> = (0..=2 * nh).map(|pt| pf_goal(eb, nh, pt)).collect();
                assert_eq!(*goals.last().unwrap(), W as i64);
                let steps: Vec<i64> = goals.windows(2).map(|w| w[1] - w[0]).collect();
                assert!(goals[0] > 0 && steps.iter().all(|&s| s >= 0), "{goals:?}");
                assert!(goals[0] <= 6 && steps.iter().all(|&s| s <= 6), "{goals:?}");
                let ahead = pf_ahead(nh, eb);
                assert!(ahead >= W as i64 && ahead % W as i64 == 0 && ahead <= PREFETCH_KEYS);
            }
        }
        assert_eq!(pf_ahead(3, 2), 16); // bf16 over SmolLM2's 3 KV heads (measured)
        assert_eq!(pf_ahead(3, 4), 16);
        assert_eq!(pf_ahead(3, 1), 32);
    }
}
