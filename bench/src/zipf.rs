//! Item choice: uniform or Zipf over `n` items, from a small seeded generator.
//!
//! Why our own generator and sampler rather than `rand` + `rand_distr`: the load
//! generator needs one 64-bit draw per request and a Zipf over a fixed, small catalogue
//! (10,000 items); a precomputed CDF with a binary search is exact, allocation-free per
//! draw and testable against the closed-form probabilities, and SplitMix64 is enough
//! for choosing items (it is not used for anything that needs cryptographic quality).

/// SplitMix64 (Steele, Lea, Flood 2014): one add and three xor-shift-multiplies per draw.
/// Each worker seeds its own, so workers never contend on a shared generator.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A float in [0, 1) from the top 53 bits (the mantissa of an f64).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An integer in [0, n). `n` must be at least 1. The multiply-shift mapping has a bias
    /// below 2^-32 for the catalogue sizes used here, which is irrelevant for item choice.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// True with probability `p` (clamped to [0, 1]).
    pub fn chance(&mut self, p: f64) -> bool {
        self.next_f64() < p
    }
}

/// How requests pick their item among `n`.
#[derive(Debug, Clone)]
pub enum ItemDist {
    /// Every item equally likely.
    Uniform { n: usize },
    /// Item of rank k (0-based) with probability proportional to 1 / (k+1)^s: a few items
    /// take most of the traffic, as in a sale. `cdf[k]` is P(rank <= k); the last is 1.
    Zipf { cdf: Vec<f64> },
}

impl ItemDist {
    pub fn uniform(n: usize) -> Result<ItemDist, String> {
        if n == 0 {
            return Err("--items: must be at least 1".into());
        }
        Ok(ItemDist::Uniform { n })
    }

    /// A Zipf over `n` items with exponent `s` (> 0 and finite); the CDF costs 8 bytes per
    /// item, computed once.
    pub fn zipf(n: usize, s: f64) -> Result<ItemDist, String> {
        if n == 0 {
            return Err("--items: must be at least 1".into());
        }
        if !(s.is_finite() && s > 0.0) {
            return Err(format!(
                "--zipf: exponent must be a positive number, got {s}"
            ));
        }
        let weights: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        // Rounding may leave the sum a hair below 1; a draw must always find a rank.
        if let Some(last) = cdf.last_mut() {
            *last = 1.0;
        }
        Ok(ItemDist::Zipf { cdf })
    }

    /// The index of the next item, in [0, len).
    pub fn sample(&self, rng: &mut Rng) -> usize {
        match self {
            ItemDist::Uniform { n } => rng.below(*n as u64) as usize,
            ItemDist::Zipf { cdf } => {
                let u = rng.next_f64();
                // First rank whose cumulative probability exceeds u.
                cdf.partition_point(|&c| c <= u).min(cdf.len() - 1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_frequencies_follow_one_over_rank() {
        let dist = ItemDist::zipf(100, 1.0).unwrap();
        let mut rng = Rng::new(7);
        let draws = 400_000;
        let mut counts = vec![0u64; 100];
        for _ in 0..draws {
            counts[dist.sample(&mut rng)] += 1;
        }
        let h: f64 = (1..=100).map(|k| 1.0 / k as f64).sum();
        for (rank, &count) in counts.iter().enumerate().take(10) {
            let expected = draws as f64 / ((rank + 1) as f64 * h);
            let ratio = count as f64 / expected;
            assert!(
                (0.95..1.05).contains(&ratio),
                "rank {rank}: {count} draws, expected about {expected:.0}"
            );
        }
        // Rank 1 takes about twice rank 2 and ten times rank 10.
        assert!(counts[0] > counts[1] && counts[1] > counts[9]);
    }

    #[test]
    fn zipf_never_samples_outside_the_catalogue() {
        let dist = ItemDist::zipf(3, 2.5).unwrap();
        let mut rng = Rng::new(1);
        assert!((0..10_000).all(|_| dist.sample(&mut rng) < 3));
    }

    #[test]
    fn uniform_covers_every_item_evenly() {
        let dist = ItemDist::uniform(10).unwrap();
        let mut rng = Rng::new(3);
        let mut counts = [0u64; 10];
        for _ in 0..100_000 {
            counts[dist.sample(&mut rng)] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_000..11_000).contains(&c)),
            "{counts:?}"
        );
    }

    #[test]
    fn bad_distribution_parameters_are_errors_not_panics() {
        assert!(ItemDist::zipf(0, 1.0).is_err());
        assert!(ItemDist::zipf(10, 0.0).is_err());
        assert!(ItemDist::zipf(10, f64::NAN).is_err());
        assert!(ItemDist::uniform(0).is_err());
    }

    #[test]
    fn float_draws_stay_in_the_unit_interval() {
        let mut rng = Rng::new(42);
        assert!((0..100_000).all(|_| (0.0..1.0).contains(&rng.next_f64())));
    }
}
