//! Sixteen fp32 lanes, two ways: AVX-512 registers (`Avx512`) and a plain array (`Portable`).
//!
//! The attention loop (`attend.rs`) is written once against the `Simd` trait and instantiated
//! for both; the AVX-512 instance is compiled inside a `#[target_feature]` function and chosen
//! at run time (`lib.rs`), the portable one runs anywhere (the compiler vectorises what it can
//! for the baseline target). Stored element types are widened to fp32 on load (`load_*`): the
//! math is fp32 whatever the cache holds. All functions are `unsafe`: they read raw pointers,
//! and the AVX-512 ones need the CPU features the caller checked.

/// Lanes per vector.
pub const W: usize = 16;

/// The power of two by which an fp8 code read by shifting its bits into an fp32's (or a
/// bf16's) sign, exponent and mantissa under-reads its value: the exponent biases' difference
/// (127 - 7 for E4M3, 127 - 15 for E5M2). `Simd::load_fp8_raw` and `vnni::fp8_words` read so.
pub const fn fp8_bias(f: u8) -> i32 {
    if f == 5 {
        112
    } else {
        120
    }
}

/// The power of two by which the query rows and P are scaled up where fp8 codes are read raw
/// (`fp8_bias`), so that no product of normal values leaves fp32's normal range; the scores
/// and the accumulator are scaled by the rest, 2^(`fp8_bias` - `FP8_PRE`).
pub const FP8_PRE: i32 = 64;

/// fp32 x 16 operations the kernel needs.
pub trait Simd: Copy {
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    unsafe fn add(self, o: Self) -> Self;
    unsafe fn mul(self, o: Self) -> Self;
    unsafe fn sub(self, o: Self) -> Self;
    unsafe fn div(self, o: Self) -> Self;
    /// Each lane rounded to the nearest bf16 (ties to even; NaN stays NaN), kept as fp32.
    unsafe fn round_bf16(self) -> Self;
    /// The 16 lanes stored as bf16 (rounded as `round_bf16`).
    unsafe fn store_bf16(self, p: *mut u16);
    /// `self * b + c`
    unsafe fn fma(self, b: Self, c: Self) -> Self;
    /// Lane-wise maximum (either operand where one lane is NaN: callers feed no NaN).
    unsafe fn max(self, o: Self) -> Self;
    unsafe fn hmax(self) -> f32;
    unsafe fn hsum(self) -> f32;
    /// e^x lane-wise (x = -inf or below -87 gives a tiny value or 0; callers mask).
    unsafe fn exp(self) -> Self;
    /// e^x for a softmax's arguments (x <= 0): `exp`'s bits from x = -87.6 up (e^x normal from
    /// -87.34); below that an instance may give any value up to e^-87.6 (~9e-39) instead.
    #[inline(always)]
    unsafe fn exp_softmax(self) -> Self {
        self.exp()
    }
    /// Lanes whose bit is set in `mask` from `self`, the others from `other`.
    unsafe fn select(self, mask: u16, other: Self) -> Self;
    /// In-place transpose of a 16 x 16 tile (row i, lane j) -> (row j, lane i).
    unsafe fn transpose(rows: &mut [Self; W]);
    unsafe fn load_bf16(p: *const u16) -> Self;
    unsafe fn load_f16(p: *const u16) -> Self;
    unsafe fn load_i8(p: *const i8) -> Self;
    unsafe fn load_e4m3(p: *const u8) -> Self;
    unsafe fn load_e5m2(p: *const u8) -> Self;
    /// 16 fp8 codes of format `F` (4: E4M3, 5: E5M2) as their values times 2^-`fp8_bias(F)`,
    /// in order: the bits shifted into place without the scaling multiply (subnormal codes
    /// become fp32 subnormals, exact; E5M2's inf / NaN codes read as finite values).
    #[inline(always)]
    unsafe fn load_fp8_raw<const F: u8>(p: *const u8) -> Self {
        let x = if F == 5 {
            Self::load_e5m2(p)
        } else {
            Self::load_e4m3(p)
        };
        x.mul(Self::splat((2f32).powi(-fp8_bias(F))))
    }
    /// Whether the fp32 P.V loops (`pv_rows`, `pv_direct`, up to 4 rows) take 32 columns per
    /// pass (two vectors per row: AVX-512's 32 registers hold them) or 16 (AVX2: 4 rows x 16
    /// columns are 8 of its 16 ymm; 32 columns would spill).
    const PV_PAIRED: bool = true;
    /// Whether `qk_rows` keeps two accumulators per row (even / odd dimensions: 8 chains for 4
    /// rows); AVX2 keeps one (4 rows are 8 ymm chains already, and 16 would spill).
    const QK_TWO_CHAINS: bool = true;
    /// Whether the bf16-pair methods below are implemented (AVX-512 BF16 dot products).
    const DPBF16: bool = false;
    /// int8 decode by integer dot products and fp8 decode by table (`vnni.rs`): AVX-512 VNNI, and
    /// VBMI for the fp8 tables, the caller compiled with them.
    const VNNI: bool = false;
    /// Whether `qk_direct` is implemented (AVX2: decode scores without the K tile's transpose).
    const QK_DIRECT: bool = false;
    /// `p[x][j] = q[x] . K[j]` for `NR` rows and keys `j < nk`, K rows of format `F` (fp32,
    /// bf16 or f16) read in place (`k[j]`; a non-real key is a zero row): one 16-dimension
    /// chunk of two keys at a time, eight lanes of partial sums per key and row, summed by
    /// horizontal adds at the end (no transpose: a decode item has too few rows to pay for
    /// one). `q` rows are `d` apart and pre-scaled; for bf16 (`F` = 1) and fp8 (`F` = 4, 5)
    /// each 16-dimension chunk is laid out as its 8 even dimensions, then its 8 odd ones
    /// (`evenodd_row`), the order in which a load of those widens; fp8 K values are read raw,
    /// 2^`fp8_bias(F)` too small (`load_fp8_raw`). `p` rows are `W` apart; lanes `j >= nk`
    /// are junk.
    #[inline(always)]
    unsafe fn qk_direct<const F: u8, const NR: usize>(
        _q: *const f32,
        _d: usize,
        _k: &[*const u8; W],
        _nk: usize,
        _p: *mut f32,
    ) {
        unreachable!("qk_direct needs AVX2")
    }
    /// Store `lo` then `hi` as 32 bf16 (round to nearest even; exact for int8 / fp8 values).
    #[inline(always)]
    unsafe fn store_bf16x2(_lo: Self, _hi: Self, _p: *mut u16) {
        unreachable!("store_bf16x2 needs AVX-512 BF16")
    }
    /// `lo` then `hi` as 32 bf16 in one register (the bits `store_bf16x2` stores).
    #[inline(always)]
    unsafe fn bf16x2(_lo: Self, _hi: Self) -> Self {
        unreachable!("bf16x2 needs AVX-512 BF16")
    }
    /// Store the 16 lanes as 8 dwords of bf16 pairs (round to nearest even): dword `i` holds
    /// lanes `2i` (low half) and `2i + 1` (high half).
    #[inline(always)]
    unsafe fn store_bf16_pairs(self, _p: *mut u32) {
        unreachable!("store_bf16_pairs needs AVX-512 BF16")
    }
    /// Store 16 dwords: dword `i` = bf16 of `lo[i]` (low half), bf16 of `hi[i]` (high half),
    /// truncated: exact for values bf16 holds (bf16, int8 and fp8 codes).
    #[inline(always)]
    unsafe fn store_pair_rows(_lo: Self, _hi: Self, _p: *mut u32) {
        unreachable!("store_pair_rows needs AVX-512 BF16")
    }
    /// `p[x][j] = scale * sum_dp q[x][dp] . kp[dp][j]` for `NR` rows (`q` rows of `d / 2` dwords
    /// of bf16 pairs, `p` rows `W` apart), `kp` the K tile as dimension pairs (`d / 2` rows of `W`
    /// dwords): one broadcast bf16-pair dot product per two dimensions, no horizontal sums.
    #[inline(always)]
    unsafe fn qk_pairs<const NR: usize>(
        _q: *const u32,
        _d: usize,
        _kp: *const u32,
        _scale: Self,
        _p: *mut f32,
    ) {
        unreachable!("qk_pairs needs AVX-512 BF16")
    }
    /// `pv_pairs` reading bf16 V rows in place (`v[j]`, key `j`'s row; `2 * njp` of them): each
    /// pair of keys interleaved into dimension-wise pairs in registers (two word permutes per 32
    /// columns), then one bf16-pair dot product per row.
    #[inline(always)]
    unsafe fn pv_pairs_direct<const NR: usize>(
        _acc: *mut f32,
        _pb: *const u32,
        _d: usize,
        _v: &[*const u8; W],
        _njp: usize,
    ) {
        unreachable!("pv_pairs_direct needs AVX-512 BF16")
    }
    /// `acc[x][:] += sum_jp pb[x][jp] . vp[jp][:]` for `NR` rows (`acc` rows `d` apart, `pb`
    /// rows `W / 2` dwords apart), each term a bf16-pair dot product (two keys at once).
    #[inline(always)]
    unsafe fn pv_pairs<const NR: usize>(
        _acc: *mut f32,
        _pb: *const u32,
        _d: usize,
        _vp: *const u32,
        _njp: usize,
    ) {
        unreachable!("pv_pairs needs AVX-512 BF16")
    }
}

/// The vector `exp`s' constants (AVX-512 here, AVX2 in `avx2.rs`): inputs clamped to
/// `EXP_RANGE`; f = x - n ln 2 in two steps (`LN2_HI` holds ln 2's high bits, `LN2_LO` the rest);
/// e^f by the degree-7 Taylor polynomial, coefficients from x^7 down (Horner).
pub(crate) const EXP_RANGE: (f32, f32) = (-104.0, 88.7);
pub(crate) const LN2_HI: f32 = 0.693_145_75;
pub(crate) const LN2_LO: f32 = 1.428_606_8e-6;
pub(crate) const EXP_POLY: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// tanh from exp: 1 - 2 / (e^{2x} + 1), saturating for large |x|.
#[inline(always)]
pub unsafe fn tanh<S: Simd>(x: S) -> S {
    let mut buf = [0f32; W];
    let e = x.add(x).exp();
    e.store(buf.as_mut_ptr());
    for v in buf.iter_mut() {
        *v = if v.is_infinite() {
            1.0
        } else {
            1.0 - 2.0 / (*v + 1.0)
        };
    }
    S::load(buf.as_ptr())
}

// ---------------------------------------------------------------- scalar conversions

/// bf16 bits -> f32.
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 -> bf16 bits, round to nearest even (NaN stays NaN).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// IEEE half bits -> f32 (subnormals, inf and NaN included).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    if exp == 0 {
        // subnormal: man * 2^-24, exact in f32
        let v = man as f32 * f32::from_bits(0x3380_0000);
        return if sign != 0 { -v } else { v };
    }
    let mag = if exp == 31 {
        0x7f80_0000 | (man << 13)
    } else {
        ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(sign | mag)
}

/// f32 -> IEEE half bits, round to nearest even, overflow to inf.
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let a = b & 0x7fff_ffff;
    if a >= 0x7f80_0000 {
        return sign | 0x7c00 | if a > 0x7f80_0000 { 0x200 } else { 0 };
    }
    if a >= 0x4780_0000 {
        // >= 65536: rounds to inf
        return sign | 0x7c00;
    }
    if a < 0x3880_0000 {
        // below the smallest normal half (2^-14): subnormal or zero, in units of 2^-24
        let v = f32::from_bits(a) * 2f32.powi(24);
        let r = v.round_ties_even() as u16;
        return sign | r;
    }
    let rounded = a + 0x0fff + ((a >> 13) & 1);
    sign | (((rounded >> 13) - (112 << 10)) as u16)
}

/// FP8 E4M3 (fn) bits -> f32: the magnitude bits shifted into an f32 and rebiased by 2^120.
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let mag = f32::from_bits(((b & 0x7f) as u32) << 20) * f32::from_bits(0x7b80_0000); // 2^120
    if b & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// FP8 E5M2 bits -> f32: the top byte of an IEEE half.
#[inline(always)]
pub fn e5m2_to_f32(b: u8) -> f32 {
    f16_to_f32((b as u16) << 8)
}

// ---------------------------------------------------------------- portable

/// The portable instance: sixteen lanes in an array.
#[derive(Clone, Copy)]
pub struct Portable(pub [f32; W]);

impl Portable {
    #[inline(always)]
    fn map(self, f: impl Fn(f32) -> f32) -> Self {
        let mut o = self.0;
        for v in o.iter_mut() {
            *v = f(*v);
        }
        Portable(o)
    }
    #[inline(always)]
    fn zip(self, b: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        let mut o = self.0;
        for (v, w) in o.iter_mut().zip(b.0) {
            *v = f(*v, w);
        }
        Portable(o)
    }
    #[inline(always)]
    unsafe fn from_fn(f: impl Fn(usize) -> f32) -> Self {
        let mut o = [0f32; W];
        for (i, v) in o.iter_mut().enumerate() {
            *v = f(i);
        }
        Portable(o)
    }
}

impl Simd for Portable {
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Portable([x; W])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Portable(std::ptr::read_unaligned(p as *const [f32; W]))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        std::ptr::write_unaligned(p as *mut [f32; W], self.0)
    }
    #[inline(always)]
    unsafe fn add(self, o: Self) -> Self {
        self.zip(o, |a, b| a + b)
    }
    #[inline(always)]
    unsafe fn mul(self, o: Self) -> Self {
        self.zip(o, |a, b| a * b)
    }
    #[inline(always)]
    unsafe fn sub(self, o: Self) -> Self {
        self.zip(o, |a, b| a - b)
    }
    #[inline(always)]
    unsafe fn div(self, o: Self) -> Self {
        self.zip(o, |a, b| a / b)
    }
    #[inline(always)]
    unsafe fn round_bf16(self) -> Self {
        self.map(|x| bf16_to_f32(f32_to_bf16(x)))
    }
    #[inline(always)]
    unsafe fn store_bf16(self, p: *mut u16) {
        for (i, x) in self.0.iter().enumerate() {
            p.add(i).write_unaligned(f32_to_bf16(*x));
        }
    }
    #[inline(always)]
    unsafe fn fma(self, b: Self, c: Self) -> Self {
        let mut o = self.0;
        for i in 0..W {
            o[i] = o[i] * b.0[i] + c.0[i];
        }
        Portable(o)
    }
    #[inline(always)]
    unsafe fn max(self, o: Self) -> Self {
        self.zip(o, f32::max)
    }
    #[inline(always)]
    unsafe fn hmax(self) -> f32 {
        self.0.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }
    #[inline(always)]
    unsafe fn hsum(self) -> f32 {
        self.0.iter().sum()
    }
    #[inline(always)]
    unsafe fn exp(self) -> Self {
        self.map(f32::exp)
    }
    #[inline(always)]
    unsafe fn select(self, mask: u16, other: Self) -> Self {
        let mut o = other.0;
        for (i, v) in o.iter_mut().enumerate() {
            if mask >> i & 1 != 0 {
                *v = self.0[i];
            }
        }
        Portable(o)
    }
    unsafe fn transpose(rows: &mut [Self; W]) {
        for i in 0..W {
            for j in i + 1..W {
                let t = rows[i].0[j];
                rows[i].0[j] = rows[j].0[i];
                rows[j].0[i] = t;
            }
        }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self {
        Self::from_fn(|i| bf16_to_f32(p.add(i).read_unaligned()))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self {
        Self::from_fn(|i| f16_to_f32(p.add(i).read_unaligned()))
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> Self {
        Self::from_fn(|i| *p.add(i) as f32)
    }
    #[inline(always)]
    unsafe fn load_e4m3(p: *const u8) -> Self {
        Self::from_fn(|i| e4m3_to_f32(*p.add(i)))
    }
    #[inline(always)]
    unsafe fn load_e5m2(p: *const u8) -> Self {
        Self::from_fn(|i| e5m2_to_f32(*p.add(i)))
    }
}

// ---------------------------------------------------------------- AVX-512

#[cfg(target_arch = "x86_64")]
pub use avx::{pv_pairs_rows, Avx512};

#[cfg(target_arch = "x86_64")]
mod avx {
    use super::{Simd, EXP_POLY, EXP_RANGE, LN2_HI, LN2_LO, W};
    use std::arch::x86_64::*;

    /// The AVX-512 instance (needs avx512f/bw/dq/vl; checked in `lib.rs`); `BF`: the CPU has
    /// AVX-512 BF16 too, and the caller was compiled with it (bf16 K rows dotted without
    /// widening); `VN`: AVX-512 VNNI (and VBMI in the fp8 instance) as well (`vnni.rs`).
    #[derive(Clone, Copy)]
    pub struct Avx512<const BF: bool, const VN: bool = false>(pub __m512);

    /// The bf16 nearest each lane (ties to even; NaN made quiet, as `f32_to_bf16`) in the high
    /// 16 bits of each dword, the low 16 bits zero.
    #[inline(always)]
    unsafe fn bf16_bits_high(x: __m512) -> __m512i {
        let b = _mm512_castps_si512(x);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(b, _mm512_set1_epi32(0x40_0000)));
        _mm512_and_si512(r, _mm512_set1_epi32(-65536))
    }

    #[inline(always)]
    unsafe fn shuf<const IMM: i32>(a: __m512, b: __m512) -> __m512 {
        _mm512_shuffle_f32x4::<IMM>(a, b)
    }
    #[inline(always)]
    unsafe fn lo_pd(a: __m512, b: __m512) -> __m512 {
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)))
    }
    #[inline(always)]
    unsafe fn hi_pd(a: __m512, b: __m512) -> __m512 {
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)))
    }

    /// `pv_pairs` (`DIRECT` false: key pairs from the re-laid tile `vp`) and `pv_pairs_direct`
    /// (true: each pair of bf16 V rows `v.row(2 jp)`, `v.row(2 jp + 1)` interleaved in registers,
    /// two word permutes per 32 columns: word 2c of `lo` = a[c], word 2c + 1 = b[c]; `hi` for
    /// c + 16).
    #[inline(always)]
    unsafe fn pv_pairs_impl<const NR: usize, const DIRECT: bool, R: crate::vnni::Rows>(
        acc: *mut f32,
        pb: *const u32,
        d: usize,
        vp: *const u32,
        v: &R,
        njp: usize,
    ) {
        let idx_lo = _mm512_set_epi16(
            47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36,
            4, 35, 3, 34, 2, 33, 1, 32, 0,
        );
        let idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
        let mut cc = 0;
        while cc < d {
            // 32 columns per pass (d is a multiple of 32 on this path)
            let mut a0 = [_mm512_setzero_ps(); NR];
            let mut a1 = [_mm512_setzero_ps(); NR];
            for x in 0..NR {
                a0[x] = _mm512_loadu_ps(acc.add(x * d + cc));
                a1[x] = _mm512_loadu_ps(acc.add(x * d + cc + W));
            }
            for jp in 0..njp {
                let (lo, hi) = if DIRECT {
                    let va = _mm512_loadu_si512((v.row(2 * jp) as *const u16).add(cc) as *const _);
                    let vb =
                        _mm512_loadu_si512((v.row(2 * jp + 1) as *const u16).add(cc) as *const _);
                    (
                        _mm512_permutex2var_epi16(va, idx_lo, vb),
                        _mm512_permutex2var_epi16(va, idx_hi, vb),
                    )
                } else {
                    (
                        _mm512_loadu_si512(vp.add(jp * d + cc) as *const _),
                        _mm512_loadu_si512(vp.add(jp * d + cc + W) as *const _),
                    )
                };
                let lo = std::mem::transmute::<__m512i, __m512bh>(lo);
                let hi = std::mem::transmute::<__m512i, __m512bh>(hi);
                for x in 0..NR {
                    let pj: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*pb.add(x * (W / 2) + jp) as i32));
                    a0[x] = _mm512_dpbf16_ps(a0[x], pj, lo);
                    a1[x] = _mm512_dpbf16_ps(a1[x], pj, hi);
                }
            }
            for x in 0..NR {
                _mm512_storeu_ps(acc.add(x * d + cc), a0[x]);
                _mm512_storeu_ps(acc.add(x * d + cc + W), a1[x]);
            }
            cc += 2 * W;
        }
    }

    /// `Simd::pv_pairs_direct` over any row addresses (`vnni::Rows`: an array, or a base and a
    /// stride for a one-block tile, `dec_lean.rs`). Needs AVX-512 BF16.
    #[inline(always)]
    pub unsafe fn pv_pairs_rows<const NR: usize, R: crate::vnni::Rows>(
        acc: *mut f32,
        pb: *const u32,
        d: usize,
        v: &R,
        njp: usize,
    ) {
        pv_pairs_impl::<NR, true, R>(acc, pb, d, std::ptr::null(), v, njp)
    }

    impl<const BF: bool, const VN: bool> Simd for Avx512<BF, VN> {
        const DPBF16: bool = BF;
        const VNNI: bool = VN;
        #[inline(always)]
        unsafe fn store_bf16x2(lo: Self, hi: Self, p: *mut u16) {
            let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi.0, lo.0));
            _mm512_storeu_si512(p as *mut _, packed)
        }
        #[inline(always)]
        unsafe fn bf16x2(lo: Self, hi: Self) -> Self {
            Avx512(std::mem::transmute::<__m512bh, __m512>(
                _mm512_cvtne2ps_pbh(hi.0, lo.0),
            ))
        }
        #[inline(always)]
        unsafe fn store_bf16_pairs(self, p: *mut u32) {
            let packed: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(self.0));
            _mm256_storeu_si256(p as *mut _, packed)
        }
        #[inline(always)]
        unsafe fn store_pair_rows(lo: Self, hi: Self, p: *mut u32) {
            let l = _mm512_srli_epi32::<16>(_mm512_castps_si512(lo.0));
            let h = _mm512_and_si512(_mm512_castps_si512(hi.0), _mm512_set1_epi32(-65536));
            _mm512_storeu_si512(p as *mut _, _mm512_or_si512(l, h))
        }
        #[inline(always)]
        unsafe fn pv_pairs<const NR: usize>(
            acc: *mut f32,
            pb: *const u32,
            d: usize,
            vp: *const u32,
            njp: usize,
        ) {
            pv_pairs_impl::<NR, false, _>(acc, pb, d, vp, &[std::ptr::null(); W], njp)
        }
        #[inline(always)]
        unsafe fn pv_pairs_direct<const NR: usize>(
            acc: *mut f32,
            pb: *const u32,
            d: usize,
            v: &[*const u8; W],
            njp: usize,
        ) {
            pv_pairs_impl::<NR, true, _>(acc, pb, d, std::ptr::null(), v, njp)
        }
        #[inline(always)]
        unsafe fn qk_pairs<const NR: usize>(
            q: *const u32,
            d: usize,
            kp: *const u32,
            scale: Self,
            p: *mut f32,
        ) {
            // two accumulators per row (even / odd dimension pairs): 2 * NR chains in flight
            let dp = d / 2;
            let mut s0 = [_mm512_setzero_ps(); NR];
            let mut s1 = [_mm512_setzero_ps(); NR];
            let mut i = 0;
            while i < dp {
                let k0: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(kp.add(i * W) as *const _));
                let k1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(kp.add((i + 1) * W) as *const _));
                for x in 0..NR {
                    let q0: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*q.add(x * dp + i) as i32));
                    let q1: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*q.add(x * dp + i + 1) as i32));
                    s0[x] = _mm512_dpbf16_ps(s0[x], q0, k0);
                    s1[x] = _mm512_dpbf16_ps(s1[x], q1, k1);
                }
                i += 2;
            }
            for x in 0..NR {
                _mm512_storeu_ps(
                    p.add(x * W),
                    _mm512_mul_ps(_mm512_add_ps(s0[x], s1[x]), scale.0),
                );
            }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx512(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Avx512(_mm512_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn add(self, o: Self) -> Self {
            Avx512(_mm512_add_ps(self.0, o.0))
        }
        #[inline(always)]
        unsafe fn mul(self, o: Self) -> Self {
            Avx512(_mm512_mul_ps(self.0, o.0))
        }
        #[inline(always)]
        unsafe fn sub(self, o: Self) -> Self {
            Avx512(_mm512_sub_ps(self.0, o.0))
        }
        #[inline(always)]
        unsafe fn div(self, o: Self) -> Self {
            Avx512(_mm512_div_ps(self.0, o.0))
        }
        #[inline(always)]
        unsafe fn round_bf16(self) -> Self {
            Avx512(_mm512_castsi512_ps(bf16_bits_high(self.0)))
        }
        #[inline(always)]
        unsafe fn store_bf16(self, p: *mut u16) {
            let b = _mm512_srli_epi32::<16>(bf16_bits_high(self.0));
            _mm256_storeu_si256(p as *mut __m256i, _mm512_cvtepi32_epi16(b))
        }
        #[inline(always)]
        unsafe fn fma(self, b: Self, c: Self) -> Self {
            Avx512(_mm512_fmadd_ps(self.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn max(self, o: Self) -> Self {
            Avx512(_mm512_max_ps(self.0, o.0))
        }
        #[inline(always)]
        unsafe fn hmax(self) -> f32 {
            _mm512_reduce_max_ps(self.0)
        }
        #[inline(always)]
        unsafe fn hsum(self) -> f32 {
            _mm512_reduce_add_ps(self.0)
        }
        /// e^x = 2^n * e^f with n = round(x log2 e) and f = x - n ln 2 in two steps (Cody-Waite,
        /// |f| <= ln2 / 2), e^f by a degree-7 Taylor polynomial (relative error ~2e-8), 2^n
        /// applied with `scalef`.
        #[inline(always)]
        unsafe fn exp(self) -> Self {
            let x = _mm512_max_ps(self.0, _mm512_set1_ps(EXP_RANGE.0));
            let x = _mm512_min_ps(x, _mm512_set1_ps(EXP_RANGE.1));
            let t = _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E));
            let n = _mm512_roundscale_ps::<0x08>(t); // nearest, no exceptions
            let f = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
            let f = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), f);
            let mut p = _mm512_set1_ps(EXP_POLY[0]);
            for &c in &EXP_POLY[1..] {
                p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
            }
            Avx512(_mm512_scalef_ps(p, n))
        }
        #[inline(always)]
        unsafe fn select(self, mask: u16, other: Self) -> Self {
            Avx512(_mm512_mask_blend_ps(mask, other.0, self.0))
        }
        /// Four stages: 32-bit unpacks, 64-bit unpacks, then two 128-bit lane shuffles.
        #[inline(always)]
        unsafe fn transpose(rows: &mut [Self; W]) {
            let r: [__m512; W] = std::array::from_fn(|i| rows[i].0);
            let mut t = [_mm512_setzero_ps(); W];
            for i in 0..8 {
                t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            let mut u = [_mm512_setzero_ps(); W];
            for i in 0..4 {
                let b = 4 * i;
                u[b] = lo_pd(t[b], t[b + 2]);
                u[b + 1] = hi_pd(t[b], t[b + 2]);
                u[b + 2] = lo_pd(t[b + 1], t[b + 3]);
                u[b + 3] = hi_pd(t[b + 1], t[b + 3]);
            }
            let mut v = [_mm512_setzero_ps(); W];
            for h in 0..2 {
                let b = 8 * h;
                for i in 0..4 {
                    v[b + i] = shuf::<0x88>(u[b + i], u[b + 4 + i]);
                    v[b + 4 + i] = shuf::<0xdd>(u[b + i], u[b + 4 + i]);
                }
            }
            for i in 0..8 {
                rows[i] = Avx512(shuf::<0x88>(v[i], v[8 + i]));
                rows[8 + i] = Avx512(shuf::<0xdd>(v[i], v[8 + i]));
            }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> Self {
            let h = _mm256_loadu_si256(p as *const __m256i);
            Avx512(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                _mm512_cvtepu16_epi32(h),
            )))
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> Self {
            Avx512(_mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)))
        }
        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> Self {
            let b = _mm_loadu_si128(p as *const __m128i);
            Avx512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)))
        }
        #[inline(always)]
        unsafe fn load_e4m3(p: *const u8) -> Self {
            // Sign-extended, the byte's sign lands in bit 31 and its exponent and mantissa in
            // bits 20-26 after the shift (the mask clears the copies of the sign between): an
            // fp32 with the e4m3 bits in place, scaled by 2^120 (exact, subnormals included).
            let x = _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i));
            let bits = _mm512_and_si512(
                _mm512_slli_epi32::<20>(x),
                _mm512_set1_epi32(0x87f0_0000_u32 as i32),
            );
            Avx512(_mm512_mul_ps(
                _mm512_castsi512_ps(bits),
                _mm512_set1_ps(f32::from_bits(0x7b80_0000)),
            ))
        }
        #[inline(always)]
        unsafe fn load_e5m2(p: *const u8) -> Self {
            let x = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
            Avx512(_mm512_cvtph_ps(_mm256_slli_epi16::<8>(x)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_trip() {
        for b in 0..=u16::MAX {
            let x = f16_to_f32(b);
            if !x.is_nan() {
                assert_eq!(f32_to_f16(x), b, "{b:#x}");
            }
            let y = bf16_to_f32(b);
            if !y.is_nan() {
                assert_eq!(f32_to_bf16(y), b);
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert_eq!(e5m2_to_f32(0x3c), 1.0);
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80); // tie to even
    }

    #[test]
    fn raw_fp8_reads_are_the_values_times_two_to_minus_the_bias() {
        // the trait's own `load_fp8_raw` (the portable instance): every finite code, both formats
        let codes: Vec<u8> = (0..=255u8).collect();
        for chunk in codes.chunks(W) {
            let mut out = [0f32; W];
            for f in [4u8, 5] {
                let raw = unsafe {
                    if f == 4 {
                        Portable::load_fp8_raw::<4>(chunk.as_ptr())
                    } else {
                        Portable::load_fp8_raw::<5>(chunk.as_ptr())
                    }
                };
                unsafe { raw.store(out.as_mut_ptr()) };
                for (j, &b) in chunk.iter().enumerate() {
                    let want = if f == 4 {
                        e4m3_to_f32(b)
                    } else {
                        e5m2_to_f32(b)
                    };
                    if want.is_finite() {
                        let got = out[j] as f64 * (2f64).powi(fp8_bias(f));
                        assert_eq!(got, want as f64, "format {f} code {b:#x}");
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_matches_portable() {
        if !crate::has_avx512() {
            return;
        }
        unsafe { avx512_matches_portable_inner() }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn bf16_dot_products_match_scalar() {
        if !crate::has_avx512() || !std::is_x86_feature_detected!("avx512bf16") {
            return;
        }
        unsafe { bf16_dot_inner() }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
    unsafe fn bf16_dot_inner() {
        let d = 64;
        let vals: Vec<u16> = (0..17 * d)
            .map(|i| f32_to_bf16(((i * 7919) % 97) as f32 / 13.0 - 3.0))
            .collect();
        let q = &vals[16 * d..];
        // K as dimension pairs: kp[dp][j] = (K[j][2 dp], K[j][2 dp + 1])
        let kp: Vec<u32> = (0..d / 2 * W)
            .map(|x| {
                let (dp, j) = (x / W, x % W);
                vals[j * d + 2 * dp] as u32 | (vals[j * d + 2 * dp + 1] as u32) << 16
            })
            .collect();
        let mut out = [0f32; W];
        let half = Avx512::<true>::splat(0.5);
        Avx512::<true>::qk_pairs::<1>(
            q.as_ptr() as *const u32,
            d,
            kp.as_ptr(),
            half,
            out.as_mut_ptr(),
        );
        out.iter_mut().for_each(|x| *x *= 2.0);
        for j in 0..W {
            let want: f32 = (0..d)
                .map(|e| bf16_to_f32(q[e]) * bf16_to_f32(vals[j * d + e]))
                .sum();
            assert!(
                (out[j] - want).abs() < 1e-3 * want.abs().max(1.0),
                "{j}: {} {want}",
                out[j]
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c,fma")]
    unsafe fn avx512_matches_portable_inner() {
        let data: Vec<f32> = (0..256).map(|i| (i as f32 * 0.37).sin() * 30.0).collect();
        let mut a: [Avx512<false>; W] =
            std::array::from_fn(|i| Avx512::load(data.as_ptr().add(i * W)));
        let mut p: [Portable; W] =
            std::array::from_fn(|i| Portable::load(data.as_ptr().add(i * W)));
        Avx512::<false>::transpose(&mut a);
        Portable::transpose(&mut p);
        let mut out = [0f32; W];
        for i in 0..W {
            a[i].store(out.as_mut_ptr());
            assert_eq!(out, p[i].0, "row {i}");
        }
        for i in 0..W {
            let x = Avx512::<false>::load(data.as_ptr().add(i * W)).exp();
            x.store(out.as_mut_ptr());
            for j in 0..W {
                let want = data[i * W + j].exp();
                assert!(
                    (out[j] - want).abs() <= 4e-7 * want.max(1e-30),
                    "{} {} {}",
                    data[i * W + j],
                    out[j],
                    want
                );
            }
        }
        let bytes: Vec<u8> = (0..=255u8).collect();
        for chunk in bytes.chunks(W) {
            Avx512::<false>::load_e4m3(chunk.as_ptr()).store(out.as_mut_ptr());
            for (j, &b) in chunk.iter().enumerate() {
                if b & 0x7f != 0x7f {
                    assert_eq!(out[j], e4m3_to_f32(b), "{b:#x}");
                }
            }
            Avx512::<false>::load_e5m2(chunk.as_ptr()).store(out.as_mut_ptr());
            for (j, &b) in chunk.iter().enumerate() {
                let want = e5m2_to_f32(b);
                assert!(
                    out[j] == want || (want.is_nan() && out[j].is_nan()),
                    "{b:#x}"
                );
            }
            Avx512::<false>::load_i8(chunk.as_ptr() as *const i8).store(out.as_mut_ptr());
            assert_eq!(out[3], chunk[3] as i8 as f32);
        }
        let halves: Vec<u16> = (0..W as u16).map(|i| i * 4099).collect();
        Avx512::<false>::load_f16(halves.as_ptr()).store(out.as_mut_ptr());
        for j in 0..W {
            let want = f16_to_f32(halves[j]);
            assert!(out[j] == want || (want.is_nan() && out[j].is_nan()));
        }
        Avx512::<false>::load_bf16(halves.as_ptr()).store(out.as_mut_ptr());
        for j in 0..W {
            let want = bf16_to_f32(halves[j]);
            assert!(out[j] == want || (want.is_nan() && out[j].is_nan()));
        }
    }
}
