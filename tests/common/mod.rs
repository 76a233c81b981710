//! Helpers shared by the integration tests: the backends a test runs on, a small seeded PRNG,
//! random bytes, and checks that hold after every operation.

#![allow(dead_code)]

use strata::{DeviceView, Error, Stats, Store, StoreBuilder, Tier};

/// The backend a parameterized test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Tiers emulated in host memory; runs everywhere.
    Host,
    /// The CUDA backend on device 0; only where a GPU is present.
    Cuda,
}

impl Backend {
    /// A store builder for this backend: forced host, or CUDA without the host fallback (so a
    /// CUDA run never silently tests the host backend instead).
    pub fn builder(self) -> StoreBuilder {
        match self {
            Backend::Host => Store::builder().host_backend(),
            Backend::Cuda => Store::builder().require_gpu(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Host => "host",
            Backend::Cuda => "cuda",
        }
    }
}

/// Runs `f` on the host backend, then on the CUDA backend when a GPU is present; without one
/// prints `SKIP <test> on cuda: no GPU (<reason>)`, or panics when `STRATA_REQUIRE_GPU=1`.
/// A failing run is reported with the backend it failed on.
pub fn each_backend(test: &str, mut f: impl FnMut(Backend)) {
    watch_deadlocks();
    /// Names the test and backend when the run unwinds from a failure.
    struct OnPanic<'a>(&'a str, Backend);
    impl Drop for OnPanic<'_> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                eprintln!("FAILED {} on {}", self.0, self.1.name());
            }
        }
    }
    let mut run = |backend: Backend| {
        let _guard = OnPanic(test, backend);
        f(backend);
    };
    run(Backend::Host);
    let why = match strata::cuda_device_count() {
        Ok(n) if n > 0 => return run(Backend::Cuda),
        Ok(_) => "the driver reports no CUDA device".to_string(),
        Err(why) => why,
    };
    if std::env::var("STRATA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("{test} on cuda: no GPU ({why}), and STRATA_REQUIRE_GPU=1");
    }
    println!("SKIP {test} on cuda: no GPU ({why})");
}

/// xorshift64*: deterministic, seedable, good enough to drive randomized tests.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        // Mix the seed so that small seeds (1, 2, 3...) give unrelated streams; never 0.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Rng(if z == 0 { 0x2545_F491_4F6C_DD1D } else { z })
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n > 0`).
    /// Uniform in `[0, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        self.next_u64() % n
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

/// `len` pseudo-random bytes for `seed`.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    Rng::new(seed).bytes(len)
}

/// Fails (with `ctx`) if any tier uses more than its capacity.
pub fn assert_budgets(stats: &Stats, ctx: &str) {
    for t in Tier::ALL {
        assert!(
            stats.used(t) <= stats.capacity(t),
            "{ctx}: tier {t} uses {} of a capacity of {}",
            stats.used(t),
            stats.capacity(t)
        );
    }
}

/// Per-tier `used` of a store, for before/after comparisons.
pub fn used_per_tier(store: &Store) -> [u64; 4] {
    let s = store.stats();
    Tier::ALL.map(|t| s.used(t))
}

/// Whether `e` is an error that only says "no room now" or "never fits".
pub fn is_space_error(e: &Error) -> bool {
    matches!(e, Error::OutOfMemory { .. } | Error::TooLarge { .. })
}

/// The tiers holding a copy of `id`, fastest first (panics on error).
pub fn tiers(store: &Store, id: strata::TensorId) -> Vec<Tier> {
    store.info(id).expect("info").tiers
}

/// A seed from the environment variable `name` (decimal), if set.
pub fn env_seed(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.trim().parse().ok())
}

/// The bytes seen through a device view: in place on the host backend (every tier is host
/// memory there), copied to the host on the view's stream on the CUDA backend.
pub fn view_read(v: &DeviceView) -> Vec<u8> {
    let stream = v.stream();
    match (v.cuda_slice(), stream.cuda()) {
        (Some(slice), Some(cs)) => {
            let bytes = cs.clone_dtoh(slice).expect("copy a device view to the host");
            stream.synchronize().expect("synchronize the view's stream");
            bytes
        }
        _ => v.with_host_bytes(|b| b.to_vec()).expect("host bytes of a view"),
    }
}

/// Writes `data` through a device view and marks it dirty: in place on the host backend, a
/// host-to-device copy on the view's stream on the CUDA backend.
pub fn view_write(v: &mut DeviceView, data: &[u8]) {
    let stream = v.stream();
    match (v.cuda_view_mut::<u8>(), stream.cuda()) {
        (Some(mut slice), Some(cs)) => {
            cs.memcpy_htod(data, &mut slice).expect("copy into a device view");
            stream.synchronize().expect("synchronize the view's stream");
        }
        _ => v.with_host_bytes_mut(|b| b.copy_from_slice(data)).expect("host bytes of a view"),
    }
}

/// Starts (once per test binary) a thread that looks for deadlocks among parking_lot's locks
/// and condition variables (the store's lock, flights, host events, staging) every 200 ms and,
/// on finding one, prints the threads involved and aborts, so a deadlock fails the test at once
/// instead of hanging it. Tests build parking_lot with `deadlock_detection` (dev-dependency).
pub fn watch_deadlocks() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        std::thread::Builder::new()
            .name("deadlock-watch".into())
            .spawn(|| loop {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let found = parking_lot::deadlock::check_deadlock();
                if found.is_empty() {
                    continue;
                }
                eprintln!("{} deadlock(s) among parking_lot locks", found.len());
                for (i, threads) in found.iter().enumerate() {
                    for t in threads {
                        eprintln!("deadlock {i}: thread {:?}\n{:?}", t.thread_id(), t.backtrace());
                    }
                }
                std::process::abort();
            })
            .expect("the deadlock watcher starts");
    });
}

/// One tensor of a test safetensors file, with the bytes the file holds for it.
#[derive(Clone, Debug)]
pub struct T {
    pub name: String,
    pub dtype: strata::DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// A tensor with random contents (booleans are 0 or 1, as a valid file holds them).
pub fn tensor(name: &str, dtype: strata::DType, shape: &[usize], rng: &mut Rng) -> T {
    let len = shape.iter().product::<usize>() * dtype.size_of();
    let mut data = rng.bytes(len);
    if dtype == strata::DType::Bool {
        data.iter_mut().for_each(|b| *b &= 1);
    }
    T { name: name.to_string(), dtype, shape: shape.to_vec(), data }
}

/// The `safetensors` crate's dtype for a strata dtype (the crate parses the names strata gives:
/// its serde names); a block-quantized dtype has none.
pub fn st_dtype(d: strata::DType) -> safetensors::Dtype {
    let name = d.safetensors_name().expect("a dtype safetensors holds");
    serde_json::from_str(&format!("\"{name}\"")).expect("a safetensors dtype")
}
