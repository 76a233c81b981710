//! GPU tests: run on the CUDA backend, skip with a printed line where there is no GPU, and fail
//! instead of skipping when `STRATA_REQUIRE_GPU=1`.

mod common;

use std::sync::Arc;
use std::time::Instant;

use strata::kernels::{checksum_host, pattern, Kernels};
use strata::{DType, Error, Store, StoreBuilder, Tier};

fn gpu_store(name: &str, b: StoreBuilder) -> Option<Store> {
    let require = std::env::var("STRATA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match b.require_gpu().build() {
        Ok(s) => Some(s),
        Err(Error::NoGpu(why)) if !require => {
            println!("SKIP {name}: no GPU ({why}); set STRATA_REQUIRE_GPU=1 to fail instead");
            None
        }
        Err(e) => panic!("{name}: building a GPU store failed: {e}"),
    }
}

fn random(len: usize, seed: u64) -> Vec<u8> {
    common::Rng::new(seed).bytes(len)
}

fn budgets() -> StoreBuilder {
    Store::builder()
        .capacity(Tier::Device, 64 << 20)
        .capacity(Tier::Pinned, 64 << 20)
        .capacity(Tier::Mapped, 64 << 20)
        .capacity(Tier::Disk, 256 << 20)
}

#[test]
fn contents_checked_on_device_for_every_dtype_and_tier_path() {
    let Some(store) = gpu_store("contents_checked_on_device", budgets()) else { return };
    let k = Kernels::new(&store).expect("NVRTC kernels");
    let s = store.stream().unwrap();
    for (n, dtype) in DType::ALL.into_iter().enumerate() {
        // A quantized dtype: rows of whole blocks.
        let shape = [37, dtype.block().map_or(129, |(elems, _)| elems)];
        let data = random(dtype.bytes_for(&shape).unwrap() as usize, n as u64 + 1);
        let id = store.put(&format!("t{n}"), dtype, &shape, &data).unwrap();
        let want = checksum_host(&data, 1);
        for from in Tier::ALL {
            for to in Tier::ALL {
                store.move_to(id, from).unwrap();
                store.move_to(id, to).unwrap();
                {
                    let v = store.device_view(id, &s).unwrap();
                    assert_eq!(
                        k.checksum(&v, 1).unwrap(),
                        want,
                        "{dtype} {from}->{to}->device view"
                    );
                }
                store.move_to(id, Tier::Mapped).unwrap();
                let v = store.mapped_view(id, &s).unwrap();
                assert_eq!(k.checksum(&v, 1).unwrap(), want, "{dtype} {from}->{to}->mapped view");
            }
        }
        assert_eq!(store.read(id).unwrap(), data);
    }
    store.check_err().unwrap();
}

#[test]
fn large_tensor_crosses_staging_in_pieces() {
    let Some(store) = gpu_store("large_tensor", budgets()) else { return };
    let k = Kernels::new(&store).unwrap();
    let s = store.stream().unwrap();
    let data = random((40 << 20) + 12345, 7);
    let id = store.put("big", DType::U8, &[data.len()], &data).unwrap();
    assert_eq!(store.tier_of(id).unwrap(), Tier::Device);
    for path in [Tier::Disk, Tier::Device, Tier::Pinned, Tier::Device, Tier::Mapped, Tier::Disk] {
        store.move_to(id, path).unwrap();
        let v = store.device_view(id, &s).unwrap();
        assert_eq!(k.checksum(&v, 1).unwrap(), checksum_host(&data, 1), "after {path}");
    }
    assert_eq!(store.read(id).unwrap(), data);
}

/// With a timeline, an upload through pinned staging (from the caller's bytes, from the disk)
/// shows on CUDA as a resolved `h2d` span. Its end was once the last piece's pooled event, which
/// cannot be timed: the span stayed pending for ever, its copy time uncounted.
#[test]
fn staged_uploads_resolve_in_the_timeline() {
    let b = budgets().timeline(true);
    let Some(store) = gpu_store("staged_uploads_resolve_in_the_timeline", b) else { return };
    let s = store.stream().unwrap();
    let data = random(8 << 20, 11);
    let id = store.put("staged", DType::U8, &[data.len()], &data).unwrap();
    store.move_to(id, Tier::Disk).unwrap();
    store.move_to(id, Tier::Device).unwrap();
    drop(store.device_view(id, &s).unwrap());
    s.synchronize().unwrap();
    let dir = std::env::temp_dir().join(format!("strata-gpu-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.json");
    store.trace(&path).unwrap();
    let trace = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let uploads = trace.matches("\"name\":\"h2d staged\"").count();
    assert!(uploads >= 1, "no resolved h2d span of the staged uploads in the trace:\n{trace}");
    assert!(store.stats().copy_seconds > 0.0);
}

#[test]
fn viewed_memory_is_never_overwritten_under_eviction_pressure() {
    // Passes of the kernel over the 8 MiB view: long enough (~1 s on an H100) for the other
    // threads to evict many times while it runs.
    // STRATA_TEST_KERNEL_REPEATS lowers it under compute-sanitizer, which slows kernels a lot.
    let repeats: u32 = std::env::var("STRATA_TEST_KERNEL_REPEATS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    // Device room for the viewed tensor and ~3 others: puts from other threads must evict
    // around the viewed one while a long kernel reads it.
    let b = budgets().capacity(Tier::Device, 32 << 20);
    let Some(store) = gpu_store("eviction_pressure", b) else { return };
    let store = Arc::new(store);
    let k = Kernels::new(&store).unwrap();
    let s = store.stream().unwrap();
    let data = random(8 << 20, 99);
    let id = store.put("viewed", DType::U8, &[data.len()], &data).unwrap();
    let view = store.device_view(id, &s).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|t| {
            let (store, stop) = (store.clone(), stop.clone());
            std::thread::spawn(move || {
                // Each thread keeps its last two (3 × 2 × 6 MiB beside the viewed 8 MiB: more
                // than the Device tier, far less than all the tiers, however fast the puts run).
                let (mut n, mut live) = (0, std::collections::VecDeque::new());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 400 {
                    let d = random(6 << 20, 1000 * t + n);
                    let x = store.put(&format!("w{t}-{n}"), DType::U8, &[d.len()], &d).unwrap();
                    store.move_to(x, Tier::Device).unwrap();
                    assert_eq!(store.read(x).unwrap(), d);
                    live.push_back(x);
                    if live.len() > 2 {
                        store.remove(live.pop_front().unwrap()).unwrap();
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    // A long read of the view (many passes) while the others put and evict.
    let t = Instant::now();
    let got = k.checksum(&view, repeats).unwrap();
    let kernel_time = t.elapsed();
    let evictions_during_kernel = store.stats().evictions;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let puts: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert_eq!(got, checksum_host(&data, repeats), "viewed memory changed under a running kernel");
    assert_eq!(store.tier_of(id).unwrap(), Tier::Device);
    drop(view);
    assert_eq!(store.read(id).unwrap(), data);
    println!(
        "kernel {kernel_time:?}, {puts} puts, {evictions_during_kernel} evictions while it ran"
    );
    assert!(evictions_during_kernel > 0, "the test did not force evictions while the kernel ran");
    store.check_err().unwrap();
}

#[test]
fn dirty_device_write_is_written_back() {
    let Some(store) = gpu_store("dirty_write_back", budgets()) else { return };
    let k = Kernels::new(&store).unwrap();
    let s = store.stream().unwrap();
    let len = (3 << 20) + 77;
    let id = store.put("w", DType::U8, &[len], &random(len, 3)).unwrap();
    store.move_to(id, Tier::Disk).unwrap();
    {
        let mut v = store.device_view(id, &s).unwrap();
        k.fill(&mut v, 42).unwrap();
        // Dropped without waiting: the write-back must wait for the kernel itself.
    }
    store.move_to(id, Tier::Disk).unwrap();
    assert_eq!(store.info(id).unwrap().tiers, vec![Tier::Disk]);
    assert_eq!(store.read(id).unwrap(), pattern(len, 42));
    // And through every host tier.
    for t in [Tier::Pinned, Tier::Mapped] {
        {
            let mut v = store.device_view(id, &s).unwrap();
            k.fill(&mut v, t.index() as u32).unwrap();
        }
        store.move_to(id, t).unwrap();
        assert_eq!(store.read(id).unwrap(), pattern(len, t.index() as u32), "write-back to {t}");
    }
    store.check_err().unwrap();
}

#[test]
fn device_arena_full_is_a_typed_error_and_loses_nothing() {
    let b = Store::builder()
        .capacity(Tier::Device, 8 << 20)
        .capacity(Tier::Pinned, 0)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0);
    let Some(store) = gpu_store("device_full", b) else { return };
    let mut kept = Vec::new();
    let err = loop {
        let d = random(3 << 20, kept.len() as u64);
        match store.put(&format!("t{}", kept.len()), DType::U8, &[d.len()], &d) {
            Ok(id) => kept.push((id, d)),
            Err(e) => break e,
        }
    };
    assert!(matches!(err, Error::OutOfMemory { tier: Tier::Device, .. }), "{err}");
    assert_eq!(kept.len(), 2);
    let big = vec![0u8; 9 << 20];
    assert!(matches!(store.put("big", DType::U8, &[big.len()], &big), Err(Error::TooLarge { .. })));
    for (id, d) in &kept {
        assert_eq!(&store.read(*id).unwrap(), d);
    }
    assert!(store.stats().used(Tier::Device) <= 8 << 20);
}

#[test]
fn a_trainers_own_context_and_stream_are_used() {
    let require = std::env::var("STRATA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    if let Err(why) = strata::cuda_device_count() {
        assert!(!require, "STRATA_REQUIRE_GPU=1 but no GPU: {why}");
        println!("SKIP a_trainers_own_context: no GPU ({why})");
        return;
    }
    let ctx = strata::cudarc::driver::CudaContext::new(0).unwrap();
    let store = budgets().context(ctx.clone()).build().unwrap();
    let theirs = ctx.new_stream().unwrap();
    let s = strata::Stream::from_cuda(theirs.clone());
    let data = random(1 << 20, 5);
    let id = store.put("x", DType::U8, &[data.len()], &data).unwrap();
    store.move_to(id, Tier::Disk).unwrap();
    let v = store.device_view(id, &s).unwrap();
    // The trainer copies the view back with cudarc on its own stream, bytes and typed.
    let host = theirs.clone_dtoh(v.cuda_slice().unwrap()).unwrap();
    assert_eq!(host, data);
    let words: Vec<u32> = theirs.clone_dtoh(&v.cuda_view::<u32>().unwrap()).unwrap();
    assert_eq!(words[1], u32::from_ne_bytes(data[4..8].try_into().unwrap()));
    assert!(v.cuda_view::<[u8; 3]>().is_none(), "1 MiB is not a whole number of 3-byte values");
    drop(v);
    store.check_err().unwrap();
}

/// The layered model on the GPU: a kernel reads each layer through a view, layer scopes prefetch
/// the next ones from Pinned and Disk, for a few passes; results equal the all-resident run, and
/// after the first pass every view finds its layer resident or in flight.
#[test]
fn layered_passes_with_scopes_match_the_resident_run() {
    let layers = 12;
    let len = 2 << 20;
    for source in [Tier::Pinned, Tier::Disk] {
        for policy in [strata::PolicyKind::Frequency, strata::PolicyKind::Schedule] {
            let b = Store::builder()
                .capacity(Tier::Device, 4 * len as u64)
                .capacity(Tier::Pinned, if source == Tier::Pinned { 64 << 20 } else { 0 })
                .capacity(Tier::Mapped, 0)
                .capacity(Tier::Disk, 64 << 20)
                .policy(policy);
            let Some(store) = gpu_store("layered_passes", b) else { return };
            let k = Kernels::new(&store).unwrap();
            let s = store.stream().unwrap();
            let data: Vec<Vec<u8>> = (0..layers).map(|l| random(len, 500 + l as u64)).collect();
            let ids: Vec<_> = data
                .iter()
                .enumerate()
                .map(|(l, d)| store.put(&format!("w{l}"), DType::U8, &[len], d).unwrap())
                .collect();
            for &id in &ids {
                store.move_to(id, source).unwrap();
            }
            let want = data.iter().fold(0u64, |a, d| a.wrapping_add(checksum_host(d, 1)));
            for pass in 0..4 {
                let before = store.stats();
                let mut acc = k.accumulator(&s).unwrap();
                store.step();
                for l in 0..layers {
                    let next = [ids[(l + 1) % layers], ids[(l + 2) % layers]];
                    let _scope = store.layer(&ids[l..l + 1], &next).unwrap();
                    let v = store.device_view(ids[l], &s).unwrap();
                    k.checksum_into(&v, 1, &mut acc).unwrap();
                }
                assert_eq!(acc.value().unwrap(), want, "{source} {policy} pass {pass}");
                let after = store.stats();
                let misses = after.prefetch_misses - before.prefetch_misses;
                println!(
                    "{source} {policy} pass {pass}: misses {misses}, stall {:.3} ms, overlap {:.0}%",
                    (after.stall_seconds - before.stall_seconds) * 1e3,
                    100.0 * after.overlap_ratio()
                );
                if pass > 0 {
                    assert_eq!(misses, 0, "{source} {policy} pass {pass}: views missed");
                }
            }
            store.check_err().unwrap();
        }
    }
}
