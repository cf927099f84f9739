//! AMX tiles (Intel Sapphire Rapids and later) for the two products of the transposed prefill
//! path (`cols`): a tile's scores `S^T = K . Q^T` and its `P.V` update, each a few `tdpbf16ps`
//! in place of 512 `vdpbf16ps` per block of 16 rows (D = 64). The online softmax between them
//! stays in AVX-512 registers (`cols::softmax`), on the same transposed layouts:
//!
//!   scores  C[key j][row]  += A = K tile [16 keys x 32 dims] . B = q_t [16 dim pairs x 16 rows]
//!   P.V     acc_t[c][row]  += A = V^T    [16 cols x 16 keys] . B = P   [8 key pairs x 16 rows]
//!
//! `q_t` and P are already in the pair-interleaved layout a B tile wants; V is transposed once
//! per tile and KV head (`vt_from_pairs`), K is read as its bf16 rows. Tile registers are fixed:
//!
//! | tmm | role | rows x bytes |
//! |---|---|---|
//! | 0, 1 | scores of block 0, 1 (C) | 16 x 64 |
//! | 2 | K, 32 dims (A) | 16 x 64 |
//! | 3, 4 | query pairs of block 0, 1 (B) | 16 x 64 |
//! | 5 | accumulator, 16 columns (C) | 16 x 64 |
//! | 6 | V^T, 16 columns (A) | 16 x 32 |
//! | 7 | P pairs (B) | 8 x 64 |
//!
//! The segment path (`cols::head_seg`) loads `PALETTE_FULL` instead (`configure_full`: all eight
//! tiles 16 x 64, the palette the AMX linear loads too): `scores_seg64` keeps both blocks' query tiles (3-6) loaded over a segment's
//! key tiles (K in 2 and 7, scores in 0-1); `pv_seg` keeps the accumulator in 0-3 over 32-key
//! chunks (V^T in 4 and 6 in turn, P in 5).
//!
//! Invariants: `configure` (or `configure_full`) runs on the thread before any tile op and
//! `release` after the last (tile state is per thread; no other code of this crate touches it in
//! between). The Linux
//! kernel must have granted the process the tile data state (`available` asks once,
//! `arch_prctl(ARCH_REQ_XCOMP_PERM)`). Rounding: products in fp32 as `vdpbf16ps`, denormal
//! inputs as zero; the sum order differs, so bits may differ from the AVX-512 path's in the
//! last places. Rust has no stable AMX intrinsics; the instructions are inline assembly.

#![cfg(target_arch = "x86_64")]

use std::arch::asm;

/// Whether this CPU and OS run AMX-BF16 tiles (CPUID.7.0:EDX bits 22 and 24, and the kernel
/// granting XTILEDATA) and `KVCORE_NATIVE_NO_AMX` is unset, empty or `0`; asked once.
pub fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let off = std::env::var("KVCORE_NATIVE_NO_AMX").is_ok_and(|v| !v.is_empty() && v != "0");
        if off || !cpu_has_amx_bf16() {
            return false;
        }
        request_tile_data()
    })
}

/// Ask Linux for the tile data state (once per process; idempotent).
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// CPUID leaf 7: AMX-BF16 and AMX-TILE.
fn cpu_has_amx_bf16() -> bool {
    // SAFETY: CPUID leaf 7 exists on every x86-64 CPU with AVX-512 (the only callers); the
    // intrinsic is safe in newer Rust releases, unsafe in the crate's minimum one.
    #[allow(unused_unsafe)]
    let r = unsafe { std::arch::x86_64::__cpuid_count(7, 0) };
    (r.edx >> 22) & 1 == 1 && (r.edx >> 24) & 1 == 1
}

#[repr(C, align(64))]
struct Palette([u8; 64]);

/// Palette 1 with the shapes of the table above.
const PALETTE: Palette = {
    let mut p = [0u8; 64];
    p[0] = 1;
    let shapes: [(u8, u16); 8] = [
        (16, 64),
        (16, 64),
        (16, 64),
        (16, 64),
        (16, 64),
        (16, 64),
        (16, 32),
        (8, 64),
    ];
    let mut t = 0;
    while t < 8 {
        let (rows, colsb) = shapes[t];
        p[16 + 2 * t] = colsb as u8;
        p[16 + 2 * t + 1] = (colsb >> 8) as u8;
        p[48 + t] = rows;
        t += 1;
    }
    Palette(p)
};

/// Palette 1 with all eight tiles 16 x 64: `cols::head_seg`'s products (`scores_seg64`,
/// `pv_seg`) and the AMX linear (`linear::amx`).
const PALETTE_FULL: Palette = {
    let mut p = [0u8; 64];
    p[0] = 1;
    let mut t = 0;
    while t < 8 {
        p[16 + 2 * t] = 64;
        p[48 + t] = 16;
        t += 1;
    }
    Palette(p)
};

/// Load `PALETTE_FULL`'s shapes on this thread (in place of `configure`'s): all eight tiles
/// 16 x 64.
///
/// # Safety
/// `available()` is true.
#[inline(always)]
pub unsafe fn configure_full() {
    asm!("ldtilecfg [{}]", in(reg) PALETTE_FULL.0.as_ptr(), options(nostack, readonly));
}

/// `scores::<64, 2>` over `nt` consecutive tiles (`kb`: their 16 x 64 bf16 K rows each, tile
/// after tile; tile `t`'s scores at `out + t * 512`), the four query tiles loaded once and the
/// two K halves in different registers (tiles are not renamed: a load into the register a
/// product still reads waits for it). Registers: C 0-1, K 2 and 7, queries 3-6.
///
/// # Safety
/// `configure_full` ran on this thread; the pointers cover the stated shapes.
#[inline(always)]
pub unsafe fn scores_seg64(kb: *const u16, q_t: *const u32, out: *mut f32, nt: usize) {
    asm!(
        "tileloadd tmm3, [{q} + {s} * 1]",
        "tileloadd tmm4, [{q} + {s} * 1 + 1024]",
        "tileloadd tmm5, [{q} + {s} * 1 + 2048]",
        "tileloadd tmm6, [{q} + {s} * 1 + 3072]",
        q = in(reg) q_t,
        s = in(reg) 64usize,
        options(nostack, readonly),
    );
    for t in 0..nt {
        asm!(
            "tileloadd tmm2, [{k} + {ks} * 1]",
            "tileloadd tmm7, [{k} + {ks} * 1 + 64]",
            "tilezero tmm0",
            "tilezero tmm1",
            "tdpbf16ps tmm0, tmm2, tmm3",
            "tdpbf16ps tmm1, tmm2, tmm5",
            "tdpbf16ps tmm0, tmm7, tmm4",
            "tdpbf16ps tmm1, tmm7, tmm6",
            "tilestored [{o} + {s} * 1], tmm0",
            "tilestored [{o} + {s} * 1 + 1024], tmm1",
            k = in(reg) kb.add(t * 16 * 64),
            ks = in(reg) 128usize,
            o = in(reg) out.add(t * 512),
            s = in(reg) 64usize,
            options(nostack),
        );
    }
}

/// Load the tile shapes on this thread.
///
/// # Safety
/// `available()` is true.
#[inline(always)]
pub unsafe fn configure() {
    asm!("ldtilecfg [{}]", in(reg) PALETTE.0.as_ptr(), options(nostack, readonly));
}

/// Return the tiles to their initial state (no tile state for the OS to save).
///
/// # Safety
/// `available()` is true.
#[inline(always)]
pub unsafe fn release() {
    asm!("tilerelease", options(nostack));
}

/// Scores of `NB` (1 or 2) blocks of 16 rows over one tile of 16 keys: `out[b * 256 + j * 16 +
/// row]` = K[j] . q(row), unscaled. `kb`: 16 bf16 K rows of `D` dims, `D` apart; `q_t`: block
/// 0's `D / 2 x 16` query pairs, block 1's after them.
///
/// # Safety
/// `configure` ran on this thread; the pointers cover the stated shapes; `D % 32 == 0`.
#[inline(always)]
pub unsafe fn scores<const D: usize, const NB: usize>(
    kb: *const u16,
    q_t: *const u32,
    out: *mut f32,
) {
    let q1 = q_t.add(D / 2 * 16);
    asm!("tilezero tmm0", options(nostack, nomem));
    if NB == 2 {
        asm!("tilezero tmm1", options(nostack, nomem));
    }
    for i in 0..D / 32 {
        asm!(
            "tileloadd tmm2, [{k} + {ks} * 1]",
            "tileloadd tmm3, [{q} + {qs} * 1]",
            "tdpbf16ps tmm0, tmm2, tmm3",
            k = in(reg) kb.add(32 * i),
            ks = in(reg) 2 * D,
            q = in(reg) q_t.add(256 * i),
            qs = in(reg) 64usize,
            options(nostack, readonly),
        );
        if NB == 2 {
            asm!(
                "tileloadd tmm4, [{q} + {qs} * 1]",
                "tdpbf16ps tmm1, tmm2, tmm4",
                q = in(reg) q1.add(256 * i),
                qs = in(reg) 64usize,
                options(nostack, readonly),
            );
        }
    }
    asm!("tilestored [{o} + {s} * 1], tmm0", o = in(reg) out, s = in(reg) 64usize, options(nostack));
    if NB == 2 {
        asm!(
            "tilestored [{o} + {s} * 1], tmm1",
            o = in(reg) out.add(256),
            s = in(reg) 64usize,
            options(nostack)
        );
    }
}

/// `acc_t[c][row] += sum_j V[j][c] P[j][row]` for one block: `acc_t` is `D x 16` floats, `vt`
/// `D` rows of 8 key pairs (`vt_from_pairs`), `p` 8 rows of 16 dwords (P as bf16 key pairs).
///
/// # Safety
/// `configure` ran on this thread; the pointers cover the stated shapes; `D % 16 == 0`.
#[inline(always)]
pub unsafe fn pv<const D: usize>(acc_t: *mut f32, vt: *const u32, p: *const u32) {
    asm!(
        "tileloadd tmm7, [{p} + {s} * 1]",
        p = in(reg) p,
        s = in(reg) 64usize,
        options(nostack, readonly)
    );
    for cc in (0..D).step_by(16) {
        asm!(
            "tileloadd tmm5, [{a} + {s} * 1]",
            "tileloadd tmm6, [{v} + {vs} * 1]",
            "tdpbf16ps tmm5, tmm6, tmm7",
            "tilestored [{a} + {s} * 1], tmm5",
            a = in(reg) acc_t.add(cc * 16),
            s = in(reg) 64usize,
            v = in(reg) vt.add(cc * 8),
            vs = in(reg) 32usize,
            options(nostack),
        );
    }
}

/// `acc_t[c][row] += sum_j V[j][c] P[j][row]` over `nch` chunks of 32 keys (`cols::head_seg`):
/// chunk `u`'s V^T at `vt + u * D * 16` (`D` rows of 16 key pairs), its P at `p + u * 256` (16
/// rows of 16 dwords: key pairs x rows). The accumulator stays in tiles 0-3 across the chunks,
/// 64 columns at a time; tiles 4 and 6 take V^T in turn, 5 P.
///
/// # Safety
/// `configure_full` ran on this thread; the pointers cover the stated shapes; `D % 16 == 0`.
#[inline(always)]
pub unsafe fn pv_seg<const D: usize>(acc_t: *mut f32, vt: *const u32, p: *const u32, nch: usize) {
    macro_rules! on {
        ($c:literal, $f:expr) => {
            asm!(
                concat!("tileloadd tmm", $c, ", [{a} + {s} * 1]"),
                a = in(reg) $f,
                s = in(reg) 64usize,
                options(nostack, readonly),
            )
        };
    }
    macro_rules! dot {
        ($c:literal, $a:literal, $v:expr) => {
            asm!(
                concat!("tileloadd tmm", $a, ", [{v} + {s} * 1]"),
                concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm5"),
                v = in(reg) $v,
                s = in(reg) 64usize,
                options(nostack, readonly),
            )
        };
    }
    macro_rules! store {
        ($c:literal, $f:expr) => {
            asm!(
                concat!("tilestored [{a} + {s} * 1], tmm", $c),
                a = in(reg) $f,
                s = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    let mut g0 = 0;
    while g0 < D {
        let nc = ((D - g0) / 16).min(4);
        let a = |c: usize| acc_t.add((g0 + 16 * c) * 16);
        on!("0", a(0));
        if nc > 1 {
            on!("1", a(1));
        }
        if nc > 2 {
            on!("2", a(2));
        }
        if nc > 3 {
            on!("3", a(3));
        }
        for u in 0..nch {
            on!("5", p.add(u * 256));
            let v = |c: usize| vt.add(u * D * 16 + (g0 + 16 * c) * 16);
            dot!("0", "4", v(0));
            if nc > 1 {
                dot!("1", "6", v(1));
            }
            if nc > 2 {
                dot!("2", "4", v(2));
            }
            if nc > 3 {
                dot!("3", "6", v(3));
            }
        }
        store!("0", a(0));
        if nc > 1 {
            store!("1", a(1));
        }
        if nc > 2 {
            store!("2", a(2));
        }
        if nc > 3 {
            store!("3", a(3));
        }
        g0 += 16 * nc;
    }
}

/// V^T for `pv`: `vt[c][jp]` = `vp[jp][c]` (a bf16 key pair), `d x 8` dwords from the
/// `njp x d` pairs of `attend::relay_v_pairs`; pairs past `njp` are zero (their P is zero, and
/// a zero V keeps 0 x V finite).
///
/// # Safety
/// `vp` covers `njp x d` dwords, `vt` `d x 8`; `njp <= 8`.
#[inline(always)]
pub unsafe fn vt_from_pairs(vp: *const u32, njp: usize, d: usize, vt: *mut u32) {
    for c in 0..d {
        let row = vt.add(c * 8);
        for jp in 0..8 {
            *row.add(jp) = if jp < njp { *vp.add(jp * d + c) } else { 0 };
        }
    }
}

/// V^T for `pv` straight from the tile's 16 bf16 V rows (`v[j]`, `d` values each; a zero row
/// for a key that is not real): `vt[c]` = V[0][c], V[1][c], .. V[15][c] as bf16, i.e. the key
/// pairs of `vt_from_pairs`. Per 32 dimensions: a 16 x 16 dword transpose (dword `i` of row
/// `j` is V[j]'s dimensions 2i, 2i + 1), then one word permute per dimension pair splits it
/// into rows 2i and 2i + 1 (64 adjacent bytes). ~6x fewer instructions than the scalar
/// re-lay from pairs, which was ~25 % of a long prefill on AMX.
///
/// # Safety
/// The rows cover `d` bf16 values; `vt` covers `d x 8` dwords; `d % 32 == 0`; the CPU has
/// AVX-512 F/BW.
#[inline(always)]
pub unsafe fn vt_from_rows(v: &[*const u8; 16], d: usize, vt: *mut u32) {
    vt_from_rows_at(v, d, vt, 8)
}

/// `vt_from_rows` with dimension `c`'s 8 key pairs at `vt + c * stride` (`stride` 8: the
/// layout `pv` reads; 16: one half of a 32-key chunk of `pv_seg`'s).
///
/// # Safety
/// As `vt_from_rows`, `vt` covering `d` rows of `stride` dwords; `stride >= 8`.
#[inline(always)]
pub unsafe fn vt_from_rows_at(v: &[*const u8; 16], d: usize, vt: *mut u32, stride: usize) {
    use crate::simd::{Avx512, Simd};
    use std::arch::x86_64::*;
    type V = Avx512<true>;
    // words 0-15: the low halves of the 16 dwords (dimension 2i of keys 0-15), then the high
    const IDX: [u16; 32] = {
        let mut a = [0u16; 32];
        let mut k = 0;
        while k < 16 {
            a[k] = 2 * k as u16;
            a[16 + k] = 2 * k as u16 + 1;
            k += 1;
        }
        a
    };
    let idx = _mm512_loadu_si512(IDX.as_ptr() as *const _);
    for c2 in (0..d / 2).step_by(16) {
        let mut t = [V::splat(0.0); 16];
        for (j, x) in t.iter_mut().enumerate() {
            *x = V::load((v[j] as *const f32).add(c2));
        }
        V::transpose(&mut t);
        for (i, x) in t.iter().enumerate() {
            let w = _mm512_permutexvar_epi16(idx, _mm512_castps_si512(x.0));
            let row = vt.add(2 * (c2 + i) * stride);
            if stride == 8 {
                _mm512_storeu_si512(row as *mut _, w);
            } else {
                _mm256_storeu_si256(row as *mut _, _mm512_castsi512_si256(w));
                _mm256_storeu_si256(row.add(stride) as *mut _, _mm512_extracti64x4_epi64::<1>(w));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(x: f32) -> u16 {
        (x.to_bits() >> 16) as u16 // exact for the small integers used here
    }

    /// The tile products against plain loops, on small integers (exact in bf16 and fp32).
    #[test]
    fn scores_and_pv_match_loops() {
        if !(crate::has_avx512() && available()) {
            eprintln!("no AMX here: skipped");
            return;
        }
        const D: usize = 64;
        let val = |a: usize, b: usize| ((a * 7 + b * 3) % 5) as f32 - 2.0;
        let k: Vec<u16> = (0..16 * D).map(|i| bf16(val(i / D, i % D))).collect();
        // block b, row r, dim e: q = val(r + 16 b + 1, e)
        let q = |b: usize, r: usize, e: usize| val(r + 16 * b + 1, e + 2);
        let mut q_t = vec![0u32; 2 * D / 2 * 16];
        for b in 0..2 {
            for dp in 0..D / 2 {
                for r in 0..16 {
                    let (lo, hi) = (
                        bf16(q(b, r, 2 * dp)) as u32,
                        bf16(q(b, r, 2 * dp + 1)) as u32,
                    );
                    q_t[b * D / 2 * 16 + dp * 16 + r] = lo | hi << 16;
                }
            }
        }
        let mut out = vec![0f32; 512];
        let v = |j: usize, c: usize| val(j + 3, c + 1);
        let pj = |j: usize, r: usize| val(j, r + 5);
        let njp = 7; // the last pair zero-padded
        let mut vp = vec![0u32; 8 * D];
        for jp in 0..njp {
            for c in 0..D {
                vp[jp * D + c] = bf16(v(2 * jp, c)) as u32 | (bf16(v(2 * jp + 1, c)) as u32) << 16;
            }
        }
        let mut vt = vec![u32::MAX; D * 8];
        let mut p = vec![0u32; 8 * 16];
        for jp in 0..8 {
            for r in 0..16 {
                p[jp * 16 + r] =
                    bf16(pj(2 * jp, r)) as u32 | (bf16(pj(2 * jp + 1, r)) as u32) << 16;
            }
        }
        let mut acc = vec![1f32; D * 16];
        // the same V^T from the rows (keys past 2 njp: zero rows)
        let zero = [0u16; D];
        let vrows: Vec<Vec<u16>> = (0..16)
            .map(|j| {
                (0..D)
                    .map(|c| if j < 2 * njp { bf16(v(j, c)) } else { 0 })
                    .collect()
            })
            .collect();
        let mut ptrs = [zero.as_ptr() as *const u8; 16];
        for (j, r) in vrows.iter().enumerate() {
            ptrs[j] = r.as_ptr() as *const u8;
        }
        let mut vt_rows = vec![u32::MAX; D * 8];
        unsafe {
            configure();
            scores::<D, 2>(k.as_ptr(), q_t.as_ptr(), out.as_mut_ptr());
            vt_from_pairs(vp.as_ptr(), njp, D, vt.as_mut_ptr());
            vt_from_rows(&ptrs, D, vt_rows.as_mut_ptr());
            pv::<D>(acc.as_mut_ptr(), vt.as_ptr(), p.as_ptr());
            release();
        }
        assert_eq!(vt, vt_rows, "V^T from pairs and from rows");
        // the segment path's products: two tiles of scores at once (the same K twice), and a
        // 32-key chunk whose second half is the same 16 keys again
        let k2: Vec<u16> = k.iter().chain(k.iter()).copied().collect();
        let mut out2 = vec![0f32; 1024];
        let mut vt2 = vec![0u32; D * 16];
        let mut p2 = vec![0u32; 16 * 16];
        p2[..128].copy_from_slice(&p);
        p2[128..].copy_from_slice(&p);
        let mut acc2 = vec![1f32; D * 16];
        unsafe {
            configure_full();
            scores_seg64(k2.as_ptr(), q_t.as_ptr(), out2.as_mut_ptr(), 2);
            vt_from_rows_at(&ptrs, D, vt2.as_mut_ptr(), 16);
            vt_from_rows_at(&ptrs, D, vt2.as_mut_ptr().add(8), 16);
            pv_seg::<D>(acc2.as_mut_ptr(), vt2.as_ptr(), p2.as_ptr(), 1);
            release();
        }
        assert_eq!(&out2[..512], &out[..], "scores_seg64, tile 0");
        assert_eq!(&out2[512..], &out[..], "scores_seg64, tile 1");
        for c in 0..D {
            for r in 0..16 {
                let want: f32 = 1.0 + 2.0 * (0..2 * njp).map(|j| v(j, c) * pj(j, r)).sum::<f32>();
                assert_eq!(acc2[c * 16 + r], want, "pv_seg c{c} r{r}");
            }
        }
        for b in 0..2 {
            for j in 0..16 {
                for r in 0..16 {
                    let want: f32 = (0..D).map(|e| val(j, e) * q(b, r, e)).sum();
                    assert_eq!(out[b * 256 + j * 16 + r], want, "score b{b} j{j} r{r}");
                }
            }
        }
        for c in 0..D {
            for r in 0..16 {
                let want: f32 = 1.0 + (0..2 * njp).map(|j| v(j, c) * pj(j, r)).sum::<f32>();
                assert_eq!(acc[c * 16 + r], want, "acc c{c} r{r}");
            }
        }
    }
}
