//! What strata's bookkeeping costs per operation: a policy update per access, the allocator
//! behind `put` / `remove`, a device view acquired and dropped, `put` + `read` of a small tensor,
//! and a read that hits. The store benchmarks run on the host backend (no GPU needed) and again
//! on CUDA where there is a GPU (their ids then say `CUDA`; without one a line says they were
//! skipped).
//!
//! ```text
//! cargo bench --bench bookkeeping
//! ```
//! Each benchmark's id says what one iteration is. The targets: under 1 µs of bookkeeping
//! per access, and a CUDA `device_view` hit + drop within 3 µs of host time; `benches/gpu/run tests` measures the CUDA ids on the GPU machine and
//! `docs/benchmarks.md` records the figures.

use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use strata::{DType, FrequencyPolicy, LruPolicy, Policy, Store, TensorId, Tier};

/// Tensors in the policy benchmarks.
const TENSORS: usize = 10_000;
/// Bytes of the small tensors.
const SMALL: usize = 4096;

/// A store whose fastest tier is `top` (64 MiB; the tiers above it disabled), with a 64 MiB disk
/// tier below, on the host backend or on CUDA (`None` when there is no GPU). With `top` = Device
/// on the host backend, puts and reads go through the emulated copy streams (worker threads);
/// with Pinned they are plain memcpys, so what remains is the bookkeeping.
fn store_on(cuda: bool, top: Tier) -> Option<Store> {
    let mut b = Store::builder().capacity(Tier::Disk, 64 << 20);
    b = if cuda { b.require_gpu() } else { b.host_backend() };
    for t in [Tier::Device, Tier::Pinned, Tier::Mapped] {
        b = b.capacity(t, if t == top { 64 << 20 } else { 0 });
    }
    match b.build() {
        Ok(store) => Some(store),
        Err(e) if cuda => {
            println!("SKIP bookkeeping on CUDA: {e}");
            None
        }
        Err(e) => panic!("a host store: {e}"),
    }
}

/// `n` valid tensor ids (the only way to make ids outside the crate is to put tensors).
fn ids(n: usize) -> Vec<TensorId> {
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, (n as u64) * 4096 + (1 << 20))
        .capacity(Tier::Pinned, 0)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .build()
        .expect("a host store");
    (0..n).map(|i| store.put(&format!("t{i}"), DType::U8, &[1], &[0]).expect("put")).collect()
}

/// `STRATA_BENCH_BRIEF` is set: the host dry run of the GPU scripts, which checks that the
/// benches run and print their figures, not the figures.
fn brief() -> bool {
    std::env::var_os("STRATA_BENCH_BRIEF").is_some()
}

/// The group every bench here runs in: 2 s of measurement after 0.5 s of warm-up, or, with
/// `STRATA_BENCH_BRIEF` set (the GPU scripts' host dry run: `benches/gpu/run --host`, in CI),
/// 10 samples in 0.2 s after 0.05 s: enough to show each bench runs and to print a figure, not
/// to measure one.
fn quick(c: &mut Criterion) -> criterion::BenchmarkGroup<'_, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group("bookkeeping");
    if brief() {
        g.sample_size(10).measurement_time(Duration::from_millis(200));
        g.warm_up_time(Duration::from_millis(50));
    } else {
        g.measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    }
    g
}

fn policies(c: &mut Criterion) {
    let ids = ids(TENSORS);
    let mut g = quick(c);
    g.throughput(Throughput::Elements(1));
    let mut freq = FrequencyPolicy::new();
    let mut lru = LruPolicy::new();
    for &id in &ids {
        freq.on_insert(id, 1 << 20);
        lru.on_insert(id, 1 << 20);
    }
    // A stride through the ids: every access touches a different tensor, as a layer sweep does.
    let mut k = 0usize;
    g.bench_function("frequency on_access (1 access, 10k tensors)", |b| {
        b.iter(|| {
            k = (k + 7919) % TENSORS;
            freq.on_access(black_box(ids[k]));
        })
    });
    g.bench_function("lru on_access (1 access, 10k tensors)", |b| {
        b.iter(|| {
            k = (k + 7919) % TENSORS;
            lru.on_access(black_box(ids[k]));
        })
    });
    g.finish();
}

fn store_ops(c: &mut Criterion) {
    store_ops_on(c, false);
    store_ops_on(c, true);
}

/// The store benchmarks on one backend. The host backend's ids are the ones `docs/bench.md`
/// has always recorded; on CUDA they end in `CUDA`.
fn store_ops_on(c: &mut Criterion, cuda: bool) {
    let data = vec![7u8; SMALL];
    let (pinned, device, backend) = if cuda {
        ("Pinned tier, CUDA", "Device tier, CUDA", "CUDA")
    } else {
        ("Pinned tier, memcpy", "Device tier, host stream", "host backend")
    };
    let Some(view_store) = store_on(cuda, Tier::Device) else { return };
    let mut g = quick(c);
    g.throughput(Throughput::Elements(1));

    for (top, what) in [(Tier::Pinned, pinned), (Tier::Device, device)] {
        let Some(store) = store_on(cuda, top) else { return };
        g.bench_function(format!("put + remove (one 4 KiB tensor, {what})"), |b| {
            b.iter(|| {
                let id = store.put("t", DType::U8, &[SMALL], black_box(&data)).expect("put");
                store.remove(id).expect("remove");
            })
        });
        g.bench_function(format!("put + read + remove (one 4 KiB tensor, {what})"), |b| {
            b.iter(|| {
                let id = store.put("t", DType::U8, &[SMALL], black_box(&data)).expect("put");
                black_box(store.read(id).expect("read"));
                store.remove(id).expect("remove");
            })
        });
        let id = store.put("resident", DType::U8, &[SMALL], &data).expect("put");
        g.bench_function(format!("read (one resident 4 KiB tensor, a hit, {what})"), |b| {
            b.iter(|| black_box(store.read(black_box(id)).expect("read")))
        });
        store.check_err().expect("no deferred errors");
    }

    let store = view_store;
    let id = store.put("resident", DType::U8, &[SMALL], &data).expect("put");
    let stream = store.stream().expect("stream");
    g.bench_function(format!("device_view + drop (one resident 4 KiB tensor, {backend})"), |b| {
        b.iter(|| drop(black_box(store.device_view(id, &stream).expect("view"))))
    });
    stream.synchronize().expect("sync");

    // A batch of views held at once and then dropped: the guards' cost without the host
    // stream's per-drop event dominating a single iteration.
    let many: Vec<TensorId> = (0..64)
        .map(|i| store.put(&format!("v{i}"), DType::U8, &[SMALL], &data).expect("put"))
        .collect();
    g.throughput(Throughput::Elements(many.len() as u64));
    let batch = if cuda {
        "device_view x64 then drop x64 (resident 4 KiB tensors, CUDA)"
    } else {
        "device_view x64 then drop x64 (resident 4 KiB tensors)"
    };
    g.bench_function(batch, |b| {
        b.iter_batched_ref(
            Vec::new,
            |views| {
                for &id in &many {
                    views.push(store.device_view(id, &stream).expect("view"));
                }
                views.clear();
            },
            BatchSize::SmallInput,
        )
    });
    stream.synchronize().expect("sync");
    store.check_err().expect("no deferred errors");
    g.finish();
}

/// A read that misses and promotes its tensor into a full tier, evicting one victim, with 1k,
/// 10k and 100k tensors in the store: the victim comes from an index kept as tensors change, so
/// the cost should not grow with the count (the target: within 2x from 1k to 100k).
fn evicting_reads(c: &mut Criterion) {
    let mut g = quick(c);
    g.throughput(Throughput::Elements(1));
    // (Brief: a tenth of the tensors, still a hundredfold range; putting 100k tensors is most
    // of a brief run's time.)
    let counts = if brief() { [100usize, 1_000, 10_000] } else { [1_000, 10_000, 100_000] };
    for n in counts {
        // Pinned holds `n` small tensors and `n + 64` are put, each with a copy in Mapped:
        // reads cycling over all of them in order each miss (the tensor read was evicted a
        // cycle ago), promote it and evict the least recently used (LRU always admits), which
        // costs a drop of its Pinned copy. Host memory only, so no I/O hides the bookkeeping.
        let store = Store::builder()
            .host_backend()
            .policy(strata::PolicyKind::Lru)
            .capacity(Tier::Device, 0)
            .capacity(Tier::Pinned, (n * SMALL) as u64)
            .capacity(Tier::Mapped, ((n + 128) * SMALL) as u64)
            .capacity(Tier::Disk, 0)
            .build()
            .expect("a host store");
        let data = vec![3u8; SMALL];
        let ids: Vec<TensorId> = (0..n + 64)
            .map(|i| store.put(&format!("t{i}"), DType::U8, &[SMALL], &data).expect("put"))
            .collect();
        // Every tensor gets a Mapped copy, so an eviction drops a copy rather than writing one.
        for &id in &ids {
            store.move_to(id, Tier::Mapped).expect("to mapped");
        }
        for &id in &ids[..n] {
            store.read(id).expect("promote");
        }
        // Pinned holds ids[..n] now: start at the first one it does not.
        let mut k = n - 1;
        let before = store.stats();
        let mut reads = 0u64;
        g.bench_function(format!("read that evicts (one 4 KiB tensor, {n} tensors)"), |b| {
            b.iter(|| {
                k = (k + 1) % ids.len();
                reads += 1;
                black_box(store.read(ids[k]).expect("read"));
            })
        });
        let st = store.stats();
        let evictions = st.evictions - before.evictions;
        assert_eq!(evictions, reads, "not every read evicted:\n{st}");
    }
    g.finish();
}

criterion_group!(benches, policies, store_ops, evicting_reads);
criterion_main!(benches);
