//! `strata demo`: a synthetic layered model through small tier budgets, every byte checked.

use std::time::Instant;

use super::args::DemoArgs;
use super::bar;
use strata::{format_size, DType, Store, Tier};

/// Deterministic contents of a demo tensor.
fn contents(layer: usize, part: usize, len: usize) -> Vec<u8> {
    let mut x = (layer as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ part as u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The demo's model: `layers` layers of an f32 `[rows, hidden]` weight and a `[hidden]` bias.
struct DemoModel {
    layers: usize,
    rows: usize,
    hidden: usize,
}

impl DemoModel {
    fn new(layers: usize, layer_size: u64) -> DemoModel {
        let elems = (layer_size / 4).max(1);
        let hidden = ((elems as f64).sqrt() as u64).max(1);
        let rows = elems.div_ceil(hidden);
        // Both fit in usize: a layer's bytes are checked against the host before anything is
        // allocated, and a u64 size over 2^64 / 4 elements has no square root past 2^32.
        DemoModel { layers, rows: rows as usize, hidden: hidden as usize }
    }

    fn weight_bytes(&self) -> u64 {
        (self.rows as u64).saturating_mul(self.hidden as u64).saturating_mul(4)
    }

    fn bias_bytes(&self) -> u64 {
        self.hidden as u64 * 4
    }

    fn bytes(&self) -> u128 {
        self.layers as u128 * (u128::from(self.weight_bytes()) + u128::from(self.bias_bytes()))
    }
}

/// Refuses a demo this machine or these budgets cannot run, before anything is allocated: a
/// layer larger than every tier, or than the host memory the demo needs beside the budgets
/// the host holds (on the host backend every tier's, on CUDA the pinned and mapped ones).
fn check_demo_host(a: &DemoArgs, m: &DemoModel, host_tiers: u64) -> anyhow::Result<()> {
    let budgets = [a.device_budget, a.pinned_budget, a.mapped_budget, a.disk_budget];
    let largest = budgets.into_iter().max().unwrap_or(0);
    if m.weight_bytes() > largest {
        anyhow::bail!(
            "a layer's weight of {} is larger than every tier (the largest budget is {}): use \
             a smaller --layer-size, or raise a budget (--disk-budget)",
            format_size(m.weight_bytes()),
            format_size(largest)
        );
    }
    // The demo holds a layer's contents and what it reads back, beside the budgets held in
    // host memory.
    let need = 2 * u128::from(m.weight_bytes()) + u128::from(host_tiers);
    if let Some(avail) = strata::host_memory_available() {
        if need > u128::from(avail) {
            anyhow::bail!(
                "the demo needs {} of host memory (two copies of a {} layer, and the budgets \
                 held in host memory, {}) and {} is available: use a smaller --layer-size or \
                 smaller budgets",
                format_size(u64::try_from(need).unwrap_or(u64::MAX)),
                format_size(m.weight_bytes()),
                format_size(host_tiers),
                format_size(avail)
            );
        }
    }
    Ok(())
}

/// Refuses a model the store's tiers cannot hold together (each tensor rounded up as its tier
/// allocates it: a 4-byte tensor takes a page on the disk tier), before anything is put.
fn check_demo_fits(store: &Store, a: &DemoArgs, m: &DemoModel) -> anyhow::Result<()> {
    let stats = store.stats();
    let (w, b) = (m.weight_bytes(), m.bias_bytes());
    let per_layer = |t: Tier| store.footprint(t, w) + store.footprint(t, b);
    let fit: u64 = Tier::ALL
        .into_iter()
        .filter(|&t| stats.capacity(t) > 0)
        .map(|t| stats.capacity(t) / per_layer(t).max(1))
        .sum();
    if (a.layers as u64) > fit {
        let more = (a.layers as u64 - fit).saturating_mul(per_layer(Tier::Disk));
        anyhow::bail!(
            "{} layers of {} + {} do not fit these budgets, which hold {fit} such layers: raise \
             --disk-budget to {} or more, use fewer --layers, or larger ones (each tensor takes \
             at least {} of the disk tier)",
            a.layers,
            format_size(w),
            format_size(b),
            format_size(a.disk_budget.saturating_add(more)),
            format_size(store.footprint(Tier::Disk, 1))
        );
    }
    Ok(())
}

/// Runs `strata demo`.
pub fn run(a: DemoArgs) -> anyhow::Result<()> {
    let m = DemoModel::new(a.layers, a.layer_size);
    let gpu = !a.host && strata::cuda_device_count().is_ok_and(|n| n > 0);
    let host_tiers = [if gpu { 0 } else { a.device_budget }, a.pinned_budget, a.mapped_budget]
        .into_iter()
        .fold(0u64, u64::saturating_add);
    check_demo_host(&a, &m, host_tiers)?;
    let mut b = Store::builder()
        .capacity(Tier::Device, a.device_budget)
        .capacity(Tier::Pinned, a.pinned_budget)
        .capacity(Tier::Mapped, a.mapped_budget)
        .capacity(Tier::Disk, a.disk_budget)
        .policy(a.policy);
    if a.host {
        b = b.host_backend();
    }
    let store = b.build()?;
    out!("strata demo")?;
    out!("backend: {}", store.backend_description())?;
    let (rows, hidden) = (m.rows, m.hidden);
    out!(
        "model: {} layers of f32 [{rows}, {hidden}] weights + [{hidden}] bias = {}; budgets: \
         device {}, pinned {}, mapped {}, disk {}; policy {}",
        a.layers,
        format_size(u64::try_from(m.bytes()).unwrap_or(u64::MAX)),
        format_size(a.device_budget),
        format_size(a.pinned_budget),
        format_size(a.mapped_budget),
        format_size(a.disk_budget),
        a.policy
    )?;
    check_demo_fits(&store, &a, &m)?;
    let mut ids = Vec::with_capacity(a.layers);
    let t0 = Instant::now();
    let puts = bar(2 * a.layers as u64, "put");
    for l in 0..a.layers {
        let w = store.put(
            &format!("layer{l}.weight"),
            DType::F32,
            &[rows, hidden],
            &contents(l, 0, rows * hidden * 4),
        )?;
        let bias = store.put(
            &format!("layer{l}.bias"),
            DType::F32,
            &[hidden],
            &contents(l, 1, hidden * 4),
        )?;
        ids.push((w, bias));
        puts.inc(2);
    }
    puts.finish_and_clear();
    out!("put {} tensors in {:.1} ms", 2 * a.layers, t0.elapsed().as_secs_f64() * 1e3)?;
    for pass in 0..a.passes {
        let before = store.stats();
        let t = Instant::now();
        let order: Vec<usize> = (0..a.layers).chain((0..a.layers).rev()).collect();
        let reads = bar(2 * order.len() as u64, &format!("pass {}/{}", pass + 1, a.passes));
        for &l in &order {
            for (part, id) in [ids[l].0, ids[l].1].into_iter().enumerate() {
                let got = store.read(id)?;
                if got != contents(l, part, got.len()) {
                    anyhow::bail!("layer {l} part {part}: contents differ after migration");
                }
            }
            reads.inc(2);
        }
        reads.finish_and_clear();
        let after = store.stats();
        out!(
            "pass {}/{}: {} reads in {:.1} ms, hits {} misses {}, all bytes verified",
            pass + 1,
            a.passes,
            order.len() * 2,
            t.elapsed().as_secs_f64() * 1e3,
            after.hits - before.hits,
            after.misses - before.misses
        )?;
    }
    out!()?;
    out!("{}", store.stats())?;
    store.check_err()?;
    Ok(())
}
