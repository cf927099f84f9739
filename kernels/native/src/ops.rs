//! Row-wise element-wise ops of a bf16 forward on the CPU, each one pass over its rows in place
//! of the several torch ops (and temporaries) its formulation takes:
//!
//! * `Op::RmsNorm`: with a residual, `res <- bf16(x + res)` then `out <- bf16(w * bf16(s * r))`
//!   with `s = res` and `r = 1 / sqrt(mean(s^2) + eps)` in fp32 (Llama's half-precision RMSNorm:
//!   normalise in fp32, cast, then the weight product); without one, `s = x`. `out` may be `x`.
//! * `Op::SiluMul`: `out <- bf16(bf16(silu(gate)) * up)` over fused gate-up rows `[gate | up]`.
//! * `Op::Rotary`: each head `[x1 | x2] <- [x1 c - x2 s | x2 c + x1 s]` in place, every product
//!   and sum rounded to bf16 as torch's bf16 ops round them.
//!
//! Each rounds where the torch formulation (the twin, `kvcore_kernels/ops_cpu.py`) rounds, so
//! rotary is bit-exact and the others differ from the twin only where `exp` or the order of the
//! fp32 sum of squares differ (one bf16 step, rarely). Widths are multiples of 16 (the caller
//! checks). Rows run in tasks of about `TASK_ELEMS` elements on the pool; nothing is allocated.

use crate::simd::{Simd, W};

/// Elements per task: small calls (a decode step's rows) stay on the calling thread.
pub const TASK_ELEMS: usize = 32 * 1024;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Op {
    RmsNorm,
    SiluMul,
    Rotary,
}

/// One call over `rows` rows; strides in elements (bf16). Unused pointers are null.
pub struct Rows {
    pub op: Op,
    pub rows: usize,
    /// RmsNorm: hidden size; SiluMul: intermediate size (a gate-up row is `2 * dim`); Rotary:
    /// head dim
    pub dim: usize,
    /// RmsNorm: `x`; SiluMul: gate-up; Rotary: the heads (rotated in place)
    pub x: *mut u16,
    pub x_stride: usize,
    /// RmsNorm: the residual (null: none); Rotary: `cos` then `sin` rows of `dim / 2`
    pub y: *mut u16,
    pub y_stride: usize,
    /// RmsNorm: the weight; Rotary: `sin`
    pub w: *const u16,
    pub out: *mut u16,
    pub out_stride: usize,
    pub eps: f32,
    /// Rotary: heads per row and the element stride between them
    pub heads: usize,
    pub head_stride: usize,
}

unsafe impl Send for Rows {}
unsafe impl Sync for Rows {}

impl Rows {
    /// Rows per task.
    pub fn rows_per_task(&self) -> usize {
        let width = match self.op {
            Op::RmsNorm => self.dim,
            Op::SiluMul => 2 * self.dim,
            Op::Rotary => self.heads * self.dim,
        };
        (TASK_ELEMS / width.max(1)).max(1)
    }
}

/// Rows `lo .. hi` of the call.
#[inline(always)]
pub unsafe fn run_rows<S: Simd>(c: &Rows, lo: usize, hi: usize) {
    for t in lo..hi {
        match c.op {
            Op::RmsNorm => rms_norm_row::<S>(c, t),
            Op::SiluMul => silu_mul_row::<S>(c, t),
            Op::Rotary => {
                let x = c.x.add(t * c.x_stride);
                let cos = c.y.add(t * c.y_stride) as *const u16;
                let sin = c.w.add(t * c.y_stride);
                for h in 0..c.heads {
                    rotary_head::<S>(x.add(h * c.head_stride), cos, sin, c.dim / 2);
                }
            }
        }
    }
}

#[inline(always)]
unsafe fn rms_norm_row<S: Simd>(c: &Rows, t: usize) {
    let x = c.x.add(t * c.x_stride);
    let res = if c.y.is_null() {
        std::ptr::null_mut()
    } else {
        c.y.add(t * c.y_stride)
    };
    let out = c.out.add(t * c.out_stride);
    let mut acc = S::splat(0.0);
    let mut i = 0;
    while i < c.dim {
        let mut v = S::load_bf16(x.add(i));
        if !res.is_null() {
            v = v.add(S::load_bf16(res.add(i))).round_bf16();
            v.store_bf16(res.add(i));
        }
        acc = v.fma(v, acc);
        i += W;
    }
    let r = S::splat(1.0 / (acc.hsum() / c.dim as f32 + c.eps).sqrt());
    let src = if res.is_null() { x } else { res };
    i = 0;
    while i < c.dim {
        let n = S::load_bf16(src.add(i)).mul(r).round_bf16();
        n.mul(S::load_bf16(c.w.add(i))).store_bf16(out.add(i));
        i += W;
    }
}

#[inline(always)]
unsafe fn silu_mul_row<S: Simd>(c: &Rows, t: usize) {
    let gate = c.x.add(t * c.x_stride);
    let out = c.out.add(t * c.out_stride);
    let mut i = 0;
    while i < c.dim {
        let g = S::load_bf16(gate.add(i));
        let e = g.mul(S::splat(-1.0)).exp();
        let s = g.div(S::splat(1.0).add(e)).round_bf16();
        s.mul(S::load_bf16(gate.add(c.dim + i)))
            .store_bf16(out.add(i));
        i += W;
    }
}

#[inline(always)]
unsafe fn rotary_head<S: Simd>(x: *mut u16, cos: *const u16, sin: *const u16, half: usize) {
    let mut i = 0;
    while i < half {
        let (x1, x2) = (S::load_bf16(x.add(i)), S::load_bf16(x.add(half + i)));
        let (c, s) = (S::load_bf16(cos.add(i)), S::load_bf16(sin.add(i)));
        let o1 = x1.mul(c).round_bf16().sub(x2.mul(s).round_bf16());
        let o2 = x2.mul(c).round_bf16().add(x1.mul(s).round_bf16());
        o1.store_bf16(x.add(i));
        o2.store_bf16(x.add(half + i));
        i += W;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{bf16_to_f32, f32_to_bf16, Portable};

    fn bf(v: f32) -> u16 {
        f32_to_bf16(v)
    }
    fn fl(b: u16) -> f32 {
        bf16_to_f32(b)
    }
    fn r(v: f32) -> f32 {
        fl(bf(v))
    }

    fn data(n: usize, k: usize) -> Vec<u16> {
        (0..n)
            .map(|i| bf((((i * 7919 + k * 31) % 211) as f32 / 37.0 - 2.8) * 1.3))
            .collect()
    }

    /// Every instance this CPU has: portable, AVX2, the best.
    const ISAS: [u8; 3] = [crate::ISA_PORTABLE, crate::ISA_AVX2, crate::ISA_BEST];

    fn run(c: &Rows) {
        for isa in ISAS {
            unsafe { crate::run_ops_rows(c, 0, c.rows, isa) };
        }
    }

    #[test]
    fn rotary_matches_scalar_bits() {
        let (rows, heads, d) = (3, 2, 64);
        let x0 = data(rows * heads * d, 1);
        let cos = data(rows * d / 2, 2);
        let sin = data(rows * d / 2, 3);
        for isa in ISAS {
            let mut x = x0.clone();
            let c = Rows {
                op: Op::Rotary,
                rows,
                dim: d,
                x: x.as_mut_ptr(),
                x_stride: heads * d,
                y: cos.as_ptr() as *mut u16,
                y_stride: d / 2,
                w: sin.as_ptr(),
                out: std::ptr::null_mut(),
                out_stride: 0,
                eps: 0.0,
                heads,
                head_stride: d,
            };
            unsafe { crate::run_ops_rows(&c, 0, rows, isa) };
            for t in 0..rows {
                for h in 0..heads {
                    for i in 0..d / 2 {
                        let b = t * heads * d + h * d;
                        let (x1, x2) = (fl(x0[b + i]), fl(x0[b + d / 2 + i]));
                        let (cc, ss) = (fl(cos[t * d / 2 + i]), fl(sin[t * d / 2 + i]));
                        assert_eq!(x[b + i], bf(r(x1 * cc) - r(x2 * ss)));
                        assert_eq!(x[b + d / 2 + i], bf(r(x2 * cc) + r(x1 * ss)));
                    }
                }
            }
        }
    }

    #[test]
    fn rms_norm_and_silu_match_scalar() {
        let (rows, d) = (4, 48);
        let x0 = data(rows * d, 4);
        let res0 = data(rows * d, 5);
        let w = data(d, 6);
        let mut x = x0.clone();
        let mut res = res0.clone();
        let c = Rows {
            op: Op::RmsNorm,
            rows,
            dim: d,
            x: x.as_mut_ptr(),
            x_stride: d,
            y: res.as_mut_ptr(),
            y_stride: d,
            w: w.as_ptr(),
            out: x.as_mut_ptr(),
            out_stride: d,
            eps: 1e-5,
            heads: 0,
            head_stride: 0,
        };
        unsafe { run_rows::<Portable>(&c, 0, rows) };
        for t in 0..rows {
            let s: Vec<f32> = (0..d)
                .map(|i| r(fl(x0[t * d + i]) + fl(res0[t * d + i])))
                .collect();
            let rr = 1.0 / (s.iter().map(|v| v * v).sum::<f32>() / d as f32 + 1e-5).sqrt();
            for i in 0..d {
                assert_eq!(res[t * d + i], bf(s[i]));
                let want = r(fl(w[i]) * r(s[i] * rr));
                assert!(
                    (fl(x[t * d + i]) - want).abs() <= want.abs() / 128.0,
                    "{t} {i}"
                );
            }
        }
        let gu = data(rows * 2 * d, 7);
        let mut out = vec![0u16; rows * d];
        let c = Rows {
            op: Op::SiluMul,
            x: gu.as_ptr() as *mut u16,
            x_stride: 2 * d,
            y: std::ptr::null_mut(),
            out: out.as_mut_ptr(),
            out_stride: d,
            ..c
        };
        run(&c);
        for t in 0..rows {
            for i in 0..d {
                let g = fl(gu[t * 2 * d + i]);
                let want = r(r(g / (1.0 + (-g).exp())) * fl(gu[t * 2 * d + d + i]));
                let got = fl(out[t * d + i]);
                assert!(
                    (got - want).abs() <= want.abs() / 128.0,
                    "{t} {i}: {got} {want}"
                );
            }
        }
    }
}
