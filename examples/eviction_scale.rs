//! What making room costs as the tensor count grows, when room is hard to make: the Device tier
//! full of single-copy tensors and the Pinned tier full too, so a tensor brought to the device
//! must demote a device tensor to Pinned after spilling a pinned one to disk.
//!
//! ```text
//! cargo run --release --example eviction_scale -- [--tensors 1000,10000,100000] \
//!     [--workload 200000] [--seconds 10] [--threads 4] [--host]
//! ```
//! For each count it prints, as medians over 15 tensors brought in one after the other:
//! - a `prefetch` hint that must spill (the hint itself; it queues the spills as a job) and the
//!   device view after it;
//! - a layer scope (`Store::layer`) whose tensor must spill to come in;
//! - a `device_view` miss that must spill;
//!
//! and, with no Disk tier (nothing can move), how long a view that cannot get room takes to fail
//! with `OutOfMemory`. Then a workload over `--workload` tensors loaded in place: `--threads`
//! threads mixing reads, writes, writing views, hints, layer scopes and moves for `--seconds`,
//! with the tiers full: operations per second.

use std::sync::Arc;
use std::time::{Duration, Instant};

use safetensors::tensor::{Dtype, TensorView};
use strata::{DType, Group, LoadOptions, Store, StoreBuilder, TensorId, Tier};

const B: usize = 1024;
const REPS: usize = 15;

struct Args {
    counts: Vec<usize>,
    workload: usize,
    seconds: u64,
    threads: usize,
    host: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        counts: vec![1_000, 10_000, 100_000],
        workload: 200_000,
        seconds: 10,
        threads: 4,
        host: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number =
            |v: String| v.parse::<usize>().map_err(|_| format!("{flag}: not a number: {v}"));
        match flag.as_str() {
            "--tensors" => {
                a.counts =
                    value()?.split(',').map(|v| number(v.to_string())).collect::<Result<_, _>>()?
            }
            "--workload" => a.workload = number(value()?)?,
            "--seconds" => a.seconds = number(value()?)? as u64,
            "--threads" => a.threads = number(value()?)?.max(1),
            "--host" => a.host = true,
            other => return Err(format!("unknown flag {other} (see the example's docs)")),
        }
    }
    Ok(a)
}

fn builder(host: bool) -> StoreBuilder {
    let b = Store::builder();
    if host {
        b.host_backend()
    } else {
        b
    }
}

/// Device and Pinned full of `n` single-copy tensors each; `disk` bytes of Disk; `spare`
/// tensors on disk to bring in.
fn full_store(
    host: bool,
    n: usize,
    disk: u64,
    spare: usize,
) -> strata::Result<(Store, Vec<TensorId>)> {
    let store = builder(host)
        .capacity(Tier::Device, (n * B) as u64)
        .capacity(Tier::Pinned, (n * B) as u64)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, disk)
        .prefetch_budget((n * B) as u64)
        .write_reserve(false) // the tiers are filled to the byte
        .build()?;
    for (tier, tag) in [(Tier::Device, "d"), (Tier::Pinned, "p")] {
        for i in 0..n {
            store.put_in(
                tier,
                &format!("{tag}{i}"),
                Group::Other,
                DType::U8,
                &[B],
                &[i as u8; B],
            )?;
        }
    }
    let mut out = Vec::new();
    if disk > 0 {
        for i in 0..spare {
            out.push(store.put_in(
                Tier::Disk,
                &format!("x{i}"),
                Group::Other,
                DType::U8,
                &[B],
                &[7; B],
            )?);
        }
    }
    Ok((store, out))
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6
}

fn spills(host: bool, n: usize) -> strata::Result<()> {
    let disk = (n * 4096 + (64 << 20)) as u64;
    // A prefetch hint, then a view of what it brings.
    let (store, xs) = full_store(host, n, disk, REPS)?;
    if n == 0 {
        return Ok(());
    }
    let s = store.stream()?;
    let (mut hint, mut after) = (Vec::new(), Vec::new());
    for &x in &xs {
        let t = Instant::now();
        store.prefetch(&[x])?;
        hint.push(t.elapsed());
        let t = Instant::now();
        drop(store.device_view(x, &s)?);
        after.push(t.elapsed());
    }
    s.synchronize()?;
    store.check_err()?;
    println!("{n} tensors: prefetch hint that must spill: median {:.1} us", median(hint));
    println!("{n} tensors: device view after the hint: median {:.1} us", median(after));
    drop(store);
    // A layer scope whose tensor must come in.
    let (store, xs) = full_store(host, n, disk, REPS)?;
    let mut layer = Vec::new();
    for &x in &xs {
        let t = Instant::now();
        let scope = store.layer(&[x], &[])?;
        layer.push(t.elapsed());
        drop(scope);
    }
    store.check_err()?;
    println!("{n} tensors: layer scope that must spill: median {:.1} us", median(layer));
    drop(store);
    // A device view miss.
    let (store, xs) = full_store(host, n, disk, REPS)?;
    let s = store.stream()?;
    let mut miss = Vec::new();
    for &x in &xs {
        let t = Instant::now();
        drop(store.device_view(x, &s)?);
        miss.push(t.elapsed());
    }
    s.synchronize()?;
    store.check_err()?;
    println!("{n} tensors: device view miss that must spill: median {:.1} us", median(miss));
    drop(store);
    // Nothing can move: the view fails.
    let (store, _) = full_store(host, n, 0, 0)?;
    let s = store.stream()?;
    let pinned = store
        .lookup("p0")
        .ok_or("p0 missing")
        .map_err(|e| strata::Error::InvalidArgument(e.into()))?;
    let mut fail = Vec::new();
    for _ in 0..REPS {
        let t = Instant::now();
        match store.device_view(pinned, &s) {
            Err(strata::Error::OutOfMemory { .. }) => fail.push(t.elapsed()),
            Err(e) => return Err(e),
            Ok(_) => return Err(strata::Error::InvalidArgument("the view found room".into())),
        }
    }
    println!(
        "{n} tensors: device view that cannot get room fails (OutOfMemory): median {:.1} us",
        median(fail)
    );
    Ok(())
}

fn workload(a: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let n = a.workload;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("workload.safetensors");
    let data: Vec<Vec<u8>> = (0..n).map(|i| vec![(i % 251) as u8; 256]).collect();
    let views = (0..n)
        .map(|i| Ok((format!("t{i}"), TensorView::new(Dtype::U8, vec![256], &data[i])?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, &path)?;
    drop(data);
    let store = Arc::new(
        builder(a.host)
            .capacity(Tier::Device, (n / 10 * 256) as u64)
            .capacity(Tier::Pinned, (n / 5 * 4096) as u64)
            .capacity(Tier::Mapped, 0)
            .capacity(Tier::Disk, (n * 4096 + (64 << 20)) as u64)
            .prefetch_budget((n / 40 * 256) as u64)
            .build()?,
    );
    println!("{}", store.backend_description());
    let loaded = store.load_checkpoint(&path, LoadOptions::default())?;
    let ids: Arc<Vec<TensorId>> = Arc::new(loaded.ids());
    let deadline = Instant::now() + Duration::from_secs(a.seconds);
    let t0 = Instant::now();
    let handles: Vec<_> = (0..a.threads)
        .map(|t| {
            let (store, ids) = (store.clone(), ids.clone());
            let threads = a.threads;
            std::thread::spawn(move || -> strata::Result<(u64, u64)> {
                let mine: Vec<TensorId> = ids.iter().copied().skip(t).step_by(threads).collect();
                let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ t as u64;
                let mut rnd = |m: usize| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % m as u64) as usize
                };
                let s = store.stream()?;
                let (mut ops, mut refused) = (0u64, 0u64);
                while Instant::now() < deadline {
                    ops += 1;
                    let id = mine[rnd(mine.len())];
                    let r = match rnd(10) {
                        0..=3 => store.read(id).map(drop),
                        4 => store.write(id, &[ops as u8; 256]),
                        5 => store.device_view(id, &s).map(|mut v| v.mark_dirty()),
                        6 | 7 => store
                            .prefetch(&(0..16).map(|_| mine[rnd(mine.len())]).collect::<Vec<_>>()),
                        8 => store.layer(&[id], &[mine[rnd(mine.len())]]).map(drop),
                        _ => store.move_to(id, [Tier::Device, Tier::Pinned, Tier::Disk][rnd(3)]),
                    };
                    match r {
                        Ok(()) => {}
                        Err(strata::Error::OutOfMemory { .. } | strata::Error::Busy { .. }) => {
                            refused += 1
                        }
                        Err(e) => return Err(e),
                    }
                }
                s.synchronize()?;
                Ok((ops, refused))
            })
        })
        .collect();
    let (mut ops, mut refused) = (0, 0);
    for h in handles {
        let (o, r) = h.join().map_err(|_| "a worker panicked")??;
        ops += o;
        refused += r;
    }
    let took = t0.elapsed().as_secs_f64();
    store.check_err()?;
    println!(
        "workload: {n} tensors, {} threads, {took:.1} s: {ops} operations ({refused} refused: out of memory or busy), {:.0} operations/s",
        a.threads,
        ops as f64 / took
    );
    let st = store.stats();
    println!(
        "evictions {}  prefetches {}  moved to the device {} B",
        st.evictions,
        st.prefetches,
        st.moved_into(Tier::Device)
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse()?;
    let probe =
        builder(a.host).capacity(Tier::Device, 1 << 20).capacity(Tier::Pinned, 1 << 20).build()?;
    println!("{}", probe.backend_description());
    drop(probe);
    for &n in &a.counts {
        spills(a.host, n)?;
    }
    if a.workload > 0 {
        workload(&a)?;
    }
    Ok(())
}
