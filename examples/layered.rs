//! Layer-by-layer passes over a model larger than the device budget, with a kernel reading each
//! layer through a device view, measured against the two floors of the same run: compute (the
//! same kernels with every layer resident) and PCIe (bytes moved / raw pinned H2D bandwidth).
//!
//! ```text
//! cargo run --release --example layered -- --layers 32 --layer-size 64MiB --passes 6 \
//!     --hints on --policy schedule --repeats 4
//! ```
//! `--hints on` wraps each layer in `Store::layer(&[this], &[next k])`; `--policy` picks the
//! policy (`schedule` learns the pass and prefetches along it); `--repeats` sets how many times
//! the kernel reads each layer (the compute per byte); `--source pinned|disk` where the weights
//! live. On the host backend it runs too (small sizes), checking results only.

use std::time::Instant;

use strata::kernels::Kernels;
use strata::probe::{median, raw_pinned_copy, Direction};
use strata::{format_size, parse_size, DType, PolicyKind, Store, Tier};

struct Args {
    layers: usize,
    layer_size: u64,
    device_budget: Option<u64>,
    passes: usize,
    repeats: u32,
    hints: bool,
    ahead: usize,
    policy: PolicyKind,
    source: Tier,
}

fn args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        layers: 32,
        layer_size: 64 << 20,
        device_budget: None,
        passes: 6,
        repeats: 1,
        hints: true,
        ahead: 2,
        policy: PolicyKind::Schedule,
        source: Tier::Pinned,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--layers" => a.layers = v.parse()?,
            "--layer-size" => a.layer_size = parse_size(&v)?,
            "--device-budget" => a.device_budget = Some(parse_size(&v)?),
            "--passes" => a.passes = v.parse()?,
            "--repeats" => a.repeats = v.parse()?,
            "--hints" => a.hints = v == "on",
            "--ahead" => a.ahead = v.parse()?,
            "--policy" => a.policy = v.parse()?,
            "--source" => a.source = v.parse()?,
            _ => return Err(format!("unknown flag {flag}").into()),
        }
    }
    Ok(a)
}

fn fill(l: usize, len: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (l as u64 + 1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// One pass 0..L; returns the seconds it took and the checksum the kernels computed.
fn pass(
    store: &Store,
    k: &Kernels,
    ids: &[strata::TensorId],
    a: &Args,
    hints: bool,
) -> strata::Result<(f64, u64)> {
    let s = store.stream()?;
    let mut acc = k.accumulator(&s)?;
    let t = Instant::now();
    store.step();
    for l in 0..ids.len() {
        let next: Vec<_> = (1..=a.ahead).map(|d| ids[(l + d) % ids.len()]).collect();
        let _scope = if hints { Some(store.layer(&ids[l..l + 1], &next)?) } else { None };
        let v = store.device_view(ids[l], &s)?;
        k.checksum_into(&v, a.repeats, &mut acc)?;
    }
    let sum = acc.value()?;
    Ok((t.elapsed().as_secs_f64(), sum))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let model = a.layers as u64 * a.layer_size;
    let budget = a.device_budget.unwrap_or(model / 4);
    let len = a.layer_size as usize;
    let slack = 64 << 20;

    // Compute floor: every layer resident.
    let all = Store::builder()
        .capacity(Tier::Device, model + slack)
        .capacity(Tier::Pinned, 0)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .build()?;
    println!("backend: {}", all.backend_description());
    let k_all = Kernels::new(&all)?;
    let ids_all: Vec<_> = (0..a.layers)
        .map(|l| all.put(&format!("w{l}"), DType::U8, &[len], &fill(l, len)))
        .collect::<Result<_, _>>()?;
    let mut compute = Vec::new();
    let mut want = 0;
    for p in 0..a.passes {
        let (t, sum) = pass(&all, &k_all, &ids_all, &a, false)?;
        if p > 0 {
            compute.push(t);
        }
        want = sum;
    }
    drop(all);

    let bw = match Store::builder().capacity(Tier::Device, 1 << 20).build()?.cuda_context() {
        Some(ctx) => {
            let t = median(&raw_pinned_copy(ctx, len, Direction::HostToDevice, 5)?);
            Some(a.layer_size as f64 / t)
        }
        None => None,
    };

    // The pass lines report stall and overlap: the store keeps a timeline.
    let mut b = Store::builder()
        .capacity(Tier::Device, budget)
        .capacity(Tier::Mapped, 0)
        .policy(a.policy)
        .timeline(true);
    b = match a.source {
        Tier::Disk => b.capacity(Tier::Pinned, 0).capacity(Tier::Disk, model + slack),
        _ => b.capacity(Tier::Pinned, model + slack).capacity(Tier::Disk, 0),
    };
    let store = b.build()?;
    let k = Kernels::new(&store)?;
    let ids: Vec<_> = (0..a.layers)
        .map(|l| store.put(&format!("w{l}"), DType::U8, &[len], &fill(l, len)))
        .collect::<Result<_, _>>()?;
    for &id in &ids {
        store.move_to(id, a.source)?;
    }
    println!(
        "model {} in {} layers of {}, device budget {}, weights in {}, hints {}, policy {}, kernel reads each layer {}x",
        format_size(model),
        a.layers,
        format_size(a.layer_size),
        format_size(budget),
        a.source,
        if a.hints { format!("on ({} ahead)", a.ahead) } else { "off".into() },
        a.policy,
        a.repeats
    );
    println!(
        "{:>5} {:>10} {:>12} {:>14} {:>7} {:>10} {:>9}",
        "pass", "ms", "moved in", "kept resident", "misses", "stall ms", "overlap"
    );
    let into_device =
        |s: &strata::Stats| -> u64 { Tier::ALL.iter().map(|&t| s.moved(t, Tier::Device)).sum() };
    let loads = |store: &Store| -> Vec<u64> {
        ids.iter().map(|&id| store.info(id).map(|i| i.device_loads).unwrap_or(0)).collect()
    };
    let mut moved = Vec::new();
    let mut minimum = Vec::new();
    let mut steady_start = None;
    for p in 0..a.passes {
        if p == 1 {
            steady_start = Some(Instant::now());
        }
        let loads_before = loads(&store);
        let before = store.stats();
        let (t, sum) = pass(&store, &k, &ids, &a, a.hints)?;
        let after = store.stats();
        // Layers that did not cross PCIe during this pass stayed resident through it.
        let kept = loads(&store).iter().zip(&loads_before).filter(|(x, y)| x == y).count() as u64;
        let resident = kept * a.layer_size;
        if sum != want {
            return Err(format!(
                "pass {p}: checksum {sum:#x} differs from the resident run's {want:#x}"
            )
            .into());
        }
        let m = into_device(&after) - into_device(&before);
        println!(
            "{:>5} {:>10.2} {:>12} {:>14} {:>7} {:>10.2} {:>8.1}%",
            p + 1,
            t * 1e3,
            format_size(m),
            format_size(resident),
            after.prefetch_misses - before.prefetch_misses,
            (after.stall_seconds - before.stall_seconds) * 1e3,
            100.0 * after.overlap_ratio()
        );
        if p > 0 {
            moved.push(m as f64);
            minimum.push((model - resident) as f64);
        }
    }
    // Steady state: passes 2.. timed as one interval, so copies that run between passes count.
    let steady = steady_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    store.check_err()?;
    let tc = median(&compute);
    let tp = steady / (a.passes.max(2) - 1) as f64;
    let mv = median(&moved);
    let min = median(&minimum);
    println!("all results equal the all-resident run ({want:#x})");
    println!("compute floor (all resident): {:.2} ms per pass", tc * 1e3);
    if let Some(bw) = bw {
        let pcie = mv / bw;
        let floor = tc.max(pcie);
        println!(
            "raw pinned H2D: {:.2} GB/s; PCIe floor for the bytes moved: {:.2} ms",
            bw / 1e9,
            pcie * 1e3
        );
        println!(
            "mean pass (passes 2.., one interval): {:.2} ms = {:.3}x max(compute, PCIe) = {:.2} ms",
            tp * 1e3,
            tp / floor,
            floor * 1e3
        );
    } else {
        println!("mean pass (passes 2..): {:.2} ms (no GPU: no PCIe floor)", tp * 1e3);
    }
    println!(
        "bytes moved per pass: {} = {:.3}x the minimum (model minus the layers that stayed resident: {})",
        format_size(mv as u64),
        if min > 0.0 { mv / min } else { 1.0 },
        format_size(min as u64)
    );
    Ok(())
}
