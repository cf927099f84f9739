//! Native CPU kernels of `kvcore_kernels` (module `kvcore_kernels._native`): paged attention that
//! reads K and V in place through the block table. Knows nothing of torch or kvcore: it takes
//! addresses, strides and sizes; `kvcore_kernels/cpu_native.py` checks the tensors and builds
//! the work list once per step.
//!
//! * `attend`: one item (request x KV head x query tokens x key range), the online softmax.
//! * `cols`: the transposed path of an item with many rows (blocks of 16 rows, AVX-512 BF16).
//! * `amx`: that path's two products on AMX tiles where the CPU and OS have them.
//! * `vnni`: int8 decode as integer dot products of the codes (AVX-512 VNNI).
//! * `simd`: the 16-lane vector type, AVX-512 or portable, chosen at run time here (with
//!   `avx2`: the same type for AVX2 CPUs without AVX-512).
//! * `pool`: torch's OpenMP team, a rayon pool or the calling thread.
//! * `store`: a step's K/V rows written into their cache slots.
//! * `ops`: row-wise bf16 element-wise ops of a forward (RMSNorm + residual, SiLU-and-mul, rotary).
//! * `linear`: small-batch bf16 linear layers (a decode step's GEMMs) over a packed weight.

// Index loops over fixed 16-lane arrays read clearer than iterator chains here; the unsafe
// functions' contract (live memory of the stated shapes) is stated once, on `run`.
#![allow(
    clippy::needless_range_loop,
    clippy::missing_safety_doc,
    clippy::too_many_arguments
)]
#![allow(clippy::result_unit_err, clippy::manual_is_multiple_of)]

#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod argmax;
pub mod attend;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
pub mod cols;
pub mod dec_amx;
pub mod dec_lean;
pub mod linear;
pub mod ops;
pub mod pool;
pub mod simd;
pub mod store;
pub mod vnni;

use attend::{run_item, scratch_len, Call};
use simd::Portable;
use std::cell::RefCell;

thread_local! {
    /// Per-thread scratch, grown to the largest item seen and kept (no allocation per call).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's rotated query rows (`Call::q_rot`), grown and kept likewise.
    static ROTATED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Whether this CPU runs the AVX-512 path (avx512f/bw/dq/vl).
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Which instance runs (`isa` of `run`, `run_ops`): the best this CPU has (AVX-512, else AVX2,
/// else portable), the portable one, at most AVX2, or the best without the VNNI int8 decode
/// (tests run every path on one CPU).
pub const ISA_BEST: u8 = 0;
pub const ISA_PORTABLE: u8 = 1;
pub const ISA_AVX2: u8 = 2;
pub const ISA_NO_VNNI: u8 = 3;
/// The best without AMX tiles (the transposed prefill path's products on AVX-512 BF16).
pub const ISA_NO_AMX: u8 = 4;
/// The best, with AMX tiles per key tile only (no `cols::head_seg`; for A/B runs).
pub const ISA_NO_SEG: u8 = 5;
/// The best, with bf16 decode items on the AVX-512 tile loop instead of AMX (`dec_amx.rs`; for
/// A/B runs).
pub const ISA_NO_DEC: u8 = 6;
/// The best, with bf16 decode items off AMX on the one-pass online softmax of the tile loop
/// instead of two passes (`attend::run_item`'s `two_pass`; for A/B runs).
pub const ISA_ONE_PASS: u8 = 7;
/// The best, with decode items off AMX on the tile loop instead of `dec_lean.rs` (for A/B runs):
/// bf16 on its two passes (`attend::run_item`'s `two_pass`; bit-identical), int8 / fp8 on its
/// one-pass online softmax (the same to rounding).
pub const ISA_TILE_LOOP: u8 = 8;

/// Whether this CPU has AVX2, FMA and F16C (the `avx2::Avx2` instance).
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(avx2::has_avx2)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// (AVX-512, AVX2) as `isa` allows on this CPU: at most one is true.
fn pick_isa(isa: u8) -> (bool, bool) {
    let avx512 = matches!(
        isa,
        ISA_BEST
            | ISA_NO_VNNI
            | ISA_NO_AMX
            | ISA_NO_SEG
            | ISA_NO_DEC
            | ISA_ONE_PASS
            | ISA_TILE_LOOP
    ) && has_avx512();
    (avx512, !avx512 && isa != ISA_PORTABLE && has_avx2())
}

/// (item, its KV heads) of the task a thread runs next, where known
type Next = Option<(usize, (usize, usize))>;

type ItemFn = unsafe fn(&Call, usize, (usize, usize), Next, &mut [f32]);

unsafe fn item_portable<const F: u8>(
    c: &Call,
    item: usize,
    heads: (usize, usize),
    n: Next,
    s: &mut [f32],
) {
    run_item::<Portable, F>(c, item, heads, n, s)
}

/// A `run_item` instance compiled with target features `$feat` (its intrinsics inline only into
/// a function compiled with them).
macro_rules! item_instance {
    ($(#[$doc:meta])* $name:ident, $feat:literal, $simd:ty) => {
        $(#[$doc])*
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        unsafe fn $name<const F: u8>(
            c: &Call,
            item: usize,
            heads: (usize, usize),
            n: Next,
            s: &mut [f32],
        ) {
            run_item::<$simd, F>(c, item, heads, n, s)
        }
    };
}

item_instance!(item_avx2, "avx2,fma,f16c", avx2::Avx2);
item_instance!(
    item_avx512,
    "avx512f,avx512bw,avx512dq,avx512vl,f16c,fma",
    simd::Avx512<false>
);
item_instance!(
    item_avx512_bf16,
    "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,f16c,fma",
    simd::Avx512<true>
);
item_instance!(
    item_avx512_vnni,
    "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni,f16c,fma",
    simd::Avx512<true, true>
);
item_instance!(
    /// The fp8 instance: `item_avx512_vnni` with VBMI too (its `vpermt2b`); kept apart, as
    /// the int8 instance compiled with VBMI ran 18 % slower.
    item_avx512_vbmi,
    "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni,avx512vbmi,f16c,fma",
    simd::Avx512<true, true>
);

/// Whether this CPU has AVX-512 VNNI and VBMI (int8 decode by integer dot products, fp8 decode
/// by shift and mask after `vpermt2b`: `vnni.rs`).
pub fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vbmi")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether bf16 caches take the AVX-512 BF16 dot-product path (`KVCORE_NATIVE_NO_DPBF16` unset).
pub fn use_dpbf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            is_x86_feature_detected!("avx512bf16")
                && std::env::var_os("KVCORE_NATIVE_NO_DPBF16").is_none()
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn item_fn(fmt: attend::Fmt, isa: u8) -> ItemFn {
    let (avx512, avx2) = pick_isa(isa);
    macro_rules! pick {
        ($f:ident) => {
            match attend::fmt_code(fmt) {
                0 => $f::<0> as ItemFn,
                1 => $f::<1>,
                2 => $f::<2>,
                3 => $f::<3>,
                4 => $f::<4>,
                _ => $f::<5>,
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if avx512 {
        if use_dpbf16() {
            match fmt {
                attend::Fmt::Bf16 => return item_avx512_bf16::<1>,
                attend::Fmt::I8 if isa != ISA_NO_VNNI && has_vnni() => return item_avx512_vnni::<3>,
                attend::Fmt::I8 => return item_avx512_bf16::<3>,
                attend::Fmt::E4m3 if isa != ISA_NO_VNNI && has_vnni() => {
                    return item_avx512_vbmi::<4>
                }
                attend::Fmt::E5m2 if isa != ISA_NO_VNNI && has_vnni() => {
                    return item_avx512_vbmi::<5>
                }
                attend::Fmt::E4m3 => return item_avx512_bf16::<4>,
                attend::Fmt::E5m2 => return item_avx512_bf16::<5>,
                _ => {}
            }
        }
        return pick!(item_avx512);
    }
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        return pick!(item_avx2);
    }
    let _ = (avx512, avx2);
    pick!(item_portable)
}

/// `attend::rotate_rows` compiled with target features `$feat`.
macro_rules! rotate_instance {
    ($name:ident, $feat:literal, $simd:ty) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        unsafe fn $name(c: &Call, n_tok: usize, dst: *mut u8, x: &mut [f32]) {
            attend::rotate_rows::<$simd>(c, n_tok, dst, x)
        }
    };
}

rotate_instance!(rotate_avx2, "avx2,fma,f16c", avx2::Avx2);
rotate_instance!(
    rotate_avx512,
    "avx512f,avx512bw,avx512dq,avx512vl,f16c,fma",
    simd::Avx512<false>
);

/// `c` with its query rows rotated (`c.q_rot`) into `buf`, `d` apart (`attend::rotate_rows`:
/// once per call, on the calling thread, before the items).
unsafe fn rotated_call(c: &Call, num_items: usize, isa: u8, buf: &mut Vec<f32>) -> Call {
    let (hq, d) = (c.num_q_heads, c.head_dim);
    let mut n_tok = 0; // the tokens the items read: packed, from 0
    for i in 0..num_items {
        let w = std::slice::from_raw_parts(c.work.add(6 * i), 6);
        n_tok = n_tok.max((w[1] + w[2]) as usize);
    }
    let rows = (n_tok * hq * d * c.dt.size()).div_ceil(4);
    if buf.len() < rows + d {
        buf.resize(rows + d, 0.0);
    }
    let (dst, x) = buf.split_at_mut(rows);
    let dst = dst.as_mut_ptr() as *mut u8;
    let (avx512, avx2) = pick_isa(isa);
    #[cfg(target_arch = "x86_64")]
    if avx512 {
        rotate_avx512(c, n_tok, dst, &mut x[..d]);
    } else if avx2 {
        rotate_avx2(c, n_tok, dst, &mut x[..d]);
    }
    if !cfg!(target_arch = "x86_64") || !(avx512 || avx2) {
        attend::rotate_rows::<Portable>(c, n_tok, dst, &mut x[..d]);
    }
    Call {
        q: dst,
        q_stride_tok: hq * d,
        q_stride_head: d,
        q_rot: std::ptr::null(),
        ..*c
    }
}

/// Run every work item (all KV heads in one task if `fuse_heads`, else one task per KV head),
/// then every merge group (one task per KV head); `isa`: `ISA_BEST`, `ISA_PORTABLE` or
/// `ISA_AVX2`. Where `c.q_rot` is set the query rows are rotated first (`rotated_call`, into
/// the calling thread's kept `ROTATED` buffer).
///
/// # Safety
/// Every pointer and stride of `c` must describe live memory of the stated shapes; `max_rows`
/// bounds the rows (query tokens x query heads) of any item; `c.q_rot`, when set, points to
/// `head_dim x head_dim` floats.
#[allow(clippy::too_many_arguments)]
pub unsafe fn run(
    c: &Call,
    num_items: usize,
    num_merges: usize,
    max_rows: usize,
    threads: usize,
    mode: pool::Mode,
    isa: u8,
    fuse_heads: bool,
) -> Result<(), ()> {
    let mut rot_buf = Vec::new();
    let rc;
    let c = if c.q_rot.is_null() {
        c
    } else {
        rot_buf = ROTATED.with(|b| std::mem::take(&mut *b.borrow_mut()));
        rc = rotated_call(c, num_items, isa, &mut rot_buf);
        &rc
    };
    // AMX tiles for the transposed prefill path where the CPU and OS have them (`amx.rs`)
    #[cfg(target_arch = "x86_64")]
    let amx = matches!(
        isa,
        ISA_BEST | ISA_NO_VNNI | ISA_NO_SEG | ISA_NO_DEC | ISA_ONE_PASS | ISA_TILE_LOOP
    ) && has_avx512()
        && use_dpbf16()
        && amx::available();
    #[cfg(not(target_arch = "x86_64"))]
    let amx = false;
    let ca = Call {
        amx,
        seg: amx && isa != ISA_NO_SEG,
        dec: amx && isa != ISA_NO_DEC,
        two_pass: isa != ISA_ONE_PASS,
        lean: isa != ISA_ONE_PASS && isa != ISA_TILE_LOOP,
        ..*c
    };
    let c = &ca;
    let res = (|| -> Result<(), ()> {
        let f = item_fn(c.fmt, isa);
        let hk = c.num_kv_heads;
        let hpt = if fuse_heads { hk } else { 1 }; // KV heads per task
        let per_item = hk / hpt;
        let need = scratch_len(max_rows / hk * hpt, c.head_dim, hpt);
        let task = |t: usize| {
            (
                t / per_item,
                ((t % per_item) * hpt, (t % per_item) * hpt + hpt),
            )
        };
        pool::for_each_ahead(num_items * per_item, threads, mode, &|t, next| {
            SCRATCH.with(|s| {
                let mut s = s.borrow_mut();
                if s.len() < need {
                    s.resize(need, 0.0);
                }
                let (item, heads) = task(t);
                unsafe { f(c, item, heads, next.map(task), &mut s[..need]) };
            })
        })?;
        if num_merges > 0 {
            pool::for_each(num_merges * hk, threads, mode, &|t| unsafe {
                attend::merge(c, t / hk, t % hk)
            })?;
        }
        Ok(())
    })();
    if !rot_buf.is_empty() {
        ROTATED.with(|b| *b.borrow_mut() = rot_buf); // kept for the next call
    }
    res
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c,fma")]
unsafe fn ops_avx512(c: &ops::Rows, lo: usize, hi: usize) {
    ops::run_rows::<simd::Avx512<false>>(c, lo, hi)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn ops_avx2(c: &ops::Rows, lo: usize, hi: usize) {
    ops::run_rows::<avx2::Avx2>(c, lo, hi)
}

/// Rows `lo .. hi` of an element-wise call on the instance `isa` picks (as `run`).
///
/// # Safety
/// The pointers and strides of `c` must describe live bf16 rows of the stated shapes.
pub unsafe fn run_ops_rows(c: &ops::Rows, lo: usize, hi: usize, isa: u8) {
    let (avx512, avx2) = pick_isa(isa);
    #[cfg(target_arch = "x86_64")]
    if avx512 {
        return ops_avx512(c, lo, hi);
    }
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        return ops_avx2(c, lo, hi);
    }
    let _ = (avx512, avx2);
    ops::run_rows::<Portable>(c, lo, hi)
}

/// An element-wise call over all its rows, in tasks of `c.rows_per_task()` rows.
///
/// # Safety
/// As `run_ops_rows`; rows written by one task are read by no other.
pub unsafe fn run_ops(c: &ops::Rows, threads: usize, mode: pool::Mode, isa: u8) -> Result<(), ()> {
    let per = c.rows_per_task();
    pool::for_each(c.rows.div_ceil(per), threads, mode, &|t| unsafe {
        run_ops_rows(c, t * per, ((t + 1) * per).min(c.rows), isa)
    })
}

/// A linear over all its panels: the blocked AVX2 GEMM where `linear::takes_tall` (with `tall`
/// allowed), else tasks of `c.panels_per_task()` panels over `c.row_blocks()` blocks of rows.
///
/// # Safety
/// The pointers and strides of `c` must describe live memory of the stated shapes; `out` must
/// not overlap `x`, the weight or the bias.
pub unsafe fn run_linear(
    c: &linear::Linear,
    threads: usize,
    mode: pool::Mode,
    portable: bool,
    tall: bool,
) -> Result<(), ()> {
    #[cfg(target_arch = "x86_64")]
    if linear::takes_tall(c, portable, tall) {
        let (_, _, tasks) = linear::tall::plan(c);
        return pool::for_each(tasks, threads, mode, &|t| unsafe {
            linear::tall::run_task(c, t)
        });
    }
    // tasks: runs of panels, each over a block of rows (panel-major: a task's neighbours share
    // its panels, so only a change of panels asks for the next ones ahead)
    let paired = linear::paired(c, portable);
    let per = c.panels_per_task(paired);
    let panels = c.panels();
    let (blocks, block_rows) = c.row_blocks(threads.max(1), paired);
    let range = |t: usize| (t / blocks * per, ((t / blocks + 1) * per).min(panels));
    let tasks = panels.div_ceil(per) * blocks;
    pool::for_each_ahead(tasks, threads, mode, &|t, next| unsafe {
        let (lo, hi) = range(t);
        let rows = c.rows_from(t % blocks * block_rows, block_rows);
        let next = next.map(range).filter(|&r| r != (lo, hi));
        linear::run_panels(&rows, lo, hi, next, portable)
    })
}

#[cfg(feature = "python")]
mod py;
