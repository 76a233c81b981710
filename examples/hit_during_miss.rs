//! How long a device view of a resident tensor takes on one thread while another thread's view
//! misses a large tensor on disk (read from the slab file, copied in through staging): the
//! store's lock is held only to decide and record, so the hit should not wait for the miss.
//!
//! ```text
//! cargo run --release --example hit_during_miss -- [--mib 256] [--host]
//! ```
//! Prints the miss's time and the hits' median, 99th percentile and worst case, and how often the
//! hitting thread blocked meanwhile (voluntary context switches: a lock, a futex, a page fault
//! waiting for the kernel's mmap lock), which, unlike the worst case, does not depend on what
//! else the machine runs: a loaded machine preempts the thread (involuntary switches, also
//! printed) and makes any hit slow.

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata::{DType, Store, Tier};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let mib: usize = match args.iter().position(|a| a == "--mib") {
        Some(i) => args.get(i + 1).and_then(|v| v.parse().ok()).ok_or("--mib needs a number")?,
        None => 256,
    };
    let big_bytes = mib << 20;
    let mut b = Store::builder()
        .capacity(Tier::Device, (big_bytes + (16 << 20)) as u64)
        .capacity(Tier::Pinned, (big_bytes + (16 << 20)) as u64)
        .capacity(Tier::Mapped, 0)
        // Twice the big tensor: the disk tier also keeps the write reserve (room for a second
        // copy of the largest tensor).
        .capacity(Tier::Disk, (2 * big_bytes + (16 << 20)) as u64);
    if args.iter().any(|a| a == "--host") {
        b = b.host_backend();
    }
    let store = Arc::new(b.build()?);
    println!("{}", store.backend_description());
    let big = store.put("big", DType::U8, &[big_bytes], &vec![7u8; big_bytes])?;
    store.move_to(big, Tier::Disk)?;
    let small = store.put("small", DType::U8, &[4096], &[1; 4096])?;
    let s = store.stream()?;
    // Warm: the small tensor is resident and its view path has run once.
    for _ in 0..1000 {
        drop(store.device_view(small, &s)?);
    }
    s.synchronize()?;
    // Room for every hit, its pages touched before the clock runs: growing the vector in the
    // loop would fault pages there.
    let mut hits = vec![Duration::ZERO; 1 << 22];
    hits.clear();
    let st = store.clone();
    let miss = std::thread::spawn(move || -> strata::Result<Duration> {
        let s = st.stream()?;
        let t = Instant::now();
        let v = st.device_view(big, &s)?;
        let took = t.elapsed();
        drop(v);
        s.synchronize()?;
        Ok(took)
    });
    let before = switches();
    while !miss.is_finished() && hits.len() < hits.capacity() {
        let t = Instant::now();
        drop(store.device_view(small, &s)?);
        hits.push(t.elapsed());
    }
    let after = switches();
    let miss_took = miss.join().map_err(|_| "the miss panicked")??;
    s.synchronize()?;
    store.check_err()?;
    if hits.is_empty() {
        return Err("the miss ended before the first hit".into());
    }
    hits.sort();
    let q = |p: f64| hits[((hits.len() - 1) as f64 * p) as usize];
    println!("miss of a {mib} MiB tensor on disk: {:.1} ms", miss_took.as_secs_f64() * 1e3);
    println!(
        "{} device_view hits + drops on another thread meanwhile: median {:.2} us, p99 {:.2} us, \
         worst {:.3} ms",
        hits.len(),
        q(0.5).as_secs_f64() * 1e6,
        q(0.99).as_secs_f64() * 1e6,
        hits.last().map_or(0.0, |w| w.as_secs_f64() * 1e3)
    );
    println!(
        "the hitting thread meanwhile: blocked {} times (voluntary context switches), preempted \
         {} times",
        after.0 - before.0,
        after.1 - before.1
    );
    Ok(())
}

/// This thread's voluntary and involuntary context switches so far (`getrusage(RUSAGE_THREAD)`).
fn switches() -> (i64, i64) {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the zeroed buffer, which outlives the call.
    let r = unsafe { libc::getrusage(libc::RUSAGE_THREAD, u.as_mut_ptr()) };
    if r != 0 {
        return (0, 0);
    }
    // SAFETY: zeroed, then filled by a successful getrusage.
    let u = unsafe { u.assume_init() };
    (u.ru_nvcsw, u.ru_nivcsw)
}
