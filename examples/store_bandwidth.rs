//! Store transfer paths against raw driver copies of the same size, in one run (CUDA only).
//!
//! ```text
//! cargo run --release --example store_bandwidth -- 1GiB 5 [16MiB]
//! ```
//! (size, runs, and the size of each of the 4 pinned staging buffers).
//! Prints, for a tensor of the given size: raw pinned `cuMemcpyHtoDAsync` / `DtoH`, the store's
//! `move_to(Pinned -> Device)` and `move_to(Device -> Pinned)`, and `put` from pageable memory
//! (staged through pinned buffers), a plain one-thread host memcpy for reference, each the median of the given number of runs, and the ratios
//! the CUDA backend issue asks for (>= 95% and >= 80%).

use std::time::Instant;

use strata::probe::{median, raw_pinned_copy, Direction};
use strata::{format_size, parse_size, DType, Store, Tier};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let bytes = parse_size(&args.next().unwrap_or_else(|| "1GiB".into()))? as usize;
    let iters: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(5);
    let staging = parse_size(&args.next().unwrap_or_else(|| "16MiB".into()))? as usize;
    let store = Store::builder()
        .staging(4, staging)
        .require_gpu()
        .capacity(Tier::Device, bytes as u64 + (64 << 20))
        .capacity(Tier::Pinned, bytes as u64 + (64 << 20))
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .build()?;
    println!("backend: {}", store.backend_description());
    let ctx = store.cuda_context().expect("CUDA backend").clone();
    let gbps = |secs: f64| bytes as f64 / secs / 1e9;

    let raw_h2d = median(&raw_pinned_copy(&ctx, bytes, Direction::HostToDevice, iters)?);
    let raw_d2h = median(&raw_pinned_copy(&ctx, bytes, Direction::DeviceToHost, iters)?);

    let data: Vec<u8> = (0..bytes).map(|i| (i * 131 % 251) as u8).collect();
    let s = store.stream()?;
    let (mut put, mut h2d, mut d2h) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..=iters {
        let t = Instant::now();
        let id = store.put("x", DType::U8, &[bytes], &data)?;
        drop(store.device_view(id, &s)?); // put returns once staged; the view waits for the DMA
        s.synchronize()?;
        let t_put = t.elapsed().as_secs_f64();
        let t = Instant::now();
        store.move_to(id, Tier::Pinned)?; // Device -> Pinned: DtoH
        let t_d2h = t.elapsed().as_secs_f64();
        let t = Instant::now();
        store.move_to(id, Tier::Device)?; // Pinned -> Device: HtoD
        let t_h2d = t.elapsed().as_secs_f64();
        if i > 0 {
            put.push(t_put);
            h2d.push(t_h2d);
            d2h.push(t_d2h);
        }
        store.remove(id)?;
    }
    if store.read(store.put("check", DType::U8, &[bytes], &data)?)? != data {
        return Err("contents differ after the round trip".into());
    }
    let (sh, sd, sp) = (median(&h2d), median(&d2h), median(&put));
    // The CPU side of a pageable put alone, for reference: a plain one-thread copy.
    let mut dst = vec![0u8; bytes];
    let mut memcpy = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        dst.copy_from_slice(&data);
        memcpy.push(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    let sm = median(&memcpy);
    println!(
        "size {} , median of {iters} runs (wall clock, issue to completion)",
        format_size(bytes as u64)
    );
    println!("{:<34} {:>10} {:>10}", "path", "GB/s", "ms");
    println!(
        "{:<34} {:>10.2} {:>10.2}",
        "raw pinned HtoD (cuMemcpyHtoDAsync)",
        gbps(raw_h2d),
        raw_h2d * 1e3
    );
    println!(
        "{:<34} {:>10.2} {:>10.2}",
        "raw pinned DtoH (cuMemcpyDtoHAsync)",
        gbps(raw_d2h),
        raw_d2h * 1e3
    );
    println!("{:<34} {:>10.2} {:>10.2}", "store move_to Pinned -> Device", gbps(sh), sh * 1e3);
    println!("{:<34} {:>10.2} {:>10.2}", "store move_to Device -> Pinned", gbps(sd), sd * 1e3);
    println!("{:<34} {:>10.2} {:>10.2}", "store put from pageable -> Device", gbps(sp), sp * 1e3);
    println!("{:<34} {:>10.2} {:>10.2}", "host memcpy, one thread (reference)", gbps(sm), sm * 1e3);
    println!("ratio move_to H2D / raw H2D: {:.3} (target >= 0.95)", raw_h2d / sh);
    println!("ratio move_to D2H / raw D2H: {:.3} (target >= 0.95)", raw_d2h / sd);
    println!("ratio put pageable / raw pinned H2D: {:.3} (target >= 0.80)", raw_h2d / sp);
    store.check_err()?;
    Ok(())
}
