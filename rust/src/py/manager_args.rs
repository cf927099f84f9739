//! Batch checks of the `KvCacheManager` binding: tokens split by offsets, ids named twice,
//! live ids, the tokens each request holds, lengths and block ids. Parsing ones run before the
//! manager's lock is taken; the `&KvManager` ones run under it, before anything mutates.

use std::collections::{HashMap, HashSet};

use pyo3::prelude::*;

use super::arrays::{counts, spans, tokens, Tokens};
use super::errors::invalid;
use crate::error::{KvError, KvResult};
use crate::kv_manager::KvManager;

/// Flat tokens and each request's `[start, end)` span in them.
pub(crate) type TokenSpans<'py> = (Tokens<'py>, Vec<(usize, usize)>);

/// Optional tokens + offsets for `n` requests (offsets may be left out for one request).
pub(crate) fn token_spans<'py>(
    toks: Option<&Bound<'py, PyAny>>,
    offsets: Option<&Bound<'py, PyAny>>,
    n: usize,
) -> PyResult<Option<TokenSpans<'py>>> {
    let toks = toks.filter(|t| !t.is_none());
    let offsets = offsets.filter(|o| !o.is_none());
    match (toks, offsets) {
        (None, None) => Ok(None),
        (Some(t), Some(o)) => {
            let t = tokens(t, "tokens")?;
            let sp = spans(&counts(o, "offsets")?, n, t.slice().len())?;
            Ok(Some((t, sp)))
        }
        (Some(t), None) if n == 1 => {
            let t = tokens(t, "tokens")?;
            let len = t.slice().len();
            Ok(Some((t, vec![(0, len)])))
        }
        (Some(_), None) => Err(invalid(format!(
            "offsets are needed to split tokens between {n} requests"
        ))),
        (None, Some(_)) => Err(invalid("offsets given without tokens".into())),
    }
}

/// Rejects a batch that names the same id twice.
pub(crate) fn unique(reqs: &[u64], dup: impl Fn(u64) -> KvError) -> PyResult<()> {
    let mut seen = HashSet::with_capacity(reqs.len());
    match reqs.iter().find(|&&r| !seen.insert(r)) {
        Some(&r) => Err(dup(r).into()),
        None => Ok(()),
    }
}

pub(crate) fn check_live(m: &KvManager, reqs: &[u64]) -> KvResult<()> {
    match reqs.iter().find(|&&r| !m.contains(r)) {
        Some(&r) => Err(KvError::UnknownRequest(r)),
        None => Ok(()),
    }
}

/// Each request's span may be stated as its computed tokens (see `KvManager::check_tokens`).
pub(crate) fn check_spans(
    m: &KvManager,
    reqs: &[u64],
    toks: &[u32],
    sp: &[(usize, usize)],
) -> KvResult<()> {
    for (&r, &(s, e)) in reqs.iter().zip(sp) {
        m.check_tokens(r, &toks[s..e])?;
    }
    Ok(())
}

/// A request named more than once in a batch states the same tokens each time (each span a
/// prefix of its longest), so checking the batch up front covers every call in it.
pub(crate) fn consistent_repeats(
    reqs: &[u64],
    toks: &[u32],
    sp: &[(usize, usize)],
) -> PyResult<()> {
    let mut longest: HashMap<u64, usize> = HashMap::with_capacity(reqs.len());
    for (i, &r) in reqs.iter().enumerate() {
        let j = longest.entry(r).or_insert(i);
        if sp[i].1 - sp[i].0 > sp[*j].1 - sp[*j].0 {
            *j = i;
        }
    }
    if longest.len() == reqs.len() {
        return Ok(());
    }
    for (i, &r) in reqs.iter().enumerate() {
        let ((s, e), (ls, _)) = (sp[i], sp[longest[&r]]);
        if toks[s..e] != toks[ls..ls + (e - s)] {
            return Err(invalid(format!(
                "request {r} is named twice in one batch with different tokens"
            )));
        }
    }
    Ok(())
}

pub(crate) fn too_long(m: &KvManager, reqs: &[u64], totals: &[usize]) -> KvResult<()> {
    let max = m.max_tokens();
    match totals.iter().position(|&t| t > max) {
        Some(i) => Err(KvError::TooLong(format!(
            "request {} needs {} tokens; the pool holds {max}",
            reqs[i], totals[i]
        ))),
        None => Ok(()),
    }
}

/// A block id in the pool (`InvalidBlockError` otherwise).
pub(crate) fn block_id(m: &KvManager, b: Option<i64>) -> KvResult<u32> {
    b.and_then(|b| u32::try_from(b).ok())
        .filter(|&b| b < m.num_blocks())
        .ok_or_else(|| {
            KvError::InvalidBlock(format!(
                "block {} outside a pool of {}",
                b.map_or("?".into(), |b| b.to_string()),
                m.num_blocks()
            ))
        })
}
