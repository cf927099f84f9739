//! Seeded workloads for the criterion benches, shaped like benches/workloads.py (issue 2):
//! churn of 1..4,096-token sequences in a pool held ~80% full, and a prefix-sharing trace of
//! 2,000 requests over 50 Zipf-popular system prompts with 40% conversation continuations.
//! Same shapes and sizes as the Python generators, not the same random streams.

/// xorshift64*: a tiny deterministic generator (benches need no crate for this).
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `n` random token ids.
    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next_u64() % 32_000) as u32).collect()
    }
}

/// One churn round: ids to free, then (id, num_tokens) to admit.
pub struct Round {
    /// Requests finished this round.
    pub free: Vec<u64>,
    /// Requests admitted this round.
    pub alloc: Vec<(u64, usize)>,
}

/// Churn rounds totalling `num_ops` allocs + frees, then a round freeing everything.
pub fn churn(seed: u64, num_ops: usize, num_blocks: u32, block_size: usize) -> Vec<Round> {
    let mut rng = Rng::new(seed);
    let target = (0.8 * (num_blocks - 1) as f64) as usize;
    let mut live: Vec<(u64, usize)> = Vec::new();
    let (mut used, mut next_id, mut ops) = (0usize, 1u64, 0usize);
    let mut rounds = Vec::new();
    while ops < num_ops {
        let mut free = Vec::new();
        if used >= target {
            for _ in 0..32.min(live.len()).min(num_ops - ops) {
                let i = rng.range(0, live.len() as u64 - 1) as usize;
                let (id, blocks) = live.swap_remove(i);
                free.push(id);
                used -= blocks;
            }
            ops += free.len();
        }
        let mut alloc = Vec::new();
        while used < target && ops < num_ops {
            let n = rng.range(1, 4096) as usize;
            let blocks = n.div_ceil(block_size);
            if used + blocks > num_blocks as usize - 1 {
                break;
            }
            alloc.push((next_id, n));
            live.push((next_id, blocks));
            used += blocks;
            next_id += 1;
            ops += 1;
        }
        rounds.push(Round { free, alloc });
    }
    rounds.push(Round {
        free: live.iter().map(|x| x.0).collect(),
        alloc: Vec::new(),
    });
    rounds
}

/// A request of the prefix trace: prompt, then the output it generates.
pub struct Request {
    /// Prompt tokens (looked up, then computed).
    pub prompt: Vec<u32>,
    /// Generated tokens (inserted with the prompt on completion).
    pub output: Vec<u32>,
}

/// The prefix-sharing trace.
pub fn prefix_trace(seed: u64, num_requests: usize) -> Vec<Request> {
    let mut rng = Rng::new(seed);
    let systems: Vec<Vec<u32>> = (0..50)
        .map(|_| {
            let n = rng.range(500, 2000) as usize;
            rng.tokens(n)
        })
        .collect();
    let weights: Vec<f64> = (1..=50).map(|r| (r as f64).powf(-1.1)).collect();
    let sum: f64 = weights.iter().sum();
    let mut reqs: Vec<Request> = Vec::with_capacity(num_requests);
    for i in 0..num_requests {
        let n_suffix = rng.range(50, 500) as usize;
        let suffix = rng.tokens(n_suffix);
        let n_out = rng.range(16, 256) as usize;
        let output = rng.tokens(n_out);
        let mut prompt;
        if i > 0 && rng.unit() < 0.4 {
            let prev = &reqs[rng.range(0, i as u64 - 1) as usize];
            prompt = prev.prompt.clone();
            prompt.extend_from_slice(&prev.output);
        } else {
            let mut x = rng.unit() * sum;
            let mut k = 0;
            while k < 49 && x >= weights[k] {
                x -= weights[k];
                k += 1;
            }
            prompt = systems[k].clone();
        }
        prompt.extend_from_slice(&suffix);
        reqs.push(Request { prompt, output });
    }
    reqs
}
