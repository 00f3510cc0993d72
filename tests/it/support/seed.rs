//! One seed for every random choice of an invariant-harness run, so that a
//! failing run can be replayed: `IDEMGATE_TEST_SEED=<u64>` sets it, else it
//! is drawn once per test process; the report and the failure message print
//! it. Each choice draws from a generator derived from the seed and a label
//! naming who chooses (the fault, a traffic worker, a key's n-th execution),
//! never from a shared one, so what a choice draws does not depend on which
//! task happened to run first.

use rand::rngs::StdRng;
use rand::SeedableRng;
use std::fmt;
use std::sync::OnceLock;

/// The variable that fixes the seed.
pub const ENV: &str = "IDEMGATE_TEST_SEED";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seed(pub u64);

impl Seed {
    /// This process's seed: [`ENV`], else random (the same for every test).
    pub fn get() -> Self {
        static SEED: OnceLock<u64> = OnceLock::new();
        Self(*SEED.get_or_init(|| {
            match std::env::var(ENV) {
                Ok(v) => v
                    .trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("{ENV}={v:?} is not an unsigned 64-bit number")),
                Err(_) => rand::random(),
            }
        }))
    }

    /// The seed for `label` under this one. Stable across runs and
    /// platforms (FNV-1a over the label, then splitmix64), unlike std's
    /// hashers.
    pub fn derive(self, label: impl fmt::Display) -> Self {
        let fnv = label
            .to_string()
            .bytes()
            .fold(self.0 ^ 0xcbf2_9ce4_8422_2325, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            });
        let mut z = fnv.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Self(z ^ (z >> 31))
    }

    /// A generator for `label`'s choices.
    pub fn rng(self, label: impl fmt::Display) -> StdRng {
        StdRng::seed_from_u64(self.derive(label).0)
    }
}

/// How to replay: "IDEMGATE_TEST_SEED=<n>".
impl fmt::Display for Seed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{ENV}={}", self.0)
    }
}
