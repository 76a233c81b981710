//! A BERT checkpoint run by candle-transformers' `BertModel` with its weights served by strata,
//! in memory or layer by layer out of core under a device budget.
//!
//! ```text
//! cargo run --release --features candle --example candle_bert -- \
//!     --model all-MiniLM-L6-v2/model.safetensors --config all-MiniLM-L6-v2/config.json \
//!     --tokens 101,7592,2088,102 [--device-budget 8MiB]
//! ```
//! `--model` is a `.safetensors` file, a sharded checkpoint's `*.index.json` or a directory,
//! loaded in place. Without `--device-budget`, the model is built whole from strata's candle-nn
//! `VarBuilder` backend (`strata::candle::StoreBackend`) and run. With it, the Device tier gets
//! that budget, the weights are staged once in the Pinned tier, and the encoder runs layer by
//! layer (`strata::candle::OutOfCoreBert`: each layer's weights fetched through device views, the
//! next prefetched); then the in-memory model runs on the same input as the reference (its time
//! is the compute floor) and the two outputs are compared bit for bit.
//!
//! Runs on candle's CPU device (the store on its host backend, whose Device tier is host
//! memory), or on the GPU when built with `--features candle-cuda` and a GPU is present (the
//! store in candle's CUDA context, on candle's stream).
//!
//! Prints the time, the bytes moved and the store's stats; the last line is the mean over the
//! tokens of the last hidden state, a JSON array of `hidden_size` numbers.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use candle_transformers::models::bert::{BertModel, Config};
use strata::apps::args;
use strata::candle::{Layers, OutOfCoreBert, StoreBackend};
use strata::{format_size, LoadOptions, Stats, Store, Tier};

/// Forward passes per run; the first reads the weights cold.
const STEPS: usize = 3;

/// A BERT checkpoint run by candle with its weights served by strata.
#[derive(clap::Parser)]
struct Args {
    /// The checkpoint: a .safetensors file, a sharded checkpoint's *.index.json, or a directory.
    #[arg(long)]
    model: std::path::PathBuf,
    /// The model's config.json (Hugging Face BERT config).
    #[arg(long)]
    config: std::path::PathBuf,
    /// Input token ids, comma-separated (attention mask all ones, token types 0).
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// Run the encoder layer by layer out of core with this Device-tier budget (e.g. 8MiB).
    #[arg(long, value_parser = args::size)]
    device_budget: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    let a = <Args as clap::Parser>::parse();
    let config: Config = serde_json::from_str(
        &std::fs::read_to_string(&a.config)
            .with_context(|| format!("reading {}", a.config.display()))?,
    )
    .with_context(|| format!("{} is not a BERT config.json", a.config.display()))?;
    let device = candle_device();
    let n = a.tokens.len();
    let input_ids = Tensor::new(a.tokens.as_slice(), &device)?.unsqueeze(0)?;
    let token_type_ids = input_ids.zeros_like()?;
    let attention_mask = input_ids.ones_like()?;

    let mut builder = Store::builder().capacity(Tier::Mapped, 0);
    if let Some(budget) = a.device_budget {
        // The Device tier holds what streams; Pinned, the model (the host's memory is not the
        // constraint here). Release-after-copy leaves the whole budget to the prefetches.
        let model_bytes = checkpoint_bytes(&a.model)?;
        builder = builder
            .capacity(Tier::Device, budget)
            .prefetch_budget(budget)
            .capacity(Tier::Pinned, model_bytes + (16 << 20));
    }
    let store = strata::candle::store_for(&device, builder)?;
    println!("candle device: {device:?}; strata: {}", store.backend_description());
    let t = Instant::now();
    let loaded = store.load_checkpoint(&a.model, LoadOptions::default())?;
    let bytes: u64 = loaded.iter().map(|t| store.info(t.id).map_or(0, |i| i.bytes)).sum();
    println!(
        "checkpoint: {} tensors, {} in {} file(s), loaded in place in {:.1} ms",
        loaded.len(),
        format_size(bytes),
        loaded.files().len(),
        ms(t)
    );
    println!(
        "config: {} layers, hidden {}, {} heads; {n} tokens",
        config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    );

    let in_memory = |store: &Arc<Store>| -> anyhow::Result<(Tensor, f64, Vec<f64>)> {
        let t = Instant::now();
        let vb =
            StoreBackend::from_loaded(store.clone(), &loaded).into_var_builder(DType::F32, &device);
        let model = BertModel::load(vb, &config)?;
        device.synchronize()?;
        let load_ms = ms(t);
        let mut times = Vec::new();
        let mut out = None;
        for _ in 0..STEPS {
            let t = Instant::now();
            let hidden = model.forward(&input_ids, &token_type_ids, Some(&attention_mask))?;
            device.synchronize()?;
            times.push(ms(t));
            out = Some(hidden);
        }
        Ok((out.context("no step ran")?, load_ms, times))
    };

    let Some(budget) = a.device_budget else {
        let (hidden, load_ms, times) = in_memory(&store)?;
        println!("in memory: model built from strata's VarBuilder backend in {load_ms:.1} ms");
        println!("in memory: forward {} ms", list(&times));
        moved(&store.stats());
        println!("{}", store.stats());
        return print_mean(&hidden);
    };

    // Out of core: the weights staged once in Pinned (from the file), then streamed per layer.
    let t = Instant::now();
    for lt in loaded.iter() {
        store
            .move_to(lt.id, Tier::Pinned)
            .with_context(|| format!("staging {} in Pinned", lt.name))?;
    }
    println!("staged {} in Pinned in {:.1} ms", format_size(bytes), ms(t));
    let layers = Layers::from_loaded(store.clone(), &loaded, &device)?;
    let bert = OutOfCoreBert::new(layers, &config, DType::F32)?;
    println!(
        "out of core: Device budget {} for a model of {} ({} per encoder layer)",
        format_size(budget),
        format_size(bytes),
        format_size(layer_bytes(&store, &loaded, 0))
    );
    let mut hidden = None;
    let mut times = Vec::new();
    let mut step_h2d = Vec::new();
    for step in 0..STEPS {
        let before = store.stats();
        let t = Instant::now();
        let h = bert.forward(&input_ids, &token_type_ids, Some(&attention_mask))?;
        device.synchronize()?;
        times.push(ms(t));
        let after = store.stats();
        let into_device = after.moved_into(Tier::Device) - before.moved_into(Tier::Device);
        step_h2d.push(into_device);
        println!(
            "out of core step {step}: {:.1} ms, {} into Device, device views: {} hits, {} misses; \
             {} prefetches",
            times[step],
            format_size(into_device),
            after.prefetch_hits - before.prefetch_hits,
            after.prefetch_misses - before.prefetch_misses,
            after.prefetches - before.prefetches
        );
        hidden = Some(h);
    }
    let hidden = hidden.context("no step ran")?;
    let tr = bert.layers().transfers()?;
    println!(
        "handed to candle: {} tensors; {} copied out of device views in {:.2} ms ({}); {} of \
         embedding rows gathered on the host; {} read around the Device tier",
        tr.tensors,
        format_size(tr.view_copy_bytes),
        tr.view_copy_seconds * 1e3,
        if device.is_cuda() { "device to device, on candle's stream" } else { "host memcpy" },
        format_size(tr.gathered_bytes),
        format_size(tr.host_copy_bytes)
    );
    let stats = store.stats();
    moved(&stats);
    println!("{stats}");

    // The reference: the whole model in memory, same input, same candle ops.
    let (reference, _, ref_times) = in_memory(&store)?;
    let warm = |v: &[f64]| v[1..].iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "in memory (compute floor): forward {} ms; out of core best warm step {:.1} ms = {:.2}x",
        list(&ref_times),
        warm(&times),
        warm(&times) / warm(&ref_times)
    );
    if let Some(bw) = h2d_bandwidth(&store) {
        let pcie_ms = *step_h2d.last().unwrap_or(&0) as f64 / bw * 1e3;
        let floor = pcie_ms.max(warm(&ref_times));
        println!(
            "PCIe floor: {} at {:.1} GB/s = {pcie_ms:.2} ms; max(compute, PCIe) {floor:.2} ms; \
             out of core step / floor {:.2}",
            format_size(*step_h2d.last().unwrap_or(&0)),
            bw / 1e9,
            warm(&times) / floor
        );
    }
    compare(&hidden, &reference)?;
    print_mean(&hidden)
}

/// candle's CUDA device when built with `candle-cuda` and a GPU answers, else its CPU.
fn candle_device() -> Device {
    #[cfg(feature = "candle-cuda")]
    match Device::new_cuda(0) {
        Ok(d) => return d,
        Err(e) => println!("no CUDA device for candle ({e}): running on the CPU"),
    }
    Device::Cpu
}

/// The checkpoint's tensor bytes, from its headers (a store that only loads it in place).
fn checkpoint_bytes(path: &std::path::Path) -> anyhow::Result<u64> {
    let store = Store::builder().host_backend().capacity(Tier::Device, 0).build()?;
    let loaded = store.load_checkpoint(path, LoadOptions::default())?;
    Ok(loaded.iter().map(|t| store.info(t.id).map_or(0, |i| i.bytes)).sum())
}

fn layer_bytes(store: &Store, loaded: &strata::Loaded, l: usize) -> u64 {
    let marker = format!("encoder.layer.{l}.");
    loaded
        .iter()
        .filter(|t| t.name.contains(&marker))
        .map(|t| store.info(t.id).map_or(0, |i| i.bytes))
        .sum()
}

/// The pinned host-to-device bandwidth of the store's GPU (a raw copy of 64 MiB), on CUDA.
fn h2d_bandwidth(store: &Store) -> Option<f64> {
    let ctx = store.cuda_context()?;
    let bytes = 64 << 20;
    let times =
        strata::probe::raw_pinned_copy(ctx, bytes, strata::probe::Direction::HostToDevice, 5)
            .ok()?;
    Some(bytes as f64 / strata::probe::median(&times))
}

fn moved(s: &Stats) {
    let mut pairs = Vec::new();
    for from in Tier::ALL {
        for to in Tier::ALL {
            if s.moved(from, to) > 0 {
                pairs.push(format!("{from}->{to} {}", format_size(s.moved(from, to))));
            }
        }
    }
    println!(
        "bytes moved: {}; device views: {} hits, {} misses; {} prefetches",
        if pairs.is_empty() { "none".to_string() } else { pairs.join(", ") },
        s.prefetch_hits,
        s.prefetch_misses,
        s.prefetches
    );
}

fn compare(a: &Tensor, b: &Tensor) -> anyhow::Result<()> {
    let a = a.flatten_all()?.to_vec1::<f32>()?;
    let b = b.flatten_all()?.to_vec1::<f32>()?;
    let differ = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    let max = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    if differ == 0 {
        println!(
            "out of core vs in memory: the same bits ({} values of the last hidden state)",
            a.len()
        );
    } else {
        println!(
            "out of core vs in memory: {differ} of {} values differ, max |difference| {max:e}",
            a.len()
        );
    }
    Ok(())
}

fn print_mean(hidden: &Tensor) -> anyhow::Result<()> {
    let mean = hidden.mean(1)?.squeeze(0)?.to_vec1::<f32>()?;
    println!("{}", serde_json::to_string(&mean)?);
    Ok(())
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn list(v: &[f64]) -> String {
    v.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(", ")
}
