//! The bytes of a tier move on the CPU: block rows copied between a layer's pool rows and its
//! host rows in one pass, `dst[pair[1]] = src[pair[0]]` for every pair, every layer.
//!
//! A torch gather/scatter (`index_select` then `index_copy_`) copies every byte twice, through a
//! temporary; this copies each row once, straight from its source row to its destination row
//! (a `memcpy` per row), spread over up to `threads` scoped threads by layer. Everything is
//! checked before the first byte moves: equal layer counts, one row width per layer pair,
//! buffers a whole number of rows, every index in range. Safe Rust, no pointers.
//!
//! Costs: O(pairs × layers) row copies, no allocation beyond the thread handles.

use crate::error::{KvError, KvResult};

/// Copies below this many bytes run on the calling thread (a thread costs more than it saves).
const MIN_PARALLEL_BYTES: usize = 1 << 20;

/// Checks one layer: `dst` and `src` hold whole rows of `row` bytes and every pair is in range.
fn check_layer(dst: &[u8], src: &[u8], row: usize, pairs: &[[u32; 2]]) -> KvResult<()> {
    let bad = |m: String| Err(KvError::InvalidArgument(format!("copy_block_rows: {m}")));
    if row == 0 || dst.len() % row != 0 || src.len() % row != 0 {
        return bad(format!(
            "rows of {row} bytes do not divide buffers of {} and {} bytes",
            src.len(),
            dst.len()
        ));
    }
    let (ns, nd) = (src.len() / row, dst.len() / row);
    if let Some(p) = pairs
        .iter()
        .find(|p| p[0] as usize >= ns || p[1] as usize >= nd)
    {
        return bad(format!(
            "pair {p:?} out of range ({ns} source rows, {nd} destination rows)"
        ));
    }
    Ok(())
}

fn copy_layer(dst: &mut [u8], src: &[u8], row: usize, pairs: &[[u32; 2]]) {
    for &[s, d] in pairs {
        let (s, d) = (s as usize * row, d as usize * row);
        dst[d..d + row].copy_from_slice(&src[s..s + row]);
    }
}

/// `dst[l]` row `p[1]` = `src[l]` row `p[0]` for every pair `p` and layer `l`; each layer's
/// row width is `rows[l]` bytes. Err (nothing copied): a layer or row mismatch, an index out
/// of range.
pub fn copy_block_rows(
    dst: Vec<&mut [u8]>,
    src: &[&[u8]],
    rows: &[usize],
    pairs: &[[u32; 2]],
    threads: usize,
) -> KvResult<()> {
    if dst.len() != src.len() || dst.len() != rows.len() {
        return Err(KvError::InvalidArgument(format!(
            "copy_block_rows: {} destination layers, {} source layers, {} row widths",
            dst.len(),
            src.len(),
            rows.len()
        )));
    }
    for ((d, s), &r) in dst.iter().zip(src).zip(rows) {
        check_layer(d, s, r, pairs)?;
    }
    let bytes: usize = rows.iter().sum::<usize>() * pairs.len();
    let threads = threads.clamp(1, dst.len().max(1));
    let mut work: Vec<(&mut [u8], &[u8], usize)> = dst
        .into_iter()
        .zip(src.iter().copied())
        .zip(rows.iter().copied())
        .map(|((d, s), r)| (d, s, r))
        .collect();
    if threads == 1 || bytes < MIN_PARALLEL_BYTES {
        for (d, s, r) in work {
            copy_layer(d, s, r, pairs);
        }
        return Ok(());
    }
    let per = work.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for chunk in work.chunks_mut(per) {
            scope.spawn(move || {
                for (d, s, r) in chunk.iter_mut() {
                    copy_layer(d, s, *r, pairs);
                }
            });
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_each_pair_in_every_layer_and_checks_first() {
        let src: Vec<Vec<u8>> = (0..3u8)
            .map(|l| (0..12).map(|i| l * 100 + i).collect())
            .collect();
        let srcs: Vec<&[u8]> = src.iter().map(|v| v.as_slice()).collect();
        for threads in [1, 2, 8] {
            let mut dst = vec![vec![0u8; 8]; 3]; // 4 rows of 2 bytes per layer
            let pairs = [[5, 0], [0, 3]];
            copy_block_rows(
                dst.iter_mut().map(|v| v.as_mut_slice()).collect(),
                &srcs,
                &[2, 2, 2],
                &pairs,
                threads,
            )
            .unwrap();
            for (l, d) in dst.iter().enumerate() {
                let l = l as u8 * 100;
                assert_eq!(d, &vec![l + 10, l + 11, 0, 0, 0, 0, l, l + 1]);
            }
        }
        let mut dst = vec![vec![0u8; 8]; 3];
        for (pairs, rows) in [
            ([[6, 0]], [2, 2, 2]),
            ([[0, 4]], [2, 2, 2]),
            ([[0, 0]], [3, 2, 2]),
        ] {
            let d: Vec<&mut [u8]> = dst.iter_mut().map(|v| v.as_mut_slice()).collect();
            assert!(copy_block_rows(d, &srcs, &rows, &pairs, 1).is_err());
        }
        let d: Vec<&mut [u8]> = dst.iter_mut().map(|v| v.as_mut_slice()).collect();
        assert!(copy_block_rows(d, &srcs[..2], &[2, 2, 2], &[], 1).is_err());
        assert!(
            dst.iter().all(|v| v.iter().all(|&b| b == 0)),
            "nothing copied on error"
        );
    }
}
