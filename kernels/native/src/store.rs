//! Writing a step's K/V rows into the paged cache: one row copy per token and K/V, in place.
//!
//! A token's K (or V) row holds every KV head (`row_bytes` = heads x head_dim x element size,
//! contiguous in the source and in the cache slot). Slot `s` is block `s / bs`, offset `s % bs`;
//! slots below `bs` (the null block, and negative ones) are skipped, as by the torch twin. Every slot is checked before the first write,
//! so a slot past the cache's end changes nothing. Cost: 2 x tokens x `row_bytes` of copying,
//! no allocation, on the calling thread (a decode step writes a few KB per layer).

/// Where and how to write (addresses and byte strides).
pub struct Store {
    pub key: *const u8,
    pub value: *const u8,
    pub key_stride: usize,
    pub value_stride: usize,
    pub row_bytes: usize,
    pub cache: *mut u8,
    pub stride_block: usize,
    /// bytes from a slot's K row to its V row
    pub v_offset: usize,
    pub stride_slot: usize,
    pub block_size: usize,
    pub num_slots: usize,
}

// The addresses are the caller's tensors, alive for the call (`py.detach` moves the struct).
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

/// The first slot (index, value) past the cache's end, if any.
pub fn bad_slot(slots: &[i64], num_slots: usize) -> Option<(usize, i64)> {
    slots
        .iter()
        .position(|&s| s >= 0 && s as u64 >= num_slots as u64)
        .map(|i| (i, slots[i]))
}

/// Copy each token's K and V row to its slot; the caller checked `bad_slot` is `None`.
///
/// # Safety
/// The addresses must hold `slots.len()` source rows and `num_slots` cache slots of the stated
/// strides, and the source must not overlap the cache.
pub unsafe fn store(s: &Store, slots: &[i64]) -> usize {
    let mut stored = 0;
    for (t, &slot) in slots.iter().enumerate() {
        if slot < s.block_size as i64 {
            continue;
        }
        let slot = slot as usize;
        let dst = s
            .cache
            .add((slot / s.block_size) * s.stride_block + (slot % s.block_size) * s.stride_slot);
        std::ptr::copy_nonoverlapping(s.key.add(t * s.key_stride), dst, s.row_bytes);
        std::ptr::copy_nonoverlapping(
            s.value.add(t * s.value_stride),
            dst.add(s.v_offset),
            s.row_bytes,
        );
        stored += 1;
    }
    stored
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_land_in_their_slots_and_the_null_block_is_skipped() {
        // 3 blocks of 2 slots, rows of 4 bytes; cache layout [block][kv][slot][row]
        let (bs, row) = (2usize, 4usize);
        let mut cache = vec![0u8; 3 * 2 * bs * row];
        let key: Vec<u8> = (1..=12).collect();
        let value: Vec<u8> = (101..=112).collect();
        let slots = [5i64, 1, 2];
        let s = Store {
            key: key.as_ptr(),
            value: value.as_ptr(),
            key_stride: row,
            value_stride: row,
            row_bytes: row,
            cache: cache.as_mut_ptr(),
            stride_block: 2 * bs * row,
            v_offset: bs * row,
            stride_slot: row,
            block_size: bs,
            num_slots: 6,
        };
        assert_eq!(bad_slot(&slots, 6), None);
        assert_eq!(unsafe { store(&s, &slots) }, 2);
        let at = |b: usize, kv: usize, t: usize| &cache[(b * 2 + kv) * bs * row + t * row..][..row];
        assert_eq!(at(2, 0, 1), &[1, 2, 3, 4]); // token 0 -> slot 5 = block 2, offset 1
        assert_eq!(at(2, 1, 1), &[101, 102, 103, 104]);
        assert_eq!(at(1, 0, 0), &[9, 10, 11, 12]); // token 2 -> slot 2
        assert!(cache[..2 * bs * row].iter().all(|&x| x == 0)); // null block untouched
    }

    #[test]
    fn a_slot_past_the_end_is_found_and_a_negative_one_skipped() {
        assert_eq!(bad_slot(&[2, 6, 3], 6), Some((1, 6)));
        assert_eq!(bad_slot(&[2, -1], 6), None);
        let mut cache = vec![0u8; 8];
        let rows = [7u8; 2];
        let s = Store {
            key: rows.as_ptr(),
            value: rows.as_ptr(),
            key_stride: 1,
            value_stride: 1,
            row_bytes: 1,
            cache: cache.as_mut_ptr(),
            stride_block: 4,
            v_offset: 2,
            stride_slot: 1,
            block_size: 2,
            num_slots: 4,
        };
        assert_eq!(unsafe { store(&s, &[-1, 3]) }, 1);
        assert_eq!(cache, [0, 0, 0, 0, 0, 7, 0, 7]);
    }
}
