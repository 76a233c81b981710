//! The `strata` command line: `strata demo`, `bench`, `train-demo`, `inspect` (a checkpoint's
//! tensors and a memory plan) and `load` (a checkpoint into a store).

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Instant;

use clap::builder::{PossibleValue, TypedValueParser};
use clap::{Parser, Subcommand};
use strata::apps::args::{self, TrainDemoArgs};
use strata::plan::{Bandwidths, Optimizer, PlanConfig};
use strata::{format_size, DType, LoadOptions, PolicyKind, Store, Tier};

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "A tiered tensor store: GPU HBM, pinned, mapped and NVMe tiers"
)]
struct Cli {
    /// Log what strata does on stderr: -v its steps, -vv details (RUST_LOG overrides).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

// Each subcommand's doc: a one-line summary (`strata --help` lists these), a blank line, then
// what `strata SUBCOMMAND --help` adds.
#[derive(Subcommand)]
enum Cmd {
    /// Runs a synthetic model through small tier budgets and checks every byte.
    ///
    /// Puts a layered model (each layer a weight matrix and a bias) into a store with small
    /// budgets, reads it back layer by layer (forward then backward) for a few passes, checks
    /// every byte, and prints the tiers, the bytes moved between them and the hit ratio. Uses
    /// the GPU when there is one. Sizes are checked against the budgets and this host's memory
    /// before anything is allocated.
    Demo(DemoArgs),
    /// Measures every path between the tiers on this machine, in GB/s.
    ///
    /// Pinned and pageable copies, both directions at once, device to device, zero-copy and
    /// managed memory, disk, and the store's own moves beside the raw figures, swept over
    /// sizes: prints a table of GB/s and writes CSV, JSON and an SVG plot on request. Without a
    /// GPU: the host and disk paths only. A size a path cannot run at on this machine (host
    /// memory, disk space) is skipped with the reason.
    Bench(BenchArgs),
    /// Trains or runs an MLP larger than the device budget, out of core.
    ///
    /// `--mode train`: the trainer (relu MLP, squared-error loss, SGD or AdamW with fp32 master
    /// weights and moments in the store, activations kept, offloaded or recomputed, inputs from
    /// safetensors files). `--mode forward` (default) and `--mode train --optimizer
    /// device-sgd`: the bf16 benchmark loop against its compute and PCIe floors, also in
    /// simulated time (`--simulate h100`). Quick check without a GPU: `strata train-demo --mode
    /// train --layers 4 --hidden 64 --rows 8 --device-budget 64KiB --host`.
    TrainDemo(Box<TrainDemoArgs>),
    /// Lists a checkpoint's tensors and plans their memory, without reading the data.
    ///
    /// Lists the tensors (name, dtype, shape, bytes) and their totals, then a memory plan:
    /// parameters, gradients (--train) and optimizer state (--train --optimizer
    /// sgd|sgd-momentum|adamw) placed device first under the budgets, and the predicted
    /// transfer time per step from `strata bench --json` results (--bench) or a brief
    /// measurement. The checkpoint is a .safetensors file, a sharded checkpoint's index
    /// (model.safetensors.index.json), or a directory (its index, else all its .safetensors
    /// files). See docs/inspect.md for the accounting and the formula.
    Inspect(InspectArgs),
    /// Loads a checkpoint into a store, in place or copied into a tier.
    ///
    /// The checkpoint is a .safetensors file, a sharded checkpoint's index
    /// (model.safetensors.index.json) or a directory. The store has these budgets (the GPU when
    /// there is one, unless --host). In place by default (the disk tier refers to the mapped
    /// files, nothing is copied); --copy-to TIER copies each tensor into TIER with a progress
    /// bar, and tensors the tier cannot hold stay in place (the command says which). --checksums
    /// then reads every tensor back and prints its crc32. Ends with the store's tier table.
    Load(LoadArgs),
}

/// Tier budgets, as `strata inspect` and `strata load` take them (defaults: the store's).
#[derive(clap::Args)]
struct Budgets {
    /// Device tier budget (units: 4096, 24KiB, 1MiB, 1GiB; 0 disables the tier).
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = args::size)]
    device_budget: u64,
    /// Pinned tier budget.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = args::size)]
    pinned_budget: u64,
    /// Mapped tier budget.
    #[arg(long, value_name = "SIZE", default_value = "256MiB", value_parser = args::size)]
    mapped_budget: u64,
    /// Disk tier budget (the store's own file; tensors loaded in place do not use it).
    #[arg(long, value_name = "SIZE", default_value = "64GiB", value_parser = args::size)]
    disk_budget: u64,
}

impl Budgets {
    fn array(&self) -> [u64; 4] {
        [self.device_budget, self.pinned_budget, self.mapped_budget, self.disk_budget]
    }
}

/// The checkpoint argument's help, for `inspect` and `load`.
const CHECKPOINT_HELP: &str = "The checkpoint, in one of three forms: a .safetensors file; a \
    sharded checkpoint's index (model.safetensors.index.json, its shards beside it); or a \
    directory (its *.safetensors.index.json if it has one, else every *.safetensors file in it, \
    in name order)";

#[derive(clap::Args)]
struct InspectArgs {
    #[arg(value_name = "CHECKPOINT", help = CHECKPOINT_HELP)]
    path: std::path::PathBuf,
    #[command(flatten)]
    budgets: Budgets,
    /// Optimizer whose state is counted with --train, named as train-demo names them: none, sgd
    /// (no momentum, as train-demo's and strata::optim's; alias sgd-plain), sgd-momentum (one
    /// fp32 buffer), adamw (two fp32 moments; alias adam).
    #[arg(long, value_name = "OPTIMIZER", default_value = "none", value_parser = optimizer())]
    optimizer: Optimizer,
    /// Plan for training steps (gradients, optimizer state) rather than forward passes.
    #[arg(long)]
    train: bool,
    /// Count gradients in fp32 (4 bytes per element), as for accumulation over micro-batches.
    #[arg(long)]
    fp32_grads: bool,
    /// Bandwidths from a `strata bench --json` results file [default: measured briefly].
    #[arg(long, value_name = "FILE.json")]
    bench: Option<std::path::PathBuf>,
}

#[derive(clap::Args)]
struct LoadArgs {
    #[arg(value_name = "CHECKPOINT", help = CHECKPOINT_HELP)]
    path: std::path::PathBuf,
    #[command(flatten)]
    budgets: Budgets,
    /// Copy every tensor into this tier (those it cannot hold stay in place) [default: in
    /// place].
    #[arg(long, value_name = "TIER", value_parser = args::tier())]
    copy_to: Option<Tier>,
    /// Use the host backend even when a GPU is present.
    #[arg(long)]
    host: bool,
    /// After loading, read every tensor back through the store and print its crc32 (to compare
    /// checkpoints bit for bit).
    #[arg(long)]
    checksums: bool,
}

#[derive(clap::Args)]
struct DemoArgs {
    /// Layers of the synthetic model (each a weight matrix and a bias).
    #[arg(long, value_name = "N", default_value = "12", value_parser = args::count, allow_negative_numbers = true)]
    layers: usize,
    /// Size of each layer's weight (units: 4096, 24KiB, 1MiB, 1GiB).
    #[arg(long, value_name = "SIZE", default_value = "2MiB", value_parser = args::size)]
    layer_size: u64,
    /// Passes over the model (each forward 0..L then backward L..0).
    #[arg(long, value_name = "N", default_value = "3", value_parser = args::count, allow_negative_numbers = true)]
    passes: usize,
    /// Device tier budget.
    #[arg(long, value_name = "SIZE", default_value = "6MiB", value_parser = args::size)]
    device_budget: u64,
    /// Pinned tier budget.
    #[arg(long, value_name = "SIZE", default_value = "6MiB", value_parser = args::size)]
    pinned_budget: u64,
    /// Mapped tier budget.
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = args::size)]
    mapped_budget: u64,
    /// Disk tier budget.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = args::size)]
    disk_budget: u64,
    /// Eviction policy (schedule learns the repeating access order and prefetches along it;
    /// train-demo's default too).
    #[arg(long, value_name = "POLICY", default_value = "schedule", value_parser = args::policy())]
    policy: PolicyKind,
    /// Use the host backend even when a GPU is present.
    #[arg(long)]
    host: bool,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Sizes to sweep, comma-separated, with units.
    #[arg(long, value_name = "SIZE,...", default_value = strata::apps::bench::DEFAULT_SIZES)]
    sizes: String,
    /// Timed runs per path and size [default: 20 up to 16 MiB, 5 above].
    #[arg(long, value_name = "N", value_parser = args::count, allow_negative_numbers = true)]
    reps: Option<usize>,
    /// Write the results as CSV (path,size_bytes,gbps,median_s,reps).
    #[arg(long, value_name = "FILE", value_parser = args::output)]
    csv: Option<std::path::PathBuf>,
    /// Write the results and a description of the machine as JSON.
    #[arg(long, value_name = "FILE", value_parser = args::output)]
    json: Option<std::path::PathBuf>,
    /// Write a plot of bandwidth against size as SVG (the name must end in .svg).
    #[arg(long, value_name = "FILE.svg", value_parser = args::svg_output)]
    plot: Option<std::path::PathBuf>,
    /// Host and disk paths only (the store on its host backend), even with a GPU present.
    #[arg(long)]
    host: bool,
    /// Directory for the disk paths' file and the store's disk tier [default: a temporary one].
    #[arg(long, value_name = "DIR")]
    disk_dir: Option<std::path::PathBuf>,
    /// Paths to run, comma-separated names or prefixes ending in '*' (h2d_pinned,store_*)
    /// [default: all].
    #[arg(long, value_name = "PATH,...")]
    paths: Option<String>,
}

fn bench(a: BenchArgs) -> anyhow::Result<()> {
    let options = strata::apps::bench::Options {
        sizes: strata::apps::bench::parse_sizes(&a.sizes)?,
        reps: a.reps,
        host_only: a.host,
        disk_dir: a.disk_dir,
        paths: a.paths.as_deref().map(strata::apps::bench::parse_paths).transpose()?,
        progress: true,
    };
    let cmd = strata::apps::bench::Command { options, csv: a.csv, json: a.json, plot: a.plot };
    cmd.run()?;
    Ok(())
}

/// A plan's optimizer, by train-demo's names (and the old ones as aliases).
fn optimizer() -> impl clap::builder::TypedValueParser<Value = Optimizer> {
    clap::builder::PossibleValuesParser::new([
        PossibleValue::new("none"),
        PossibleValue::new("sgd").alias("sgd-plain"),
        PossibleValue::new("sgd-momentum"),
        PossibleValue::new("adamw").alias("adam"),
    ])
    .try_map(|s| s.parse::<Optimizer>())
}

/// `println!` that returns the error of a closed stdout instead of panicking on it.
macro_rules! out {
    () => {
        strata::apps::println("")
    };
    ($($t:tt)*) => {
        strata::apps::println(&format!($($t)*))
    };
}

/// `print!` likewise.
macro_rules! out_raw {
    ($($t:tt)*) => {
        strata::apps::print(&format!($($t)*))
    };
}

/// Logs to stderr: `RUST_LOG` when set (`RUST_LOG=strata=debug`), else warnings, `-v` strata's
/// info events, `-vv` its debug events.
fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "warn,strata=info",
        _ => "warn,strata=debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    // Under a file-size limit a write that crosses it fails with EFBIG (an error naming the
    // file) instead of the process dying by SIGXFSZ.
    if let Err(e) = strata::ignore_file_size_signal() {
        tracing::warn!("cannot ignore SIGXFSZ: {e}");
    }
    let res = match cli.cmd {
        Cmd::Demo(a) => demo(a),
        Cmd::Bench(a) => bench(a),
        Cmd::TrainDemo(args) => train_demo(&args),
        Cmd::Inspect(a) => inspect(a),
        Cmd::Load(a) => load(a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout went away (`strata inspect ... | head`): nothing is wrong.
        Err(e) if e.chain().any(strata::apps::is_broken_pipe) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

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

/// A progress bar on stderr over `len` steps (drawn only where stderr is a terminal).
fn bar(len: u64, msg: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} eta {eta}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(msg.to_string());
    bar
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

fn demo(a: DemoArgs) -> anyhow::Result<()> {
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

fn train_demo(args: &TrainDemoArgs) -> anyhow::Result<()> {
    out!("strata train-demo")?;
    let outcome = strata::apps::train::dispatch(args, strata::apps::println)?;
    out!("{outcome}")?;
    if let strata::apps::train::Outcome::Mlp(r) = &outcome {
        if r.matches_resident == Some(false) {
            anyhow::bail!("the out-of-core run differs from the all-resident run");
        }
    }
    Ok(())
}

/// The files a checkpoint came from, when there are several or an index named them: `3 files
/// named by DIR/model.safetensors.index.json: a, b, c`; long lists shortened.
fn files_line(files: &[std::path::PathBuf], index: Option<&std::path::Path>) -> Option<String> {
    if files.len() == 1 && index.is_none() {
        return None;
    }
    let names: Vec<String> = files
        .iter()
        .map(|f| {
            f.file_name().map_or_else(|| f.display().to_string(), |n| n.to_string_lossy().into())
        })
        .collect();
    let list = match names.len() {
        0..=4 => names.join(", "),
        n => format!("{}, {}, ..., {}", names[0], names[1], names[n - 1]),
    };
    let n = files.len();
    let s = if n == 1 { "" } else { "s" };
    Some(match index {
        Some(i) => format!("{n} file{s} named by {}: {list}", i.display()),
        None => format!("{n} file{s}: {list}"),
    })
}

/// A checkpoint's `__metadata__` as one line of JSON, shortened past 200 characters.
fn metadata_line(metadata: &std::collections::BTreeMap<String, String>) -> Option<String> {
    if metadata.is_empty() {
        return None;
    }
    let json = serde_json::to_string(metadata).unwrap_or_default();
    Some(match json.char_indices().nth(200) {
        Some((cut, _)) => format!("{}... ({} bytes)", &json[..cut], json.len()),
        None => json,
    })
}

fn inspect(a: InspectArgs) -> anyhow::Result<()> {
    let ckpt = strata::plan::read_checkpoint(&a.path)?;
    let tensors = ckpt.tensors;
    out!("strata inspect {}", a.path.display())?;
    if let Some(line) = files_line(&ckpt.files, ckpt.index.as_deref()) {
        out!("files: {line}")?;
    }
    if let Some(line) = metadata_line(&ckpt.metadata) {
        out!("metadata: {line}")?;
    }
    out!()?;
    out_raw!("{}", strata::plan::tensor_table(&tensors))?;
    out!()?;
    out_raw!("{}", strata::plan::totals(&tensors))?;
    out!()?;
    let cfg = PlanConfig {
        budgets: a.budgets.array(),
        optimizer: a.optimizer,
        train: a.train,
        fp32_grads: a.fp32_grads,
    };
    let plan = strata::plan::plan(&tensors, &cfg);
    out_raw!("{plan}")?;
    if !a.train && a.optimizer != Optimizer::None {
        out!("note: --optimizer {} counts only with --train", a.optimizer)?;
    }
    out!()?;
    let traffic = plan.traffic();
    let bw = match &a.bench {
        Some(path) => Bandwidths::from_bench_json(path)?,
        None => {
            let pcie = traffic.h2d + traffic.d2h > 0;
            let disk = traffic.disk_read + traffic.disk_write > 0;
            // The largest file: the disk figure is a read of up to 64 MiB of it.
            let largest = ckpt
                .files
                .iter()
                .max_by_key(|f| std::fs::metadata(f).map_or(0, |m| m.len()))
                .map(|f| f.as_path());
            Bandwidths::measure(pcie, largest.filter(|_| disk))
        }
    };
    out_raw!("{}", plan.predict(&bw))?;
    for n in &bw.notes {
        out!("  {n}")?;
    }
    Ok(())
}

fn load(a: LoadArgs) -> anyhow::Result<()> {
    let mut b = Store::builder();
    for (t, cap) in Tier::ALL.into_iter().zip(a.budgets.array()) {
        b = b.capacity(t, cap);
    }
    if a.host {
        b = b.host_backend();
    }
    let store = b.build()?;
    out!("strata load {}", a.path.display())?;
    out!("backend: {}", store.backend_description())?;
    let t0 = Instant::now();
    let copy_to_disk = a.copy_to == Some(Tier::Disk);
    let opts = LoadOptions { copy_to: a.copy_to.filter(|_| copy_to_disk), ..Default::default() };
    // A copy into the disk tier is one call (the tensors go from the file to the store's own
    // file); the bar can only say it is running.
    let spinner = copy_to_disk.then(|| {
        let p = indicatif::ProgressBar::new_spinner();
        p.set_message(format!("copying {} into the disk tier", a.path.display()));
        p.enable_steady_tick(std::time::Duration::from_millis(120));
        p
    });
    let loaded = store.load_checkpoint(&a.path, opts);
    if let Some(p) = spinner {
        p.finish_and_clear();
    }
    let loaded = loaded?;
    if let Some(line) = files_line(
        &loaded.files().iter().map(|f| f.path.clone()).collect::<Vec<_>>(),
        loaded.index(),
    ) {
        out!("files: {line}")?;
    }
    if let Some(line) = metadata_line(loaded.metadata()) {
        out!("metadata: {line}")?;
    }
    let mut sizes = Vec::with_capacity(loaded.len());
    for t in &loaded {
        sizes.push(store.info(t.id)?.bytes);
    }
    let total: u64 = sizes.iter().sum();
    let secs = t0.elapsed().as_secs_f64();
    if copy_to_disk {
        out!(
            "copied {} tensors ({}) into the disk tier in {:.1} ms ({:.2} GB/s)",
            loaded.len(),
            format_size(total),
            secs * 1e3,
            total as f64 / secs.max(1e-9) / 1e9
        )?;
    } else {
        let files = match loaded.files().len() {
            1 => "the mapped file".to_string(),
            n => format!("the {n} mapped files"),
        };
        out!(
            "loaded {} tensors ({}) in place in {:.1} ms: the disk tier refers to {files}",
            loaded.len(),
            format_size(total),
            secs * 1e3
        )?;
    }
    if let Some(tier) = a.copy_to.filter(|_| !copy_to_disk) {
        copy_into(&store, &loaded, &sizes, tier)?;
    }
    if a.checksums {
        out!()?;
        out_raw!("{}", checksum_table(&store, &loaded)?)?;
    }
    out!()?;
    out!("{}", store.stats())?;
    store.check_err()?;
    Ok(())
}

/// `strata load --copy-to TIER` (a memory tier): copies tensor by tensor, so that the bar moves,
/// each `move_to` copying one tensor from its file into `tier` (the file stays its clean copy
/// below). A tensor the tier cannot hold (larger than the tier, or no room left beside the
/// tensors already copied) stays where it is, and the command goes on with the next and says
/// at the end which stayed; any other error ends it.
fn copy_into(
    store: &Store,
    loaded: &strata::Loaded,
    sizes: &[u64],
    tier: Tier,
) -> anyhow::Result<()> {
    let capacity = store.stats().capacity(tier);
    if capacity == 0 {
        anyhow::bail!("--copy-to {tier}: the {tier} tier is disabled (its budget is 0)");
    }
    let total: u64 = sizes.iter().sum();
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {decimal_bytes_per_sec} eta {eta}",
        )?
        .progress_chars("=> "),
    );
    bar.set_message(format!("copying into {tier}"));
    let t = Instant::now();
    let (mut copied, mut copied_bytes) = (0usize, 0u64);
    let mut stayed: Vec<(&str, u64)> = Vec::new();
    for (t, &bytes) in loaded.iter().zip(sizes) {
        match store.move_to(t.id, tier) {
            Ok(()) => {
                copied += 1;
                copied_bytes += bytes;
            }
            Err(strata::Error::TooLarge { .. } | strata::Error::OutOfMemory { .. }) => {
                stayed.push((&t.store_name, bytes));
            }
            Err(e) => {
                bar.abandon();
                return Err(anyhow::Error::new(e)
                    .context(format!("copying {:?} into {tier}", t.store_name)));
            }
        }
        bar.inc(bytes);
    }
    bar.finish_and_clear();
    let secs = t.elapsed().as_secs_f64();
    out!(
        "copied {copied} of {} tensors ({} of {}) into {tier} in {:.1} ms ({:.2} GB/s)",
        loaded.len(),
        format_size(copied_bytes),
        format_size(total),
        secs * 1e3,
        copied_bytes as f64 / secs.max(1e-9) / 1e9
    )?;
    let now = loaded.iter().filter(|t| store.tier_of(t.id).is_ok_and(|at| at == tier)).count();
    if now < copied {
        out!(
            "{now} of them are in {tier} now: copying the others made room by moving earlier \
             ones down"
        )?;
    }
    if let Some(&(name, bytes)) = stayed.iter().max_by_key(|s| s.1) {
        let stayed_bytes: u64 = stayed.iter().map(|s| s.1).sum();
        let n = stayed.len();
        let (s, verb) = if n == 1 { ("", "stays") } else { ("s", "stay") };
        out!(
            "{n} tensor{s} ({}) did not fit in {tier} (budget {}) and {verb} in place in the disk \
             tier, the largest {name} ({}): raise --{tier}-budget to hold them",
            format_size(stayed_bytes),
            format_size(capacity),
            format_size(bytes)
        )?;
    }
    Ok(())
}

/// `strata inspect`'s tensor table (names as in the files) with each tensor's crc32, its bytes
/// read back through the store.
fn checksum_table(store: &Store, loaded: &strata::Loaded) -> anyhow::Result<String> {
    let mut entries = Vec::with_capacity(loaded.len());
    let mut crcs = Vec::with_capacity(loaded.len());
    for t in loaded {
        let info = store.info(t.id)?;
        crcs.push(crc32fast::hash(&store.read(t.id)?));
        entries.push(strata::plan::TensorEntry {
            name: t.name.clone(),
            dtype: info.dtype,
            shape: info.shape,
            bytes: info.bytes,
        });
    }
    let table = strata::plan::tensor_table(&entries);
    let mut out = String::with_capacity(table.len() + 10 * crcs.len());
    for (i, line) in table.lines().enumerate() {
        match i.checked_sub(1).map(|k| crcs[k]) {
            None => out.push_str(&format!("{line}     crc32\n")),
            Some(crc) => out.push_str(&format!("{line}  {crc:08x}\n")),
        }
    }
    Ok(out)
}
