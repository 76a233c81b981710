//! A BERT checkpoint run by candle-transformers' `BertModel` with its weights served by strata,
//! in memory or layer by layer out of core under a device budget.
//!
//! ```text
//! cargo run --release --no-default-features --features candle --example candle_bert -- \
//!     --model all-MiniLM-L6-v2/model.safetensors --config all-MiniLM-L6-v2/config.json \
//!     --tokens 101,7592,2088,102 [--device-budget 8MiB [--resident K|auto]] [--steps 3] [--warmup 1]
//! ```
//! Flags are parsed by hand (no CLI dependency). `--steps N` forwards are timed after
//! `--warmup N` untimed ones (3 and 1 by default), and their min and median printed.
//! `--model` is a `.safetensors` file, a sharded checkpoint's `*.index.json` or a directory,
//! loaded in place. Without `--device-budget`, the model is built whole from strata's candle-nn
//! `VarBuilder` backend (`strata::candle::StoreBackend`) and run. With it, the Device tier gets
//! that budget, the weights are staged once in the Pinned tier, and the encoder runs layer by
//! layer (`strata::candle::OutOfCoreBert`: each layer's weights fetched through device views, the
//! next prefetched); then the in-memory model runs on the same input as the reference (its time
//! is the compute floor) and the two outputs are compared bit for bit. `--resident K` keeps the
//! first K encoder layers built across forwards (all of them: the whole model, embeddings
//! included), their weights held by candle; `auto` keeps as many as the device budget holds
//! (`OutOfCoreBert::layers_within`). Those weights are outside the store's budget.
//!
//! Runs on candle's CPU device (the store on its host backend, whose Device tier is host
//! memory), or on the GPU when built with `--features candle-cuda` and a GPU is present (the
//! store in candle's CUDA context, on candle's stream).
//!
//! Prints the time, the bytes moved and the store's stats; the last line is the mean over the
//! tokens of the last hidden state, a JSON array of `hidden_size` numbers.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::bert::{BertModel, Config};
use st::candle::{Layers, OutOfCoreBert, StoreBackend};
use st::{format_size, LoadOptions, Stats, Store, Tier};
use strata as st;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const USAGE: &str = "usage: candle_bert --model PATH --config CONFIG.json --tokens 101,7592,102 \
[--device-budget SIZE [--resident K|auto]] [--steps N] [--warmup N]";

struct Args {
    /// The checkpoint: a .safetensors file, a sharded checkpoint's *.index.json, or a directory.
    model: PathBuf,
    /// The model's config.json (Hugging Face BERT config).
    config: PathBuf,
    /// Input token ids (attention mask all ones, token types 0).
    tokens: Vec<u32>,
    /// Run the encoder layer by layer out of core with this Device-tier budget.
    device_budget: Option<u64>,
    /// Encoder layers kept built across forwards (`None`: as many as the budget holds).
    resident: Option<usize>,
    /// Timed forwards, after `warmup` untimed ones.
    steps: usize,
    warmup: usize,
}

/// The flags, parsed by hand (no CLI dependency: the example builds with
/// `--no-default-features --features candle`).
fn parse_args() -> Res<Args> {
    let (mut model, mut config, mut tokens) = (None, None, Vec::new());
    let mut a = Args {
        model: PathBuf::new(),
        config: PathBuf::new(),
        tokens: Vec::new(),
        device_budget: None,
        resident: Some(0),
        steps: 3,
        warmup: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let count = || -> Res<usize> {
            value.parse().map_err(|_| format!("{flag} {value}: a count expected").into())
        };
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(&value)),
            "--config" => config = Some(PathBuf::from(&value)),
            "--tokens" => {
                tokens = value
                    .split(',')
                    .map(|t| t.trim().parse::<u32>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| format!("--tokens {value}: token ids like 101,7592,102"))?
            }
            "--device-budget" => a.device_budget = Some(st::parse_size(&value)?),
            "--resident" if value == "auto" => a.resident = None,
            "--resident" => a.resident = Some(count()?),
            "--steps" => a.steps = count()?.max(1),
            "--warmup" => a.warmup = count()?,
            _ => return Err(format!("unknown flag {flag}\n{USAGE}").into()),
        }
    }
    a.model = model.ok_or_else(|| format!("--model is required\n{USAGE}"))?;
    a.config = config.ok_or_else(|| format!("--config is required\n{USAGE}"))?;
    if tokens.is_empty() {
        return Err(format!("--tokens is required\n{USAGE}").into());
    }
    a.tokens = tokens;
    Ok(a)
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("candle_bert: {e}");
        std::process::exit(1);
    }
}

fn real_main() -> Res<()> {
    let a = parse_args()?;
    let text = std::fs::read_to_string(&a.config)
        .map_err(|e| format!("reading {}: {e}", a.config.display()))?;
    let config: Config = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a BERT config.json: {e}", a.config.display()))?;
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

    let in_memory = |store: &Arc<Store>| -> Res<(Tensor, f64, Vec<f64>)> {
        let t = Instant::now();
        let vb =
            StoreBackend::from_loaded(store.clone(), &loaded).into_var_builder(DType::F32, &device);
        let model = BertModel::load(vb, &config)?;
        device.synchronize()?;
        let load_ms = ms(t);
        let mut times = Vec::new();
        let mut out = None;
        for step in 0..a.warmup + a.steps {
            let t = Instant::now();
            let hidden = model.forward(&input_ids, &token_type_ids, Some(&attention_mask))?;
            device.synchronize()?;
            if step >= a.warmup {
                times.push(ms(t));
            }
            out = Some(hidden);
        }
        Ok((out.ok_or("no step ran")?, load_ms, times))
    };

    let Some(budget) = a.device_budget else {
        let (hidden, load_ms, times) = in_memory(&store)?;
        println!("in memory: model built from strata's VarBuilder backend in {load_ms:.1} ms");
        println!("in memory: forward {}", min_median(&times));
        moved(&store.stats());
        println!("{}", store.stats());
        return print_mean(&hidden);
    };

    // Out of core: the weights staged once in Pinned (from the file), then streamed per layer.
    let t = Instant::now();
    for lt in loaded.iter() {
        store
            .move_to(lt.id, Tier::Pinned)
            .map_err(|e| format!("staging {} in Pinned: {}", lt.name, e.chain()))?;
    }
    println!("staged {} in Pinned in {:.1} ms", format_size(bytes), ms(t));
    let layers = Layers::from_loaded(store.clone(), &loaded, &device)?;
    let bert = OutOfCoreBert::new(layers, &config, DType::F32)?;
    let k = match a.resident {
        Some(k) => k,
        None => bert.layers_within(budget)?,
    };
    let t = Instant::now();
    let bert = bert.with_resident(k)?;
    println!(
        "out of core: Device budget {} for a model of {} ({} per encoder layer); {} of {} layers \
         kept resident{} ({:.1} ms to build them)",
        format_size(budget),
        format_size(bytes),
        format_size(layer_bytes(&store, &loaded, 0)),
        bert.resident_layers(),
        config.num_hidden_layers,
        if bert.resident_layers() == config.num_hidden_layers { ", embeddings too" } else { "" },
        ms(t)
    );
    let mut hidden = None;
    let mut times = Vec::new();
    let mut step_h2d = Vec::new();
    for step in 0..a.warmup + a.steps {
        let before = store.stats();
        let t = Instant::now();
        let h = bert.forward(&input_ids, &token_type_ids, Some(&attention_mask))?;
        device.synchronize()?;
        let took = ms(t);
        let after = store.stats();
        let into_device = after.moved_into(Tier::Device) - before.moved_into(Tier::Device);
        step_h2d.push(into_device);
        println!(
            "out of core step {step}{}: {took:.1} ms, {} into Device, device views: {} hits, {} \
             misses; {} prefetches",
            if step < a.warmup { " (warmup)" } else { "" },
            format_size(into_device),
            after.prefetch_hits - before.prefetch_hits,
            after.prefetch_misses - before.prefetch_misses,
            after.prefetches - before.prefetches
        );
        if step >= a.warmup {
            times.push(took);
        }
        hidden = Some(h);
    }
    let hidden = hidden.ok_or("no step ran")?;
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
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "in memory (compute floor): forward {}; out of core {}: median {:.2}x in memory",
        min_median(&ref_times),
        min_median(&times),
        median(&times) / median(&ref_times)
    );
    let warm = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
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
fn checkpoint_bytes(path: &std::path::Path) -> Res<u64> {
    let store = Store::builder().host_backend().capacity(Tier::Device, 0).build()?;
    let loaded = store.load_checkpoint(path, LoadOptions::default())?;
    Ok(loaded.iter().map(|t| store.info(t.id).map_or(0, |i| i.bytes)).sum())
}

fn layer_bytes(store: &Store, loaded: &st::Loaded, l: usize) -> u64 {
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
        st::probe::raw_pinned_copy(ctx, bytes, st::probe::Direction::HostToDevice, 5).ok()?;
    Some(bytes as f64 / st::probe::median(&times))
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

fn compare(a: &Tensor, b: &Tensor) -> Res<()> {
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

fn print_mean(hidden: &Tensor) -> Res<()> {
    let mean = hidden.mean(1)?.squeeze(0)?.to_vec1::<f32>()?;
    println!("{}", serde_json::to_string(&mean)?);
    Ok(())
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// "min X ms, median Y ms (N steps)" of times in ms.
fn min_median(v: &[f64]) -> String {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let median =
        if v.len() % 2 == 1 { v[v.len() / 2] } else { (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0 };
    format!("min {:.2} ms, median {median:.2} ms ({} steps)", v[0], v.len())
}
