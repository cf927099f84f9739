//! Scripted unit tests of the KV manager: exact block ids, ref counts and free-queue order.

use super::*;

fn mgr(num_blocks: u32, block_size: u32, mode: PrefixMode) -> KvManager {
    KvManager::new(KvManagerConfig {
        num_blocks,
        block_size,
        prefix_mode: mode,
    })
    .unwrap()
}

#[test]
fn admit_and_free_without_prefix_cache() {
    let mut m = mgr(8, 4, PrefixMode::Off);
    let toks: Vec<u32> = (0..10).collect();
    let hit = m.match_prefix(0, &toks, 9);
    assert_eq!(hit.num_tokens, 0);
    assert!(m.admit(1, 0, &toks, &hit, 10, 0).unwrap());
    assert_eq!(m.block_table(1).unwrap(), &[1, 2, 3]);
    assert_eq!(m.num_free_blocks(), 4);
    m.check_invariants().unwrap();
    m.free(1, &toks).unwrap();
    assert_eq!(m.free_queue(), vec![1, 2, 3, 4, 5, 6, 7]);
    m.check_invariants().unwrap();
}
