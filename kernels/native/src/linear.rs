//! Small-batch bf16 linear `y = x W^T (+ b)`: the GEMMs of a decode step, which read every
//! weight once for a few rows and so run at the speed weights stream from memory.
//!
//! The weight is packed once (`kvcore_kernels/linear_cpu.py`) into panels of `NB` = 32 output
//! columns; a panel holds `K / 2` rows of 32 dwords, dword `j` of row `kp` being the bf16 pair
//! `(W[n0 + j][2 kp], W[n0 + j][2 kp + 1])` (the low half is the even `k`):
//!
//! ```text
//! panel p (columns 32p .. 32p + 31):  kp = 0: [W[n][0..2] for n in 32p..32p+32]   128 bytes
//!                                     kp = 1: [W[n][2..4] ...]                     128 bytes
//!                                     ...  K / 2 rows, one sequential stream
//! ```
//!
//! so a panel is one sequential stream and each 64-byte load is 16 columns x 2 inputs: one AVX-512
//! BF16 dot product (`vdpbf16ps`) per load and row of `x`, the row's pair broadcast. Columns past
//! `N` (the last panel's padding) are zero and never stored. Rows run in chunks of up to `MR` = 8
//! (16 fp32 accumulators); a panel's later chunks read it again from L1/L2, not memory.
//!
//! **Gated (`glu`)**: a gate-up weight `[gate | up]` (`2 I` rows) packed with gate panel `i` and up
//! panel `i` adjacent (`pack_linear(w, glu=True)`); each pair of panels gives 32 columns of
//! `bf16(bf16(silu(bf16(g))) * bf16(u))`, the bits `ops.rs`'s `SiluMul` makes from the plain
//! product's bf16 output, without writing or reading that `[M, 2 I]` intermediate.
//!
//! **AMX** (`amx`, Sapphire Rapids and later, calls of more than `AMX_MIN_ROWS` rows): the same
//! panels as B tiles, up to three 16-row tiles of `x` per panel stream, the AVX-512 epilogue.
//!
//! **AVX2** (`avx2`, no AVX-512 BF16: a Zen 3): plain or gated panels, each 32-byte load widened to
//! fp32 (a shift for the even input, a mask for the odd) and two FMAs per row; half the bytes of
//! the fp32 copy such a CPU otherwise runs bf16 weights on; a chunk's rows of `x` are widened
//! once into per-thread scratch (grown, never freed). ~150 GFLOP/s on two threads (a Zen 3).
//! From `TALL_ROWS` (12) rows the AVX2 path runs a blocked GEMM instead (`tall`:
//! rows and panels widened once per task, a 6 x 16 fp32 tile) with the same bits.
//!
//! Invariants: `K` is even; `x` rows hold `K` bf16 (unit stride), `out` rows `N` bf16. Results
//! are fp32 sums of bf16 products rounded once to bf16 (round to nearest even), like oneDNN's;
//! the summation order differs from it, so bits may differ in the last place. Tasks are runs of
//! panels (above `MR` rows on the AVX-512 path: pairs of panels over blocks of rows,
//! `Linear::row_blocks`) claimed dynamically on the pool; nothing is allocated per call. Cost: `K * N * 2`
//! bytes of weight read once per call, `M * N * K / 16` dot-product instructions.

use crate::simd::{bf16_to_f32, f32_to_bf16};

/// Output columns per panel.
pub const NB: usize = 32;
/// Rows of `x` per accumulator chunk, one panel at a time (16 accumulators).
pub const MR: usize = 8;
/// Rows per chunk, two panels at a time (24 accumulators).
pub const MR2: usize = 6;
/// Bytes of weight a task streams (about): small enough to balance two threads on a 576-wide
/// projection, large enough that a task is not dominated by its start.
pub const TASK_BYTES: usize = 96 * 1024;

/// One call: `out[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n])` for `m < rows`, `n < n_out`.
#[derive(Clone, Copy)]
pub struct Linear {
    pub x: *const u16,
    pub x_stride: usize,
    pub rows: usize,
    pub k: usize,
    /// The packed weight: `n_out.div_ceil(NB)` panels of `k / 2 * NB` dwords.
    pub w: *const u32,
    pub n_out: usize,
    /// bf16 `[n_out]` or null.
    pub bias: *const u16,
    pub out: *mut u16,
    pub out_stride: usize,
    /// Gated: `n_out` is `I`, the panels alternate gate / up (`2 * I.div_ceil(NB)` of them),
    /// `bias` is null.
    pub glu: bool,
}

unsafe impl Send for Linear {}
unsafe impl Sync for Linear {}

impl Linear {
    pub fn panels(&self) -> usize {
        self.n_out.div_ceil(NB) * if self.glu { 2 } else { 1 }
    }

    /// Panels per task: whole gate / up pairs when gated, and at least two above `MR` rows, so
    /// that every chunk takes the two-panel kernel (24 accumulators, 4 weight loads and 6
    /// broadcasts per 24 dot products, against 2 and 8 per 16 on one panel). A 1,536-wide
    /// weight (SmolLM2's down projection) was one panel a task, every chunk on one panel.
    /// `paired`: the call runs on the AVX-512 BF16 panels (`avx512`), not AMX tiles or AVX2.
    pub fn panels_per_task(&self, paired: bool) -> usize {
        let per = (TASK_BYTES / (self.k * NB * 2).max(1)).max(1);
        if self.glu || (paired && self.rows > MR) {
            (per & !1).max(2)
        } else {
            per
        }
    }

    /// Row blocks of a call: `(blocks, rows per block)`. One block up to `MR` rows (a task
    /// streams its panels once for all rows). Above it, blocks of about `BLOCK_ROWS` rows (a
    /// multiple of `MR2`), and more (down to `2 * MR2` rows) until there are `TASKS_PER_THREAD`
    /// tasks a thread, so two threads balance on a call of few panel tasks (SmolLM2's down
    /// projection: 9 pairs). A block's rows and its panels stay in L2 (132 rows of a 1,536-wide
    /// `x`: 396 KiB, two panels 192 KiB), where a prefill chunk's whole `x` (3 MiB at 1,024
    /// rows) was read again from L3 for every pair of panels. The bits do not depend on the
    /// blocks: each output is one chunk's sum over `k` in order.
    pub fn row_blocks(&self, threads: usize, paired: bool) -> (usize, usize) {
        if !paired || self.rows <= MR {
            return (1, self.rows.max(1));
        }
        let tasks = self.panels().div_ceil(self.panels_per_task(paired));
        let want = (TASKS_PER_THREAD * threads).div_ceil(tasks);
        let most = (self.rows / (2 * MR2)).max(1); // blocks of at least 2 * MR2 rows
        let blocks = self.rows.div_ceil(BLOCK_ROWS).max(want).min(most);
        let per = self.rows.div_ceil(blocks).div_ceil(MR2) * MR2;
        (self.rows.div_ceil(per), per)
    }

    /// Rows `m0 .. m0 + rows` of this call (clamped to its rows) as a call of its own.
    pub fn rows_from(&self, m0: usize, rows: usize) -> Linear {
        let m0 = m0.min(self.rows);
        Linear {
            // SAFETY: `m0 <= rows`, so both stay within (or one past) the call's buffers
            x: unsafe { self.x.add(m0 * self.x_stride) },
            out: unsafe { self.out.add(m0 * self.out_stride) },
            rows: rows.min(self.rows - m0),
            ..*self
        }
    }
}

/// Rows of a row block (about; `Linear::row_blocks`).
pub const BLOCK_ROWS: usize = 128;
/// Tasks per thread a call of many rows is cut into at least (`Linear::row_blocks`).
pub const TASKS_PER_THREAD: usize = 8;

/// `bf16(bf16(silu(g)) * u)` of bf16-rounded `g`, `u` (as `ops.rs`'s `SiluMul` rounds).
#[inline(always)]
fn silu_mul(g: f32, u: f32) -> u16 {
    let g = bf16_to_f32(f32_to_bf16(g));
    let u = bf16_to_f32(f32_to_bf16(u));
    let s = bf16_to_f32(f32_to_bf16(g / (1.0 + (-g).exp())));
    f32_to_bf16(s * u)
}

/// Panels `lo .. hi`, portable: the same packed layout, fp32 products summed pair by pair.
pub unsafe fn run_panels_portable(c: &Linear, lo: usize, hi: usize) {
    let kp_n = c.k / 2;
    let dot = |p: usize, x: *const u16| {
        let panel = c.w.add(p * kp_n * NB);
        let mut acc = [0f32; NB];
        for kp in 0..kp_n {
            let (x0, x1) = (bf16_to_f32(*x.add(2 * kp)), bf16_to_f32(*x.add(2 * kp + 1)));
            let row = panel.add(kp * NB);
            for j in 0..NB {
                let pair = *row.add(j);
                let (w0, w1) = (bf16_to_f32(pair as u16), bf16_to_f32((pair >> 16) as u16));
                acc[j] += x0 * w0 + x1 * w1;
            }
        }
        acc
    };
    let step = if c.glu { 2 } else { 1 };
    let mut p = lo;
    while p < hi {
        let n0 = p / step * NB;
        let cols = NB.min(c.n_out - n0);
        for m in 0..c.rows {
            let x = c.x.add(m * c.x_stride);
            let out = c.out.add(m * c.out_stride + n0);
            let acc = dot(p, x);
            if c.glu {
                let up = dot(p + 1, x);
                for j in 0..cols {
                    *out.add(j) = silu_mul(acc[j], up[j]);
                }
                continue;
            }
            for j in 0..cols {
                let b = if c.bias.is_null() {
                    0.0
                } else {
                    bf16_to_f32(*c.bias.add(n0 + j))
                };
                *out.add(j) = f32_to_bf16(acc[j] + b);
            }
        }
        p += step;
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    use super::{Linear, MR, MR2, NB};
    use crate::simd::{Avx512, Simd};
    use std::arch::x86_64::*;

    /// Prefetch distance in bytes ahead of the panel row being read (first chunk only).
    const PREFETCH: usize = 2048;

    /// `R` rows starting at `m0` of `P` adjacent panels from `p` (`2 P` columns of 16 each).
    #[inline(always)]
    unsafe fn chunk<const R: usize, const P: usize>(
        c: &Linear,
        p: usize,
        m0: usize,
        pf: bool,
        nx: (*const u8, usize),
    ) {
        let kp_n = c.k / 2;
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        let mut x = [std::ptr::null::<u16>(); R];
        for r in 0..R {
            x[r] = c.x.add((m0 + r) * c.x_stride);
        }
        let panel = c.w.add(p * kp_n * NB);
        // the next panels' lines this chunk asks for (into L2), a few per `kp`
        let (nx_ptr, nx_lines) = nx;
        let stride = kp_n * NB; // dwords from one panel to the next
        let nx_per = nx_lines.div_ceil(kp_n);
        for kp in 0..kp_n {
            let row = panel.add(kp * NB);
            for l in kp * nx_per..((kp + 1) * nx_per).min(nx_lines) {
                _mm_prefetch::<_MM_HINT_T1>(nx_ptr.add(64 * l) as *const i8);
            }
            let mut w = [_mm512_setzero_si512(); 4];
            for q in 0..P {
                let rq = row.add(q * stride);
                if pf {
                    let ahead = (rq as *const i8).add(PREFETCH);
                    _mm_prefetch::<_MM_HINT_T0>(ahead);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.add(64));
                }
                w[2 * q] = _mm512_loadu_si512(rq as *const _);
                w[2 * q + 1] = _mm512_loadu_si512(rq.add(16) as *const _);
            }
            for r in 0..R {
                let pair = (x[r].add(2 * kp) as *const i32).read_unaligned();
                let xb: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                for v in 0..2 * P {
                    let wv: __m512bh = std::mem::transmute(w[v]);
                    acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, wv);
                }
            }
        }
        if c.glu {
            return store_glu::<R>(c, p, m0, &acc);
        }
        for q in 0..P {
            let n0 = (p + q) * NB;
            let (mask0, mask1) = col_masks(c, n0);
            let (b0, b1) = bias_pair(c, n0, (mask0, mask1));
            for r in 0..R {
                let out = c.out.add((m0 + r) * c.out_stride + n0);
                let lo = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][2 * q], b0));
                let hi = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][2 * q + 1], b1));
                let (lo, hi) = (
                    std::mem::transmute::<__m256bh, __m256i>(lo),
                    std::mem::transmute::<__m256bh, __m256i>(hi),
                );
                _mm256_mask_storeu_epi16(out as *mut _, mask0, lo);
                _mm256_mask_storeu_epi16(out.add(16) as *mut _, mask1, hi);
            }
        }
    }

    /// Gated epilogue of rows `m0 .. m0 + R` of the gate / up pair at panels `p`, `p + 1`:
    /// 32 columns of `bf16(bf16(silu(bf16(g))) * bf16(u))`, the rounding of `ops.rs`'s
    /// `SiluMul` on the plain product's bf16 output.
    #[inline(always)]
    unsafe fn store_glu<const R: usize>(c: &Linear, p: usize, m0: usize, acc: &[[__m512; 4]; R]) {
        let n0 = p / 2 * NB;
        let (mask0, mask1) = col_masks(c, n0);
        for r in 0..R {
            let out = c.out.add((m0 + r) * c.out_stride + n0);
            for h in 0..2 {
                let mask = if h == 0 { mask0 } else { mask1 };
                _mm256_mask_storeu_epi16(
                    out.add(16 * h) as *mut _,
                    mask,
                    silu_mul(acc[r][h], acc[r][2 + h]),
                );
            }
        }
    }

    /// The write masks of the 32 columns from `n0` (columns past `n_out` are not stored).
    #[inline(always)]
    pub(super) fn col_masks(c: &Linear, n0: usize) -> (u16, u16) {
        let cols = NB.min(c.n_out - n0);
        if cols == NB {
            (0xffff, 0xffff)
        } else {
            let m = (1u32 << cols) - 1;
            (m as u16, (m >> 16) as u16)
        }
    }

    /// The bias of the 32 columns from `n0` as two fp32 halves (zero without a bias).
    #[inline(always)]
    pub(super) unsafe fn bias_pair(c: &Linear, n0: usize, masks: (u16, u16)) -> (__m512, __m512) {
        if c.bias.is_null() {
            return (_mm512_setzero_ps(), _mm512_setzero_ps());
        }
        let lo = _mm256_maskz_loadu_epi16(masks.0, c.bias.add(n0) as *const _);
        let hi = _mm256_maskz_loadu_epi16(masks.1, c.bias.add(n0 + 16) as *const _);
        (widen(lo), widen(hi))
    }

    /// 16 columns of `bf16(bf16(silu(bf16(g))) * bf16(u))` from fp32 sums `g`, `u`.
    #[inline(always)]
    pub(super) unsafe fn silu_mul(g: __m512, u: __m512) -> __m256i {
        type V = Avx512<true>;
        let g = Avx512::<true>(g).round_bf16();
        let u = Avx512::<true>(u).round_bf16();
        let e = g.mul(V::splat(-1.0)).exp();
        let s = g.div(V::splat(1.0).add(e)).round_bf16();
        std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(s.mul(u).0))
    }

    /// 16 bf16 -> 16 fp32 (exact).
    #[inline(always)]
    unsafe fn widen(h: __m256i) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    /// Panels `lo .. hi`, all rows: one panel at a time for up to `MR` rows (the weight's
    /// stream is the bound), two at a time in chunks of `MR2` rows above that (fewer loads
    /// per dot product: the instructions are the bound).
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
    pub unsafe fn run_panels(c: &Linear, lo: usize, hi: usize, next: Option<(usize, usize)>) {
        let kp_n = c.k / 2;
        let panel_lines = kp_n * NB * 4 / 64;
        let mut p = lo;
        while p < hi {
            let two = (c.rows > MR || c.glu) && p + 1 < hi; // gated: always a gate / up pair
            let step = if two { 2 } else { 1 };
            let rows_per = if two { MR2 } else { MR };
            // The panels after these (this task's, else the next task's): their lines are
            // asked for across this step's later chunks, which read their panels from L2 and
            // leave the memory idle; the first chunk then finds them in L2 too.
            let (n_lo, n_hi) = if p + step < hi {
                (p + step, (p + 2 * step).min(hi))
            } else {
                next.unwrap_or((0, 0))
            };
            let n_hi = n_hi.min(n_lo + step);
            let chunks = c.rows.div_ceil(rows_per);
            let nx_total = if chunks > 1 && pf_next() {
                (n_hi - n_lo) * panel_lines
            } else {
                0
            };
            let nx_base = c.w.add(n_lo * kp_n * NB) as *const u8;
            let mut m0 = 0;
            let mut ci = 0;
            while m0 < c.rows {
                let pf = m0 == 0; // later chunks find the panel in L1/L2
                let nx = if ci == 0 || nx_total == 0 {
                    (nx_base, 0)
                } else {
                    let (a, b) = (
                        (ci - 1) * nx_total / (chunks - 1),
                        ci * nx_total / (chunks - 1),
                    );
                    (nx_base.add(64 * a), b - a)
                };
                ci += 1;
                if two {
                    let r = MR2.min(c.rows - m0);
                    match r {
                        1 => chunk::<1, 2>(c, p, m0, pf, nx),
                        2 => chunk::<2, 2>(c, p, m0, pf, nx),
                        3 => chunk::<3, 2>(c, p, m0, pf, nx),
                        4 => chunk::<4, 2>(c, p, m0, pf, nx),
                        5 => chunk::<5, 2>(c, p, m0, pf, nx),
                        _ => chunk::<6, 2>(c, p, m0, pf, nx),
                    }
                    m0 += r;
                } else {
                    let r = MR.min(c.rows - m0);
                    match r {
                        1 => chunk::<1, 1>(c, p, m0, pf, nx),
                        2 => chunk::<2, 1>(c, p, m0, pf, nx),
                        3 => chunk::<3, 1>(c, p, m0, pf, nx),
                        4 => chunk::<4, 1>(c, p, m0, pf, nx),
                        5 => chunk::<5, 1>(c, p, m0, pf, nx),
                        6 => chunk::<6, 1>(c, p, m0, pf, nx),
                        7 => chunk::<7, 1>(c, p, m0, pf, nx),
                        _ => chunk::<8, 1>(c, p, m0, pf, nx),
                    }
                    m0 += r;
                }
            }
            p += step;
        }
    }

    /// Whether the next panels are prefetched (`KVCORE_LINEAR_PREFETCH_NEXT=0` turns it off).
    pub(super) fn pf_next() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("KVCORE_LINEAR_PREFETCH_NEXT").map_or(true, |v| v != "0"))
    }
}

/// Row `m`, columns `n .. n + sums.len()` of the output: each fp32 sum plus the bias, rounded
/// once to bf16. The epilogue of both AVX2 paths (`avx2`, `tall`), so they give the same bits.
#[inline(always)]
unsafe fn store_row(c: &Linear, sums: &[f32], m: usize, n: usize) {
    let out = c.out.add(m * c.out_stride + n);
    for (j, &s) in sums.iter().enumerate() {
        let b = if c.bias.is_null() {
            0.0
        } else {
            crate::simd::bf16_to_f32(*c.bias.add(n + j))
        };
        *out.add(j) = crate::simd::f32_to_bf16(s + b);
    }
}

/// Row `m`, columns `n .. n + cols` (`cols <= 16`) of a gated output from its gate and up
/// sums: `bf16(bf16(silu(bf16(g))) * bf16(u))`, the arithmetic of `ops.rs`'s `SiluMul` on the
/// plain product's bf16 output (the same vector `exp`), so the same bits as those two calls.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_glu16(
    c: &Linear,
    g: crate::avx2::Avx2,
    u: crate::avx2::Avx2,
    m: usize,
    n: usize,
    cols: usize,
) {
    use crate::simd::Simd;
    type V = crate::avx2::Avx2;
    let (g, u) = (g.round_bf16(), u.round_bf16());
    let e = g.mul(V::splat(-1.0)).exp();
    let h = g.div(V::splat(1.0).add(e)).round_bf16().mul(u);
    let out = c.out.add(m * c.out_stride + n);
    if cols == 16 {
        h.store_bf16(out);
    } else {
        let mut t = [0u16; 16];
        h.store_bf16(t.as_mut_ptr());
        std::ptr::copy_nonoverlapping(t.as_ptr(), out, cols);
    }
}

/// The same panels on AVX2 + FMA (no bf16 dot product: a Zen 3, where oneDNN has no bf16 GEMM
/// and kvcore's bf16 weights otherwise run as fp32 copies). Each 32-byte load is 8 columns x 2
/// inputs, widened to fp32 by a shift (the even input's weights) and a mask (the odd one's),
/// then two FMAs per row against the row's two inputs, broadcast from the chunk's rows widened
/// to fp32 once (per-thread scratch).
/// Rows run in chunks of up to `MR` = 2 (8 accumulators of 8 columns; 3 registers for the
/// weights being widened, 2 for the inputs); later chunks read the panel again from L1/L2.
/// A gated pack runs its gate and up panels of a chunk in turn and writes `silu(g) * u`
/// (`store_glu16`); no `[M, 2 I]` product is written. The sums are the exact
/// bf16 x bf16 products added in fp32, as the fp32 GEMM on upcast copies adds them, in another
/// order.
#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::{Linear, NB};
    use crate::avx2::Avx2;
    use std::arch::x86_64::*;

    /// Rows per chunk.
    pub const MR: usize = 2;

    thread_local! {
        /// A task's rows of `x` as fp32.
        static XS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    /// Prefetch distance in bytes ahead of the panel row being read (first chunk only).
    const PREFETCH: usize = 2048;

    /// `R` rows from `m0` of panel `p`: their fp32 sums, 32 columns each; `xs` holds all rows
    /// of `x` widened to fp32 (`k` apart).
    #[inline(always)]
    unsafe fn chunk<const R: usize>(
        c: &Linear,
        xs: *const f32,
        p: usize,
        m0: usize,
        pf: bool,
    ) -> [[__m256; 4]; R] {
        let kp_n = c.k / 2;
        let k = c.k;
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let hi = _mm256_set1_epi32(-65536);
        let xs = xs.add(m0 * k);
        let panel = c.w.add(p * kp_n * NB);
        for kp in 0..kp_n {
            let row = panel.add(kp * NB);
            if pf {
                let ahead = (row as *const i8).add(PREFETCH);
                _mm_prefetch::<_MM_HINT_T0>(ahead);
                _mm_prefetch::<_MM_HINT_T0>(ahead.add(64));
            }
            let mut xe = [_mm256_setzero_ps(); R];
            let mut xo = [_mm256_setzero_ps(); R];
            for r in 0..R {
                xe[r] = _mm256_broadcast_ss(&*xs.add(r * k + 2 * kp));
                xo[r] = _mm256_broadcast_ss(&*xs.add(r * k + 2 * kp + 1));
            }
            for q in 0..4 {
                let w = _mm256_loadu_si256(row.add(8 * q) as *const __m256i);
                let we = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w));
                let wo = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
                for r in 0..R {
                    acc[r][q] = _mm256_fmadd_ps(xe[r], we, acc[r][q]);
                    acc[r][q] = _mm256_fmadd_ps(xo[r], wo, acc[r][q]);
                }
            }
        }
        acc
    }

    /// `R` rows from `m0` of plain panel `p`, or of gated pair `p` (gate), `p + 1` (up).
    #[inline(always)]
    unsafe fn rows<const R: usize>(c: &Linear, xs: *const f32, p: usize, m0: usize, pf: bool) {
        let sums = chunk::<R>(c, xs, p, m0, pf);
        if c.glu {
            let up = chunk::<R>(c, xs, p + 1, m0, pf);
            let n0 = p / 2 * NB;
            let cols = NB.min(c.n_out - n0);
            for r in 0..R {
                for h in 0..2 {
                    let n = n0 + 16 * h;
                    if n < n0 + cols {
                        let g = Avx2(sums[r][2 * h], sums[r][2 * h + 1]);
                        let u = Avx2(up[r][2 * h], up[r][2 * h + 1]);
                        super::store_glu16(c, g, u, m0 + r, n, (n0 + cols - n).min(16));
                    }
                }
            }
            return;
        }
        let n0 = p * NB;
        let cols = NB.min(c.n_out - n0);
        let mut buf = [0f32; NB];
        for (r, a) in sums.iter().enumerate() {
            for (q, v) in a.iter().enumerate() {
                _mm256_storeu_ps(buf.as_mut_ptr().add(8 * q), *v);
            }
            super::store_row(c, &buf[..cols], m0 + r, n0);
        }
    }

    /// Panels `lo .. hi`, all rows, `MR` rows at a time. The rows of `x` are widened to fp32
    /// once per task (per-thread scratch, grown, never freed), so that each input is one
    /// broadcast load in the loop, not a broadcast and a widening.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn run_panels(c: &Linear, lo: usize, hi: usize) {
        let k = c.k;
        let xs = XS.with(|cell| {
            let mut v = cell.borrow_mut();
            if v.len() < c.rows * k {
                v.resize(c.rows * k, 0.0);
            }
            v.as_mut_ptr()
        });
        for m in 0..c.rows {
            let x = c.x.add(m * c.x_stride);
            for i in 0..k {
                *xs.add(m * k + i) = crate::simd::bf16_to_f32(*x.add(i));
            }
        }
        let step = if c.glu { 2 } else { 1 };
        for p in (lo..hi).step_by(step) {
            let mut m0 = 0;
            while m0 < c.rows {
                let pf = m0 == 0; // later chunks find the panel in L1/L2
                if c.rows - m0 >= 2 {
                    rows::<2>(c, xs, p, m0, pf);
                    m0 += 2;
                } else {
                    rows::<1>(c, xs, p, m0, pf);
                    m0 += 1;
                }
            }
        }
    }
}

/// Many rows on AVX2 + FMA (prefill chunks): a blocked GEMM over the same panels (gated: the
/// tile runs over the gate half, then the up half, and `store_glu16` writes `silu(g) * u`).
///
/// The small-row path above widens every row of `x` in each task and reads it from memory for
/// each panel, which at 512-2,048 rows ran at 42-76 GFLOP/s on a Zen 3 (one thread) against
/// 60-77 for MKL / oneDNN on fp32 copies (`benches/tools/linear_avx2_bf16.py`). Here, the
/// GotoBLAS order (as BLIS's Zen kernels): a task is a block of `block_rows` rows and a run of
/// panels; the block's rows are widened once to fp32 (row-major; the block sized to stay in
/// L2), each panel is widened once into two halves `[k][16]` fp32 (by the first tile that reads
/// it, `micro_widen`), and a 6 x 16 register tile (12 accumulators, 2 weight loads and 6
/// broadcasts per input) runs over the full `k`. The
/// sum of each output is `fma` over `k` ascending from zero, the order of the small-row path:
/// the same bits for a row whatever path or batch it runs in.
///
/// Scratch: per-thread, grown, never freed. Tasks are claimed dynamically (a slowed core takes
/// fewer). Cost per task: `block_rows * k` widenings of `x` and `panels * k * 32` of weights,
/// against `block_rows * panels * 32 * k` FMAs.
#[cfg(target_arch = "x86_64")]
pub mod tall {
    use super::{Linear, NB};
    use crate::avx2::Avx2;
    use std::arch::x86_64::*;

    /// Rows per register tile.
    pub const MR: usize = 6;
    /// Pack rows (128 bytes each) ahead of the first tile that it prefetches.
    const PF_ROWS: usize = 12;
    /// Bytes of widened rows a task keeps (about half a Zen 3 L2, beside one widened panel).
    pub const BLOCK_BYTES: usize = 256 * 1024;
    /// Tasks a call aims for (dynamic claiming balances two threads with a slowed one).
    pub const TASKS: usize = 32;
    /// Panels a task takes at least (its rows' widening is about `1 / (32 * panels)` of its FMAs).
    pub const MIN_PANELS: usize = 4;

    thread_local! {
        static AS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        static BS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// Rows per block for this `k` (a multiple of `MR`).
    pub fn block_rows(k: usize) -> usize {
        (BLOCK_BYTES / (4 * k.max(1)) / MR * MR).clamp(MR, 32 * MR)
    }

    /// `(row blocks, panels per task, tasks)` for this call.
    pub fn plan(c: &Linear) -> (usize, usize, usize) {
        let blocks = c.rows.div_ceil(block_rows(c.k));
        let panels = c.panels();
        // at least MIN_PANELS per task: each task widens its block's rows once
        let per = (panels * blocks)
            .div_ceil(TASKS)
            .max(MIN_PANELS)
            .min(panels);
        let per = if c.glu { per.next_multiple_of(2) } else { per }; // whole gate / up pairs
        (blocks, per, blocks * panels.div_ceil(per))
    }

    /// Grow a per-thread scratch to `n` floats; its pointer.
    fn scratch(
        cell: &'static std::thread::LocalKey<std::cell::RefCell<Vec<f32>>>,
        n: usize,
    ) -> *mut f32 {
        cell.with(|c| {
            let mut v = c.borrow_mut();
            if v.len() < n {
                v.resize(n, 0.0);
            }
            v.as_mut_ptr()
        })
    }

    /// Task `t` of `plan(c)`: its row block, its run of panels.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn run_task(c: &Linear, t: usize) {
        let (_, per, _) = plan(c);
        let panels = c.panels();
        let groups = panels.div_ceil(per);
        let (blk, g) = (t / groups, t % groups);
        let br = block_rows(c.k);
        let m0 = blk * br;
        let rows = br.min(c.rows - m0);
        let k = c.k;
        let tiles = rows.div_ceil(MR);
        // the block's rows widened to fp32, row-major (`k` apart), padded with zero rows to
        // whole tiles: a straight vector loop; the tile reads them as 6 sequential streams
        let a = scratch(&AS, tiles * MR * k);
        for m in 0..tiles * MR {
            let dst = std::slice::from_raw_parts_mut(a.add(m * k), k);
            if m < rows {
                let x = std::slice::from_raw_parts(c.x.add((m0 + m) * c.x_stride), k);
                for (d, &v) in dst.iter_mut().zip(x) {
                    *d = f32::from_bits((v as u32) << 16);
                }
            } else {
                dst.fill(0.0);
            }
        }
        // a plain panel, or a gated pair (gate, then up: its halves 2 and 3)
        let step = if c.glu { 2 } else { 1 };
        let b = scratch(&BS, 2 * step * k * 16);
        for p in (g * per..((g + 1) * per).min(panels)).step_by(step) {
            let n0 = p / step * NB;
            let cols = NB.min(c.n_out - n0);
            let halves = cols.div_ceil(16);
            for h in 0..halves {
                let bh = b.add(h * k * 16);
                let n = n0 + 16 * h;
                let cn = (cols - 16 * h).min(16);
                // the half's weights (and the up half's) at their first tile, widened there
                let wh = |i: usize| c.w.add((p + i) * (k / 2) * NB + 16 * h);
                for tile in 0..tiles {
                    let at = a.add(tile * MR * k);
                    let acc = if tile == 0 {
                        micro_widen(at, wh(0), k, bh)
                    } else {
                        micro(at, bh, k)
                    };
                    let r_n = MR.min(rows - tile * MR);
                    let m = m0 + tile * MR;
                    if c.glu {
                        let up = if tile == 0 {
                            micro_widen(at, wh(1), k, bh.add(2 * k * 16))
                        } else {
                            micro(at, bh.add(2 * k * 16), k)
                        };
                        for r in 0..r_n {
                            let g = Avx2(acc[r][0], acc[r][1]);
                            let u = Avx2(up[r][0], up[r][1]);
                            super::store_glu16(c, g, u, m + r, n, cn);
                        }
                    } else {
                        store(c, &acc, m, r_n, n, cn);
                    }
                }
            }
        }
    }

    /// `micro` on a panel half read from the pack (`w`: its first dword, `k / 2` rows `NB`
    /// dwords apart, 16 bf16 pairs used of each), each pair of inputs widened in registers (the
    /// even one by a shift, the odd one by a mask) and stored to `bh` as `[k][16]` fp32 for the
    /// block's later tiles. The widening's loads and stores run beside the first tile's FMAs
    /// instead of in a pass of their own, and the pack rows `PF_ROWS` ahead are prefetched (this
    /// half reads every other cache line of the pack, a stride the hardware prefetcher did not
    /// cover: without it the first tile waited on memory and the call ran 2-8 % slower at 48
    /// rows than with the separate pass).
    #[inline(always)]
    unsafe fn micro_widen(
        ap: *const f32,
        w: *const u32,
        k: usize,
        bh: *mut f32,
    ) -> [[__m256; 2]; MR] {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        let hi_mask = _mm256_set1_epi32(-65536);
        for kp in 0..k / 2 {
            let row = w.add(kp * NB) as *const __m256i;
            // past the panel's end this is the next panel's (or no) memory: a prefetch never
            // faults, and `wrapping_add` keeps the address arithmetic defined
            let ahead = w.wrapping_add((kp + PF_ROWS) * NB) as *const i8;
            _mm_prefetch::<_MM_HINT_T0>(ahead);
            _mm_prefetch::<_MM_HINT_T0>(ahead.add(64));
            let dst = bh.add(32 * kp);
            for (j, odd) in [(2 * kp, false), (2 * kp + 1, true)] {
                let (w0, w1) = (_mm256_loadu_si256(row), _mm256_loadu_si256(row.add(1)));
                let (b0, b1) = if odd {
                    (_mm256_and_si256(w0, hi_mask), _mm256_and_si256(w1, hi_mask))
                } else {
                    (_mm256_slli_epi32::<16>(w0), _mm256_slli_epi32::<16>(w1))
                };
                let (b0, b1) = (_mm256_castsi256_ps(b0), _mm256_castsi256_ps(b1));
                let o = if odd { 16 } else { 0 };
                _mm256_storeu_ps(dst.add(o), b0);
                _mm256_storeu_ps(dst.add(o + 8), b1);
                for (r, a) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*ap.add(r * k + j));
                    a[0] = _mm256_fmadd_ps(x, b0, a[0]);
                    a[1] = _mm256_fmadd_ps(x, b1, a[1]);
                }
            }
        }
        acc
    }

    /// The 6 x 16 tile over all `k`: `ap` 6 fp32 rows `k` apart, `bh` `[k][16]`.
    #[inline(always)]
    unsafe fn micro(ap: *const f32, bh: *const f32, k: usize) -> [[__m256; 2]; MR] {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        for i in 0..k {
            let b0 = _mm256_loadu_ps(bh.add(16 * i));
            let b1 = _mm256_loadu_ps(bh.add(16 * i + 8));
            for (r, a) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*ap.add(r * k + i));
                a[0] = _mm256_fmadd_ps(x, b0, a[0]);
                a[1] = _mm256_fmadd_ps(x, b1, a[1]);
            }
        }
        acc
    }

    /// Rows `m .. m + r_n`, columns `n .. n + cols` of the output from a tile (bias added, one
    /// rounding to bf16, as the small-row path).
    #[inline(always)]
    unsafe fn store(
        c: &Linear,
        acc: &[[__m256; 2]; MR],
        m: usize,
        r_n: usize,
        n: usize,
        cols: usize,
    ) {
        let mut buf = [0f32; 16];
        for (r, a) in acc.iter().enumerate().take(r_n) {
            _mm256_storeu_ps(buf.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(buf.as_mut_ptr().add(8), a[1]);
            super::store_row(c, &buf[..cols], m + r, n);
        }
    }
}

/// AMX tiles (Sapphire Rapids and later) on the same panels, for calls of more than
/// `AMX_MIN_ROWS` rows: a panel's 16 `kp` rows x 16 columns are a B tile as packed (row stride
/// 128 bytes), 16 rows of `x` x 32 inputs an A tile; up to three 16-row tiles times a panel's
/// two column halves (a gated pair: gate, then up) accumulate in C tiles over `k`, then leave
/// through fp32 scratch to the AVX-512 epilogue (bias, or SiLU-and-mul, rounded to bf16 as the
/// AVX-512 path rounds). Rows of a last partial tile are copied into zeroed per-thread scratch
/// (tiles of 16 rows read 16). Tiles: C 0-5 (3 row tiles x 2 column halves), A 6, B 7, all 16 x
/// 64 bytes (`crate::amx::configure_full`). A panel streams from memory once per call, the task's next panel prefetched into
/// L2 meanwhile. Needs `k % 32 == 0`.
#[cfg(target_arch = "x86_64")]
pub mod amx {
    use super::{avx512, Linear, NB};
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// Bytes ahead of the panel rows being read that the first row tile prefetches.
    const PREFETCH: usize = 4096;

    thread_local! {
        /// A task's last partial row tile of `x`, zero-padded to 16 rows.
        static XPAD: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// Whether a call takes this path: AMX granted here, `k % 32 == 0`, more than
    /// `AMX_MIN_ROWS` rows.
    pub fn takes(c: &Linear) -> bool {
        c.rows > super::AMX_MIN_ROWS
            && c.k % 32 == 0
            && super::has_fast_path()
            && crate::amx::available()
    }

    /// `tilezero`, `tdpbf16ps tmm{i}, tmm6, tmm7` and `tilestored` on C tile `i` (0-5; the
    /// register is part of the instruction, so each is a match arm, resolved at compile time
    /// in the unrolled loops).
    macro_rules! on_c {
        ($i:expr, $op:ident $(, $arg:expr)*) => {
            match $i {
                0 => on_c!(@ $op "0" $(, $arg)*),
                1 => on_c!(@ $op "1" $(, $arg)*),
                2 => on_c!(@ $op "2" $(, $arg)*),
                3 => on_c!(@ $op "3" $(, $arg)*),
                4 => on_c!(@ $op "4" $(, $arg)*),
                _ => on_c!(@ $op "5" $(, $arg)*),
            }
        };
        (@ zero $n:literal) => {
            asm!(concat!("tilezero tmm", $n), options(nostack, nomem))
        };
        (@ dot $n:literal) => {
            asm!(concat!("tdpbf16ps tmm", $n, ", tmm6, tmm7"), options(nostack, nomem))
        };
        (@ store $n:literal, $p:expr) => {
            asm!(
                concat!("tilestored [{o} + {s} * 1], tmm", $n),
                o = in(reg) $p,
                s = in(reg) 64usize,
                options(nostack),
            )
        };
    }

    /// `R` (1-3) row tiles of 16 (`x[rt]`, `xs` elements apart) times the 32 columns of the
    /// panel at `panel`: C tile `2 rt + h` for column half `h`. Per 32 inputs, each B tile is
    /// loaded once (the panel streams once) and each A tile twice (from L1). Writes tile `(rt,
    /// h)` to `sums + rt * 1024 + (2 q + h) * 256` (`q`: 0 plain or gate, 1 up).
    #[inline(always)]
    unsafe fn group<const R: usize>(
        c: &Linear,
        panel: *const u32,
        x: [*const u16; R],
        xs: [usize; R],
        sums: *mut f32,
        q: usize,
        pf: bool,
        next: *const i8,
    ) {
        for i in 0..2 * R {
            on_c!(i, zero);
        }
        let steps = c.k / 32;
        for ks in 0..steps {
            let rows = panel.add(16 * ks * NB);
            if pf {
                // the panel's lines PREFETCH bytes ahead (it streams from memory)
                let ahead = (rows as *const i8).add(PREFETCH);
                for l in 0..32 {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.add(64 * l));
                }
                // and the next panel's into L2, spread over this one's steps (each step's share
                // of its lines: a panel is `steps * 32` lines too)
                if !next.is_null() {
                    for l in 0..32 {
                        _mm_prefetch::<_MM_HINT_T1>(next.add(64 * (32 * ks + l)));
                    }
                }
            }
            for h in 0..2 {
                asm!(
                    "tileloadd tmm7, [{b} + {s} * 1]",
                    b = in(reg) rows.add(16 * h),
                    s = in(reg) 4 * NB,
                    options(nostack, readonly),
                );
                for rt in 0..R {
                    asm!(
                        "tileloadd tmm6, [{a} + {s} * 1]",
                        a = in(reg) x[rt].add(32 * ks),
                        s = in(reg) 2 * xs[rt],
                        options(nostack, readonly),
                    );
                    on_c!(2 * rt + h, dot);
                }
            }
        }
        for rt in 0..R {
            for h in 0..2 {
                on_c!(2 * rt + h, store, sums.add(rt * 1024 + (2 * q + h) * 256));
            }
        }
    }

    /// Rows `m0 .. m0 + rows` of the output from `sums` (tile `t`, row `r`: `sums[t*256 +
    /// r*16 ..]`): plain panel `p` (bias, bf16) or the gated pair at `p` (SiLU-and-mul).
    #[inline(always)]
    unsafe fn store(c: &Linear, p: usize, m0: usize, rows: usize, sums: *const f32) {
        let n0 = if c.glu { p / 2 * NB } else { p * NB };
        let masks = avx512::col_masks(c, n0);
        let (b0, b1) = if c.glu {
            (_mm512_setzero_ps(), _mm512_setzero_ps()) // a gated pack has no bias
        } else {
            avx512::bias_pair(c, n0, masks)
        };
        for r in 0..rows {
            let out = c.out.add((m0 + r) * c.out_stride + n0);
            for h in 0..2 {
                let s = |t: usize| _mm512_loadu_ps(sums.add(t * 256 + r * 16));
                let y = if c.glu {
                    avx512::silu_mul(s(h), s(2 + h))
                } else {
                    let b = if h == 0 { b0 } else { b1 };
                    std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(
                        s(h),
                        b,
                    )))
                };
                let mask = if h == 0 { masks.0 } else { masks.1 };
                _mm256_mask_storeu_epi16(out.add(16 * h) as *mut _, mask, y);
            }
        }
    }

    /// Panels `lo .. hi` (gated: whole gate / up pairs), all rows, on AMX tiles: per panel
    /// (pair), row tiles in groups of up to 3 (48 rows: the panel streams once; more rows
    /// read it again from L2 per group).
    ///
    /// # Safety
    /// `takes(c)`; `c` describes live memory of the stated shapes.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
    pub unsafe fn run_panels(c: &Linear, lo: usize, hi: usize) {
        #[repr(C, align(64))]
        struct Sums([f32; 3 * 1024]);
        let mut sums = std::mem::MaybeUninit::<Sums>::uninit();
        let sp = sums.as_mut_ptr() as *mut f32;
        let full = c.rows / 16;
        let tail = c.rows % 16;
        let pad = if tail == 0 {
            std::ptr::null()
        } else {
            XPAD.with(|cell| {
                let mut v = cell.borrow_mut();
                if v.len() < 16 * c.k {
                    v.resize(16 * c.k, 0);
                }
                v[tail * c.k..16 * c.k].fill(0);
                for r in 0..tail {
                    let src = c.x.add((16 * full + r) * c.x_stride);
                    std::ptr::copy_nonoverlapping(src, v.as_mut_ptr().add(r * c.k), c.k);
                }
                v.as_ptr()
            })
        };
        let tiles = full + (tail > 0) as usize;
        // row tile rt: its rows, their stride and count
        let row_tile = |rt: usize| {
            if rt < full {
                (c.x.add(16 * rt * c.x_stride), c.x_stride, 16)
            } else {
                (pad, c.k, tail)
            }
        };
        crate::amx::configure_full();
        let kp_n = c.k / 2;
        let step = if c.glu { 2 } else { 1 };
        let next_on = super::avx512::pf_next();
        let mut p = lo;
        while p < hi {
            let mut rt0 = 0;
            while rt0 < tiles {
                let n = (tiles - rt0).min(3);
                for q in 0..step {
                    let panel = c.w.add((p + q) * kp_n * NB);
                    let pf = rt0 == 0;
                    // the panel after this one (this task's), into L2 while this one streams
                    let nx = if pf && p + q + 1 < hi && next_on {
                        c.w.add((p + q + 1) * kp_n * NB) as *const i8
                    } else {
                        std::ptr::null()
                    };
                    let (x0, s0, _) = row_tile(rt0);
                    match n {
                        1 => group::<1>(c, panel, [x0], [s0], sp, q, pf, nx),
                        2 => {
                            let (x1, s1, _) = row_tile(rt0 + 1);
                            group::<2>(c, panel, [x0, x1], [s0, s1], sp, q, pf, nx)
                        }
                        _ => {
                            let (x1, s1, _) = row_tile(rt0 + 1);
                            let (x2, s2, _) = row_tile(rt0 + 2);
                            group::<3>(c, panel, [x0, x1, x2], [s0, s1, s2], sp, q, pf, nx)
                        }
                    }
                }
                for i in 0..n {
                    let (_, _, rows) = row_tile(rt0 + i);
                    store(c, p, 16 * (rt0 + i), rows, sp.add(i * 1024));
                }
                rt0 += n;
            }
            p += step;
        }
        asm!("tilerelease", options(nostack));
    }
}

/// Rows above which a call on a CPU with AMX takes the `amx` path (below, the weight's stream
/// bounds the AVX-512 path and its dot products keep up; `benches/bench_linear_cpu.py`).
pub const AMX_MIN_ROWS: usize = 8;

/// Rows from which a call on the AVX2 path takes the blocked GEMM (`tall`) instead of the
/// small-row panels. Measured crossover since the panel is widened by its first tile (a Zen 3,
/// SmolLM2's shapes, `benches/results/widen_2026-12-05/`): the blocked GEMM 1.12-1.21x the small
/// rows' speed at 12-42 rows on one thread (1.06-1.19x on two), 0.98-0.99x at 10, 0.84x at 8.
pub const TALL_ROWS: usize = 12;

/// Whether a call runs the blocked AVX2 GEMM (`tall`): the caller allows it (`kvcore_kernels`
/// passes `KVCORE_NATIVE_TALL=0` as `false`, for A/B runs), a plain pack, `TALL_ROWS` rows or
/// more, the AVX2 path.
pub fn takes_tall(c: &Linear, portable: bool, allowed: bool) -> bool {
    allowed && !portable && c.rows >= TALL_ROWS && has_avx2_path()
}

/// Whether this CPU runs the AVX-512 BF16 path (else the portable one, far slower: callers
/// keep their own GEMM there).
pub fn has_fast_path() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::has_avx512() && std::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU runs the AVX2 path (plain and gated panels): AVX2 and FMA, no AVX-512
/// BF16.
pub fn has_avx2_path() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        !has_fast_path()
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether `c` runs on the AVX-512 BF16 panels (`avx512::run_panels`): the fast path, not AMX
/// tiles, not `portable`. Such a call of many rows is cut into pairs of panels and row blocks.
pub fn paired(c: &Linear, portable: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        !portable && has_fast_path() && !amx::takes(c)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (c, portable);
        false
    }
}

/// Panels `lo .. hi` on the fast path where the CPU has it (AVX-512 BF16, or AVX2 for plain
/// panels), unless `portable`.
pub unsafe fn run_panels(
    c: &Linear,
    lo: usize,
    hi: usize,
    next: Option<(usize, usize)>,
    portable: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if !portable && amx::takes(c) {
        return amx::run_panels(c, lo, hi);
    }
    #[cfg(target_arch = "x86_64")]
    if !portable && has_fast_path() {
        return avx512::run_panels(c, lo, hi, next);
    }
    #[cfg(target_arch = "x86_64")]
    if !portable && has_avx2_path() {
        return avx2::run_panels(c, lo, hi);
    }
    let _ = portable;
    run_panels_portable(c, lo, hi)
}

/// Pack `w` (`[n_out, k]` bf16, row stride `w_stride`) into `out` (`n_out.div_ceil(NB) * k / 2
/// * NB` dwords), the layout above; padding columns are zero.
pub unsafe fn pack(w: *const u16, w_stride: usize, n_out: usize, k: usize, out: *mut u32) {
    let kp_n = k / 2;
    for p in 0..n_out.div_ceil(NB) {
        for kp in 0..kp_n {
            let row = out.add((p * kp_n + kp) * NB);
            for j in 0..NB {
                let n = p * NB + j;
                *row.add(j) = if n < n_out {
                    let src = w.add(n * w_stride + 2 * kp);
                    (*src as u32) | ((*src.add(1) as u32) << 16)
                } else {
                    0
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// A gated pack of `gate` and `up` (`[i_out, k]` bf16 each): gate panel `i`, then up panel `i`.
    fn pack_gated(gate: &[u16], up: &[u16], i_out: usize, k: usize) -> Vec<u32> {
        let half = i_out.div_ceil(NB) * k / 2 * NB;
        let (mut pg, mut pu) = (vec![0u32; half], vec![0u32; half]);
        unsafe {
            pack(gate.as_ptr(), k, i_out, k, pg.as_mut_ptr());
            pack(up.as_ptr(), k, i_out, k, pu.as_mut_ptr());
        }
        let panel = k / 2 * NB;
        let mut packed = Vec::with_capacity(2 * half);
        for p in 0..i_out.div_ceil(NB) {
            packed.extend_from_slice(&pg[p * panel..(p + 1) * panel]);
            packed.extend_from_slice(&pu[p * panel..(p + 1) * panel]);
        }
        packed
    }

    /// `c` on the blocked AVX2 GEMM (every task, the last first) or on the small-row path.
    unsafe fn run_avx2(c: &Linear, tall_path: bool) {
        if tall_path {
            let (_, _, tasks) = tall::plan(c);
            for t in (0..tasks).rev() {
                tall::run_task(c, t);
            }
        } else {
            avx2::run_panels(c, 0, c.panels());
        }
    }

    /// A plain (not gated) call: `rows` rows of `x` (`k` apart) into `out` (`n` apart).
    fn plain(
        x: &[u16],
        rows: usize,
        k: usize,
        packed: &[u32],
        n: usize,
        bias: Option<&[u16]>,
        out: &mut [u16],
    ) -> Linear {
        Linear {
            x: x.as_ptr(),
            x_stride: k,
            rows,
            k,
            w: packed.as_ptr(),
            n_out: n,
            bias: bias.map_or(std::ptr::null(), |b| b.as_ptr()),
            out: out.as_mut_ptr(),
            out_stride: n,
            glu: false,
        }
    }

    /// Both paths against an fp64 reference, every row count 1..=19 and a ragged last panel.
    #[test]
    fn packed_linear_matches_reference() {
        let mut seed = 7u64;
        for &(n, k) in &[(48usize, 64usize), (37, 30), (96, 576)] {
            let w: Vec<u16> = (0..n * k).map(|_| f32_to_bf16(lcg(&mut seed))).collect();
            let bias: Vec<u16> = (0..n).map(|_| f32_to_bf16(lcg(&mut seed))).collect();
            let mut packed = vec![0u32; n.div_ceil(NB) * k / 2 * NB];
            unsafe { pack(w.as_ptr(), k, n, k, packed.as_mut_ptr()) };
            for rows in 1..=19 {
                let x: Vec<u16> = (0..rows * k).map(|_| f32_to_bf16(lcg(&mut seed))).collect();
                for portable in [true, false] {
                    for with_bias in [false, true] {
                        let mut out = vec![0u16; rows * n + 1];
                        out[rows * n] = 0xabcd; // guard: never written
                        let b = if with_bias { Some(&bias[..]) } else { None };
                        let c = plain(&x, rows, k, &packed, n, b, &mut out);
                        unsafe { run_panels(&c, 0, c.panels(), None, portable) };
                        assert_eq!(out[rows * n], 0xabcd);
                        for m in 0..rows {
                            for j in 0..n {
                                let mut r = 0f64;
                                for i in 0..k {
                                    r += bf16_to_f32(x[m * k + i]) as f64
                                        * bf16_to_f32(w[j * k + i]) as f64;
                                }
                                if with_bias {
                                    r += bf16_to_f32(bias[j]) as f64;
                                }
                                let got = bf16_to_f32(out[m * n + j]) as f64;
                                let tol = 1e-2 * r.abs().max(0.05) + 1e-3;
                                assert!(
                                    (got - r).abs() <= tol,
                                    "{n}x{k} rows {rows} {m},{j}: {got} vs {r}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The blocked AVX2 GEMM gives the small-row path's bits (one `fma` chain over `k`
    /// ascending), on every row count around its blocks and tiles, a ragged last panel, bias.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn tall_matches_small_rows_bit_for_bit() {
        if !has_avx2_path() {
            return;
        }
        let mut seed = 5u64;
        for &(n, k) in &[(40usize, 576usize), (96, 1536), (17, 30)] {
            let w: Vec<u16> = (0..n * k).map(|_| f32_to_bf16(lcg(&mut seed))).collect();
            let bias: Vec<u16> = (0..n).map(|_| f32_to_bf16(lcg(&mut seed))).collect();
            let mut packed = vec![0u32; n.div_ceil(NB) * k / 2 * NB];
            unsafe { pack(w.as_ptr(), k, n, k, packed.as_mut_ptr()) };
            let br = tall::block_rows(k);
            for rows in [12, 13, 17, 48, 49, 53, br - 1, br, br + 1, 2 * br + 5, 301] {
                let x: Vec<u16> = (0..rows * k).map(|_| f32_to_bf16(lcg(&mut seed))).collect();
                for with_bias in [false, true] {
                    let run = |tall_path: bool| {
                        let mut out = vec![0u16; rows * n + 1];
                        out[rows * n] = 0xabcd;
                        let b = if with_bias { Some(&bias[..]) } else { None };
                        let c = plain(&x, rows, k, &packed, n, b, &mut out);
                        unsafe { run_avx2(&c, tall_path) };
                        assert_eq!(out[rows * n], 0xabcd);
                        out
                    };
                    assert_eq!(
                        run(true),
                        run(false),
                        "{n}x{k} rows {rows} bias {with_bias}"
                    );
                }
            }
        }
    }

    /// Gated on AVX2, small-row and tall paths: the same bits as the plain product of `[gate |
    /// up]` on the same path followed by `ops.rs`'s `SiluMul` on the AVX2 instance (what the
    /// model ran before the fused call), at row counts on both sides of a tile, a block and
    /// `TALL_ROWS`, and widths with a partial last panel or half (the tall path's bits equal the
    /// small-row path's).
    #[test]
    fn gated_avx2_is_the_plain_product_then_silu_mul_bit_for_bit() {
        if !has_avx2_path() {
            return;
        }
        let mut seed = 17u64;
        // `SiluMul` takes widths a multiple of 16; 37 (a partial half) checks tall = small only
        for &(i_out, k) in &[(48usize, 576usize), (80, 30), (37, 30), (112, 1536)] {
            let w: Vec<u16> = (0..2 * i_out * k)
                .map(|_| f32_to_bf16(lcg(&mut seed)))
                .collect();
            let (gate, up) = w.split_at(i_out * k);
            // the plain pack of [gate | up], and the gated one (gate panel i, then up panel i)
            let mut flat = vec![0u32; (2 * i_out).div_ceil(NB) * k / 2 * NB];
            unsafe { pack(w.as_ptr(), k, 2 * i_out, k, flat.as_mut_ptr()) };
            let gated = pack_gated(gate, up, i_out, k);
            let br = tall::block_rows(k);
            for rows in [1, 2, 7, 11, 12, 13, 47, 48, 53, br + 1, 2 * br + 5] {
                let x: Vec<u16> = (0..rows * k).map(|_| f32_to_bf16(lcg(&mut seed))).collect();
                let mut gu = vec![0u16; rows * 2 * i_out];
                let c = plain(&x, rows, k, &flat, 2 * i_out, None, &mut gu);
                unsafe { run_avx2(&c, takes_tall(&c, false, true)) };
                let mut want = vec![0u16; rows * i_out];
                let ops = crate::ops::Rows {
                    op: crate::ops::Op::SiluMul,
                    rows,
                    dim: i_out,
                    x: gu.as_mut_ptr(),
                    x_stride: 2 * i_out,
                    y: std::ptr::null_mut(),
                    y_stride: 0,
                    w: std::ptr::null(),
                    out: want.as_mut_ptr(),
                    out_stride: i_out,
                    eps: 0.0,
                    heads: 0,
                    head_stride: 0,
                };
                if i_out % 16 == 0 {
                    unsafe { crate::run_ops_rows(&ops, 0, rows, crate::ISA_AVX2) };
                }
                let gated_run = |tall_path: bool| {
                    let mut got = vec![0u16; rows * i_out + 1];
                    got[rows * i_out] = 0xabcd;
                    let mut c = plain(&x, rows, k, &gated, i_out, None, &mut got);
                    c.glu = true;
                    unsafe { run_avx2(&c, tall_path) };
                    assert_eq!(got[rows * i_out], 0xabcd);
                    got.truncate(rows * i_out);
                    got
                };
                let small = gated_run(false);
                if rows >= TALL_ROWS {
                    assert_eq!(gated_run(true), small, "tall {i_out}x{k} rows {rows}");
                }
                if i_out % 16 == 0 {
                    assert_eq!(small, want, "{i_out}x{k} rows {rows}");
                }
            }
        }
    }

    /// Gated: gate and up packed as alternating panels; both paths against silu(g) * u from
    /// fp64 sums (each rounded to bf16 first, as the plain product's output is).
    #[test]
    fn gated_linear_matches_reference() {
        let mut seed = 11u64;
        for &(i_out, k) in &[(64usize, 96usize), (37, 30), (96, 576)] {
            let gate: Vec<u16> = (0..i_out * k)
                .map(|_| f32_to_bf16(lcg(&mut seed)))
                .collect();
            let up: Vec<u16> = (0..i_out * k)
                .map(|_| f32_to_bf16(lcg(&mut seed)))
                .collect();
            let packed = pack_gated(&gate, &up, i_out, k);
            for rows in (1..=13).chain([19, 48, 53]) {
                let x: Vec<u16> = (0..rows * k).map(|_| f32_to_bf16(lcg(&mut seed))).collect();
                for portable in [true, false] {
                    let mut out = vec![0u16; rows * i_out + 1];
                    out[rows * i_out] = 0xabcd;
                    let c = Linear {
                        x: x.as_ptr(),
                        x_stride: k,
                        rows,
                        k,
                        w: packed.as_ptr(),
                        n_out: i_out,
                        bias: std::ptr::null(),
                        out: out.as_mut_ptr(),
                        out_stride: i_out,
                        glu: true,
                    };
                    unsafe { run_panels(&c, 0, c.panels(), None, portable) };
                    assert_eq!(out[rows * i_out], 0xabcd);
                    for m in 0..rows {
                        for j in 0..i_out {
                            let (mut g, mut u) = (0f64, 0f64);
                            for t in 0..k {
                                let xv = bf16_to_f32(x[m * k + t]) as f64;
                                g += xv * bf16_to_f32(gate[j * k + t]) as f64;
                                u += xv * bf16_to_f32(up[j * k + t]) as f64;
                            }
                            let want = g / (1.0 + (-g).exp()) * u;
                            let got = bf16_to_f32(out[m * i_out + j]) as f64;
                            let tol = 2e-2 * want.abs().max(0.02) + 2e-3;
                            assert!(
                                (got - want).abs() <= tol,
                                "{i_out}x{k} rows {rows} {m},{j}: {got} vs {want} ({portable})"
                            );
                        }
                    }
                }
            }
        }
    }
}
