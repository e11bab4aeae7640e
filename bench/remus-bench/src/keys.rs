//! Which key a YCSB operation touches and what it does: uniform or zipfian key choice over the
//! loaded keys `1..=records`, and the 50/50 read/update mix.

use rand::Rng;
use rand_distr::{Distribution, Zipf};

/// YCSB's zipfian constant (`ZipfianGenerator.ZIPFIAN_CONSTANT`).
pub const YCSB_THETA: f64 = 0.99;

/// How keys are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeyDist {
    /// Every loaded key equally likely.
    Uniform,
    /// Zipfian with theta 0.99 over the key ranks, unscrambled: key 1 is the hottest, then 2, ...
    Zipfian,
    /// Zipfian with theta 0.99, each rank hashed (FNV-1a 64) onto the key space, as YCSB's
    /// ScrambledZipfianGenerator: the hot keys are spread over the space.
    ScrambledZipfian,
}

/// Chooses keys in `1..=records`.
pub struct KeyChooser {
    records: u64,
    dist: KeyDist,
    zipf: Option<Zipf<f64>>,
}

impl KeyChooser {
    pub fn new(records: u64, dist: KeyDist) -> Self {
        assert!(records > 0, "no records to choose from");
        let zipf = match dist {
            KeyDist::Uniform => None,
            KeyDist::Zipfian | KeyDist::ScrambledZipfian => {
                Some(Zipf::new(records as f64, YCSB_THETA).expect("records >= 1, theta > 0"))
            }
        };
        KeyChooser {
            records,
            dist,
            zipf,
        }
    }

    pub fn next(&self, rng: &mut impl Rng) -> i64 {
        match (&self.zipf, self.dist) {
            (None, _) => rng.random_range(1..=self.records) as i64,
            (Some(z), d) => {
                // Zipf samples a rank in 1..=records (as a float).
                let rank = (z.sample(rng) as u64).clamp(1, self.records);
                if d == KeyDist::ScrambledZipfian {
                    (fnv1a64(rank) % self.records + 1) as i64
                } else {
                    rank as i64
                }
            }
        }
    }
}

/// FNV-1a 64 over the 8 little-endian bytes of `v` (YCSB scrambles with an FNV-64 hash too).
pub fn fnv1a64(v: u64) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in v.to_le_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// A YCSB operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Update,
}

/// Reads with probability `read_pct` percent, updates otherwise (workload A: 50).
pub fn pick_op(rng: &mut impl Rng, read_pct: u32) -> Op {
    if rng.random_range(0..100) < read_pct {
        Op::Read
    } else {
        Op::Update
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn uniform_keys_cover_the_range_and_stay_in_it() {
        let mut rng = StdRng::seed_from_u64(1);
        let k = KeyChooser::new(10, KeyDist::Uniform);
        let mut seen = [0u32; 10];
        for _ in 0..10_000 {
            let v = k.next(&mut rng);
            assert!((1..=10).contains(&v), "{v}");
            seen[v as usize - 1] += 1;
        }
        // Each key about 1,000 times.
        assert!(seen.iter().all(|&n| (800..1200).contains(&n)), "{seen:?}");
    }

    #[test]
    fn zipfian_keys_are_skewed_towards_the_first_and_stay_in_range() {
        let mut rng = StdRng::seed_from_u64(2);
        let n = 1000;
        let k = KeyChooser::new(n, KeyDist::Zipfian);
        let mut counts = vec![0u32; n as usize];
        let samples = 100_000;
        for _ in 0..samples {
            let v = k.next(&mut rng);
            assert!((1..=n as i64).contains(&v), "{v}");
            counts[v as usize - 1] += 1;
        }
        // P(1) = 1 / H(1000, 0.99) ~ 0.134; the top 10 keys take about 39%.
        let p1 = f64::from(counts[0]) / samples as f64;
        assert!((0.11..0.16).contains(&p1), "p(key 1) = {p1}");
        let top10: u32 = counts[..10].iter().sum();
        let p10 = f64::from(top10) / samples as f64;
        assert!((0.34..0.44).contains(&p10), "p(top 10) = {p10}");
        assert!(counts[0] > counts[1] && counts[1] > counts[9] && counts[9] > counts[999]);
        // The tail is reached.
        assert!(counts[500..].iter().sum::<u32>() > 0);
    }

    #[test]
    fn scrambled_zipfian_keeps_the_skew_but_moves_the_hot_key() {
        let mut rng = StdRng::seed_from_u64(3);
        let n = 1000;
        let k = KeyChooser::new(n, KeyDist::ScrambledZipfian);
        let mut counts = vec![0u32; n as usize];
        for _ in 0..50_000 {
            let v = k.next(&mut rng);
            assert!((1..=n as i64).contains(&v), "{v}");
            counts[v as usize - 1] += 1;
        }
        let hot = (fnv1a64(1) % n + 1) as usize;
        let max = counts.iter().copied().max().unwrap();
        assert_eq!(counts[hot - 1], max, "rank 1 maps to key {hot}");
        assert_ne!(hot, 1);
    }

    #[test]
    fn one_record_is_always_key_one() {
        let mut rng = StdRng::seed_from_u64(4);
        for d in [
            KeyDist::Uniform,
            KeyDist::Zipfian,
            KeyDist::ScrambledZipfian,
        ] {
            let k = KeyChooser::new(1, d);
            assert!((0..100).all(|_| k.next(&mut rng) == 1), "{d:?}");
        }
    }

    #[test]
    fn the_mix_is_half_reads() {
        let mut rng = StdRng::seed_from_u64(5);
        let reads = (0..100_000)
            .filter(|_| pick_op(&mut rng, 50) == Op::Read)
            .count();
        assert!((48_500..51_500).contains(&reads), "{reads}");
        assert!((0..1000).all(|_| pick_op(&mut rng, 100) == Op::Read));
        assert!((0..1000).all(|_| pick_op(&mut rng, 0) == Op::Update));
    }
}
