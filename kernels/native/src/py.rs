//! The Python binding. `run_calls(...)` takes native calls over raw addresses (paged
//! attention, the K/V store, element-wise ops, the linear), checks every one first (a bad one
//! runs nothing) and runs them in order in one crossing, the GIL released once; one call is a
//! list of one. Also `argmax_bf16`, `set_gomp_parallel`, `features` and the linear's path probes.

use crate::attend::{Call, Dt, Fmt};
use crate::pool::{self, Mode};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// A paged-attention call over raw addresses (see `kvcore_kernels.cpu_native.run` for each
/// argument), checked: the job, or ValueError for an unknown code or shape (nothing run).
#[allow(clippy::too_many_arguments)]
fn attention_job(
    q: usize,
    q_stride_tok: usize,
    q_stride_head: usize,
    out: usize,
    out_stride_tok: usize,
    out_stride_head: usize,
    dtype: u8,
    kv: usize,
    fmt: u8,
    stride_block: usize,
    stride_tok: usize,
    stride_head: usize,
    v_offset: usize,
    scale_offset: usize,
    num_q_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    qsl: usize,
    seq_lens: usize,
    table: usize,
    table_stride: usize,
    scale: f32,
    window: i64,
    soft_cap: f32,
    alibi: usize,
    fp8_scale: usize,
    q_rot: usize,
    released: bool,
    work: usize,
    num_items: usize,
    merges: usize,
    num_merges: usize,
    partial: usize,
    max_rows: usize,
    threads: usize,
    mode: u8,
    isa: u8,
    fuse_heads: bool,
) -> PyResult<Job> {
    let dt = match dtype {
        0 => Dt::F32,
        1 => Dt::Bf16,
        2 => Dt::F16,
        _ => return Err(PyValueError::new_err(format!("unknown dtype code {dtype}"))),
    };
    let fmt = match fmt {
        0 => Fmt::F32,
        1 => Fmt::Bf16,
        2 => Fmt::F16,
        3 => Fmt::I8,
        4 => Fmt::E4m3,
        5 => Fmt::E5m2,
        _ => return Err(PyValueError::new_err(format!("unknown format code {fmt}"))),
    };
    let mode = mode_of(mode)?;
    let isa = isa_of(isa)?;
    if head_dim % crate::simd::W != 0
        || head_dim == 0
        || num_kv_heads == 0
        || num_q_heads % num_kv_heads != 0
    {
        return Err(PyValueError::new_err(
            "head_dim must be a multiple of 16, heads a multiple of KV heads",
        ));
    }
    if max_rows > 256 * num_q_heads {
        return Err(PyValueError::new_err(
            "an item holds at most 256 query tokens",
        ));
    }
    let c = Call {
        q: q as *const u8,
        q_stride_tok,
        q_stride_head,
        out: out as *mut u8,
        out_stride_tok,
        out_stride_head,
        dt,
        kv: kv as *const u8,
        fmt,
        stride_block,
        stride_tok,
        stride_head,
        v_offset,
        scale_offset,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        qsl: qsl as *const i64,
        seq_lens: seq_lens as *const i64,
        table: table as *const i64,
        table_stride,
        scale,
        window,
        soft_cap,
        alibi: alibi as *const f32,
        fp8_scale: fp8_scale as *const f32,
        q_rot: q_rot as *const f32,
        released,
        work: work as *const i64,
        merges: merges as *const i64,
        partial: partial as *mut f32,
        prefetch_next: prefetch_next(),
        amx: false,
        seg: false,
        dec: false,
        two_pass: false,
        lean: false,
    };
    Ok(Job::Attention {
        c,
        num_items,
        num_merges,
        max_rows,
        threads,
        mode,
        isa,
        fuse_heads,
    })
}

/// Whether an attention item prefetches the next one's first keys (`KVCORE_NATIVE_PREFETCH_NEXT=0`
/// turns it off; read once).
fn prefetch_next() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVCORE_NATIVE_PREFETCH_NEXT").map_or(true, |v| v != "0"))
}

/// A K/V store into cache slots (`crate::store`), checked: the job, or ValueError for a slot
/// past the cache's end (a negative slot, like one in the null block, is not stored: the
/// twin's rule), nothing written.
#[allow(clippy::too_many_arguments)]
fn store_job(
    key: usize,
    value: usize,
    key_stride: usize,
    value_stride: usize,
    row_bytes: usize,
    cache: usize,
    stride_block: usize,
    v_offset: usize,
    stride_slot: usize,
    block_size: usize,
    num_slots: usize,
    slots: usize,
    num_tokens: usize,
) -> PyResult<Job> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be positive"));
    }
    let list = unsafe { std::slice::from_raw_parts(slots as *const i64, num_tokens) };
    if let Some((i, s)) = crate::store::bad_slot(list, num_slots) {
        return Err(PyValueError::new_err(format!(
            "slot {s} (token {i}) is past the cache's {num_slots} slots"
        )));
    }
    let s = crate::store::Store {
        key: key as *const u8,
        value: value as *const u8,
        key_stride,
        value_stride,
        row_bytes,
        cache: cache as *mut u8,
        stride_block,
        v_offset,
        stride_slot,
        block_size,
        num_slots,
    };
    Ok(Job::Store {
        s,
        slots: slots as *const i64,
        n: num_tokens,
    })
}

/// `isa` checked: 0 the best instance, 1 portable, 2 at most AVX2, 3 the best without the VNNI
/// int8 / VBMI fp8 decode, 4 the best without AMX tiles, 5 the best without the prefill's
/// key segments, 6 the best without the AMX decode, 7 the best with bf16 decode items in one
/// pass (`crate::ISA_*`).
fn isa_of(isa: u8) -> PyResult<u8> {
    if isa > crate::ISA_TILE_LOOP {
        return Err(PyValueError::new_err(format!(
            "unknown instruction-set code {isa}"
        )));
    }
    Ok(isa)
}

fn mode_of(mode: u8) -> PyResult<Mode> {
    match mode {
        0 => Ok(Mode::Single),
        1 => Ok(Mode::Omp),
        2 => Ok(Mode::Rayon),
        _ => Err(PyValueError::new_err(format!("unknown thread mode {mode}"))),
    }
}

/// A row-wise bf16 element-wise op over raw addresses (`kvcore_kernels.ops_cpu` checks the
/// tensors): op 0 RMSNorm (+ residual), 1 SiLU-and-mul, 2 rotary in place; checked.
#[allow(clippy::too_many_arguments)]
fn elementwise_job(
    op: u8,
    rows: usize,
    dim: usize,
    x: usize,
    x_stride: usize,
    y: usize,
    y_stride: usize,
    w: usize,
    out: usize,
    out_stride: usize,
    eps: f32,
    heads: usize,
    head_stride: usize,
    threads: usize,
    mode: u8,
    isa: u8,
) -> PyResult<Job> {
    let op = match op {
        0 => crate::ops::Op::RmsNorm,
        1 => crate::ops::Op::SiluMul,
        2 => crate::ops::Op::Rotary,
        _ => {
            return Err(PyValueError::new_err(format!(
                "unknown element-wise op {op}"
            )))
        }
    };
    if dim == 0 || dim % 16 != 0 || (op == crate::ops::Op::Rotary && dim % 32 != 0) {
        return Err(PyValueError::new_err(format!(
            "width {dim} is not a multiple of 16 (rotary: 32)"
        )));
    }
    let mode = mode_of(mode)?;
    let isa = isa_of(isa)?;
    let c = crate::ops::Rows {
        op,
        rows,
        dim,
        x: x as *mut u16,
        x_stride,
        y: y as *mut u16,
        y_stride,
        w: w as *const u16,
        out: out as *mut u16,
        out_stride,
        eps,
        heads,
        head_stride,
    };
    Ok(Job::Ops {
        c,
        threads,
        mode,
        isa,
    })
}

/// A small-batch bf16 linear over a packed weight (`kvcore_kernels.linear_cpu`), checked.
#[allow(clippy::too_many_arguments)]
fn linear_job(
    x: usize,
    x_stride: usize,
    rows: usize,
    k: usize,
    w: usize,
    n_out: usize,
    bias: usize,
    out: usize,
    out_stride: usize,
    threads: usize,
    mode: u8,
    portable: bool,
    glu: bool,
    tall: bool,
) -> PyResult<Job> {
    if k == 0 || k % 2 != 0 || n_out == 0 || x_stride < k || out_stride < n_out {
        return Err(PyValueError::new_err(format!(
            "linear: k {k} must be even and > 0, n_out {n_out} > 0, strides {x_stride} >= k \
             and {out_stride} >= n_out"
        )));
    }
    if glu && bias != 0 {
        return Err(PyValueError::new_err(
            "linear: a gated (glu) call takes no bias",
        ));
    }
    let mode = mode_of(mode)?;
    let c = crate::linear::Linear {
        x: x as *const u16,
        x_stride,
        rows,
        k,
        w: w as *const u32,
        n_out,
        bias: bias as *const u16,
        out: out as *mut u16,
        out_stride,
        glu,
    };
    Ok(Job::Linear {
        c,
        threads,
        mode,
        portable,
        tall,
    })
}

/// Whether the small-batch linear has its AVX-512 BF16 path on this CPU.
#[pyfunction]
fn linear_fast_path() -> bool {
    crate::linear::has_fast_path()
}

/// Whether the small-batch linear has its AVX2 path (plain panels) on this CPU.
#[pyfunction]
fn linear_avx2_path() -> bool {
    crate::linear::has_avx2_path()
}

/// Record libgomp's `GOMP_parallel` address (0: none) for thread mode 1.
#[pyfunction]
fn set_gomp_parallel(addr: usize) {
    pool::set_gomp_parallel(addr);
}

/// (avx512 path available, avx512_bf16, amx (AMX-BF16 tiles granted: the prefill path uses them), GOMP_parallel set,
/// avx2 path available, avx512_vnni: VNNI and VBMI, the int8 / fp8 decode paths)
#[pyfunction]
fn features() -> (bool, bool, bool, bool, bool, bool) {
    #[cfg(target_arch = "x86_64")]
    let (bf16, amx) = (
        is_x86_feature_detected!("avx512bf16"),
        crate::has_avx512() && crate::amx::available(),
    );
    #[cfg(not(target_arch = "x86_64"))]
    let (bf16, amx) = (false, false);
    (
        crate::has_avx512(),
        bf16,
        amx,
        pool::has_gomp(),
        crate::has_avx2(),
        crate::has_avx512() && crate::has_vnni(),
    )
}

/// Row-wise argmax of `rows` bf16 rows of `n` values, `stride` elements apart, into `out`
/// (int64): the first index of the largest value, NaN above all (`argmax.rs`); releases the GIL.
#[pyfunction]
fn argmax_bf16(
    py: Python<'_>,
    x: usize,
    rows: usize,
    n: usize,
    stride: usize,
    out: usize,
) -> PyResult<()> {
    if n == 0 || (rows > 1 && stride < n) {
        return Err(PyValueError::new_err(format!(
            "argmax takes rows of n > 0 values at least n apart, got n {n}, stride {stride}"
        )));
    }
    py.detach(|| unsafe {
        crate::argmax::argmax_rows(x as *const u16, rows, n, stride, out as *mut i64)
    });
    Ok(())
}

/// A checked native call, ready to run without the GIL.
enum Job {
    Attention {
        c: Call,
        num_items: usize,
        num_merges: usize,
        max_rows: usize,
        threads: usize,
        mode: Mode,
        isa: u8,
        fuse_heads: bool,
    },
    Store {
        s: crate::store::Store,
        slots: *const i64,
        n: usize,
    },
    Ops {
        c: crate::ops::Rows,
        threads: usize,
        mode: Mode,
        isa: u8,
    },
    Linear {
        c: crate::linear::Linear,
        threads: usize,
        mode: Mode,
        portable: bool,
        tall: bool,
    },
}

/// Jobs crossing into `py.detach`: their addresses stay valid while the caller holds the
/// tensors (the Python side keeps every tensor a recorded call names until the run returns).
struct Jobs(Vec<Job>);
unsafe impl Send for Jobs {}

/// Run checked jobs in order with the GIL released; the first panic stops the rest.
fn run_jobs(py: Python<'_>, jobs: Vec<Job>) -> PyResult<()> {
    let jobs = Jobs(jobs);
    py.detach(move || {
        let jobs = jobs;
        for job in &jobs.0 {
            let ok = unsafe {
                match job {
                    Job::Attention {
                        c,
                        num_items,
                        num_merges,
                        max_rows,
                        threads,
                        mode,
                        isa,
                        fuse_heads,
                    } => crate::run(
                        c,
                        *num_items,
                        *num_merges,
                        *max_rows,
                        *threads,
                        *mode,
                        *isa,
                        *fuse_heads,
                    )
                    .map_err(|_| "native paged attention panicked"),
                    Job::Store { s, slots, n } => {
                        crate::store::store(s, std::slice::from_raw_parts(*slots, *n));
                        Ok(())
                    }
                    Job::Ops {
                        c,
                        threads,
                        mode,
                        isa,
                    } => crate::run_ops(c, *threads, *mode, *isa)
                        .map_err(|_| "the native element-wise op panicked"),
                    Job::Linear {
                        c,
                        threads,
                        mode,
                        portable,
                        tall,
                    } => crate::run_linear(c, *threads, *mode, *portable, *tall)
                        .map_err(|_| "the native linear panicked"),
                }
            };
            ok.map_err(PyRuntimeError::new_err)?;
        }
        Ok(())
    })
}

/// Op codes of `run_calls`' records.
const CALL_LINEAR: u8 = 0;
const CALL_ELEMENTWISE: u8 = 1;
const CALL_STORE: u8 = 2;
const CALL_ATTENTION: u8 = 3;

/// Many native calls in one crossing: each record is `(op, ints, floats)`, the arguments of
/// `linear_job` (op 0), `elementwise_job` (1), `store_job` (2) or `attention_job` (3) in their
/// order, the float ones (`eps`; `scale`, `soft_cap`) in `floats` and every other one
/// (addresses, sizes, codes, flags as 0 / 1) in `ints`. Every record is checked first, so a
/// bad one raises ValueError with nothing run; then they run in order with the GIL released
/// (RuntimeError if a kernel panicked). The caller keeps alive whatever the addresses point
/// into until this returns.
#[pyfunction]
fn run_calls(py: Python<'_>, calls: Vec<(u8, Vec<i64>, Vec<f64>)>) -> PyResult<()> {
    let mut jobs = Vec::with_capacity(calls.len());
    for (n, (op, a, f)) in calls.iter().enumerate() {
        let want = match *op {
            CALL_LINEAR => (14, 0),
            CALL_ELEMENTWISE => (15, 1),
            CALL_STORE => (13, 0),
            CALL_ATTENTION => (37, 2),
            _ => return Err(PyValueError::new_err(format!("call {n}: unknown op {op}"))),
        };
        if (a.len(), f.len()) != want {
            return Err(PyValueError::new_err(format!(
                "call {n} (op {op}): {} ints and {} floats, expected {} and {}",
                a.len(),
                f.len(),
                want.0,
                want.1
            )));
        }
        if a.iter().any(|&x| x < 0) {
            return Err(PyValueError::new_err(format!(
                "call {n} (op {op}): a negative integer argument"
            )));
        }
        let u = |i: usize| a[i] as usize;
        let b = |i: usize| a[i] != 0;
        let c8 = |i: usize| -> PyResult<u8> {
            u8::try_from(a[i])
                .map_err(|_| PyValueError::new_err(format!("call {n}: code {}", a[i])))
        };
        jobs.push(match *op {
            CALL_LINEAR => linear_job(
                u(0),
                u(1),
                u(2),
                u(3),
                u(4),
                u(5),
                u(6),
                u(7),
                u(8),
                u(9),
                c8(10)?,
                b(11),
                b(12),
                b(13),
            )?,
            CALL_ELEMENTWISE => elementwise_job(
                c8(0)?,
                u(1),
                u(2),
                u(3),
                u(4),
                u(5),
                u(6),
                u(7),
                u(8),
                u(9),
                f[0] as f32,
                u(10),
                u(11),
                u(12),
                c8(13)?,
                c8(14)?,
            )?,
            CALL_STORE => store_job(
                u(0),
                u(1),
                u(2),
                u(3),
                u(4),
                u(5),
                u(6),
                u(7),
                u(8),
                u(9),
                u(10),
                u(11),
                u(12),
            )?,
            _ => attention_job(
                u(0),
                u(1),
                u(2),
                u(3),
                u(4),
                u(5),
                c8(6)?,
                u(7),
                c8(8)?,
                u(9),
                u(10),
                u(11),
                u(12),
                u(13),
                u(14),
                u(15),
                u(16),
                u(17),
                u(18),
                u(19),
                u(20),
                u(21),
                f[0] as f32,
                a[22],
                f[1] as f32,
                u(23),
                u(24),
                u(25),
                b(26),
                u(27),
                u(28),
                u(29),
                u(30),
                u(31),
                u(32),
                u(33),
                c8(34)?,
                c8(35)?,
                b(36),
            )?,
        });
    }
    run_jobs(py, jobs)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(argmax_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(linear_fast_path, m)?)?;
    m.add_function(wrap_pyfunction!(linear_avx2_path, m)?)?;
    m.add_function(wrap_pyfunction!(set_gomp_parallel, m)?)?;
    m.add_function(wrap_pyfunction!(features, m)?)?;
    m.add_function(wrap_pyfunction!(run_calls, m)?)?;
    Ok(())
}
