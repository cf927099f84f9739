//! The Python binding: `paged_attention(...)` and `store_kv(...)` over addresses,
//! `elementwise(...)`, `linear(...)`, `set_gomp_parallel`, `features`.

use crate::attend::{Call, Dt, Fmt};
use crate::pool::{self, Mode};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// Paged attention over raw addresses (see `kvcore_kernels.cpu_native` for the meaning of each
/// argument); releases the GIL. Raises ValueError for an unknown code, RuntimeError on a panic.
#[pyfunction]
#[pyo3(signature = (
    q, q_stride_tok, q_stride_head, out, out_stride_tok, out_stride_head, dtype,
    kv, fmt, stride_block, stride_tok, stride_head, v_offset, scale_offset,
    num_q_heads, num_kv_heads, head_dim, block_size,
    qsl, seq_lens, table, table_stride,
    scale, window, soft_cap, alibi, fp8_scale, q_rot, released,
    work, num_items, merges, num_merges, partial, max_rows,
    threads, mode, isa, fuse_heads
))]
#[allow(clippy::too_many_arguments)]
fn paged_attention(
    py: Python<'_>,
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
) -> PyResult<()> {
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
    };
    let res = py.detach(|| unsafe {
        crate::run(
            &c, num_items, num_merges, max_rows, threads, mode, isa, fuse_heads,
        )
    });
    res.map_err(|_| PyRuntimeError::new_err("native paged attention panicked"))
}

/// Whether an attention item prefetches the next one's first keys (`KVCORE_NATIVE_PREFETCH_NEXT=0`
/// turns it off; read once).
fn prefetch_next() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVCORE_NATIVE_PREFETCH_NEXT").map_or(true, |v| v != "0"))
}

/// Write K/V rows into their cache slots (`crate::store`); returns the rows stored. Raises
/// ValueError, before writing anything, for a slot past the cache's end (a negative slot, like
/// one in the null block, is not stored: the twin's rule).
#[pyfunction]
#[pyo3(signature = (
    key, value, key_stride, value_stride, row_bytes, cache, stride_block, v_offset,
    stride_slot, block_size, num_slots, slots, num_tokens
))]
#[allow(clippy::too_many_arguments)]
fn store_kv(
    py: Python<'_>,
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
) -> PyResult<usize> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be positive"));
    }
    let slots = unsafe { std::slice::from_raw_parts(slots as *const i64, num_tokens) };
    if let Some((i, s)) = crate::store::bad_slot(slots, num_slots) {
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
    Ok(py.detach(|| unsafe { crate::store::store(&s, slots) }))
}

/// `isa` checked: 0 the best instance, 1 portable, 2 at most AVX2, 3 the best without the VNNI
/// int8 / VBMI fp8 decode, 4 the best without AMX tiles, 5 the best without the prefill's
/// key segments, 6 the best without the AMX decode, 7 the best with bf16 decode items in one
/// pass (`crate::ISA_*`).
fn isa_of(isa: u8) -> PyResult<u8> {
    if isa > crate::ISA_ONE_PASS {
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
/// tensors): op 0 RMSNorm (+ residual), 1 SiLU-and-mul, 2 rotary in place; releases the GIL.
#[pyfunction]
#[pyo3(signature = (
    op, rows, dim, x, x_stride, y, y_stride, w, out, out_stride, eps, heads, head_stride,
    threads, mode, isa
))]
#[allow(clippy::too_many_arguments)]
fn elementwise(
    py: Python<'_>,
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
) -> PyResult<()> {
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
    py.detach(|| unsafe { crate::run_ops(&c, threads, mode, isa) })
        .map_err(|_| PyRuntimeError::new_err("the native element-wise op panicked"))
}

/// Small-batch bf16 linear over a packed weight (`kvcore_kernels.linear_cpu`); releases the GIL.
#[pyfunction]
#[pyo3(signature = (x, x_stride, rows, k, w, n_out, bias, out, out_stride, threads, mode, portable, glu=false, tall=true))]
#[allow(clippy::too_many_arguments)]
fn linear(
    py: Python<'_>,
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
) -> PyResult<()> {
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
    py.detach(|| unsafe { crate::run_linear(&c, threads, mode, portable, tall) })
        .map_err(|_| PyRuntimeError::new_err("the native linear panicked"))
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

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(store_kv, m)?)?;
    m.add_function(wrap_pyfunction!(elementwise, m)?)?;
    m.add_function(wrap_pyfunction!(linear, m)?)?;
    m.add_function(wrap_pyfunction!(argmax_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(linear_fast_path, m)?)?;
    m.add_function(wrap_pyfunction!(linear_avx2_path, m)?)?;
    m.add_function(wrap_pyfunction!(set_gomp_parallel, m)?)?;
    m.add_function(wrap_pyfunction!(features, m)?)?;
    Ok(())
}
