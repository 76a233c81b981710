//! The `strata` binary's commands: a module of the binary, not of the library, built on the
//! library's public API (`strata::...`) like any other program (feature `cli`, on by default);
//! `main.rs` only parses ([`Cli`]) and dispatches. [`demo`] (`strata demo`),
//! [`bench`](mod@bench) (`strata bench`), [`train`] and [`mlp`] (`strata train-demo`: the
//! out-of-core MLP trainer and the bf16 benchmark loop), [`inspect`] (`strata inspect`), [`load`]
//! (`strata load`), and their flags ([`args`]). A library user who wants the store alone turns
//! the feature off (`default-features = false`) and compiles none of this, nor its
//! dependencies.

use std::io::Write as _;

use clap::{Parser, Subcommand};

use args::{BenchArgs, DemoArgs, InspectArgs, LoadArgs, TrainDemoArgs};
use strata::{Error, Result};

/// `println!` that returns the error of a closed stdout instead of panicking on it.
macro_rules! out {
    () => {
        $crate::cli::println("")
    };
    ($($t:tt)*) => {
        $crate::cli::println(&format!($($t)*))
    };
}

/// `print!` likewise.
macro_rules! out_raw {
    ($($t:tt)*) => {
        $crate::cli::print(&format!($($t)*))
    };
}

pub mod args;
pub mod bench;
#[cfg(feature = "text")]
pub mod chat;
pub mod demo;
#[cfg(feature = "text")]
pub mod finetune;
#[cfg(feature = "text")]
pub mod generate;
pub mod inspect;
pub mod load;
pub mod mlp;
#[cfg(feature = "text")]
pub mod model;
#[cfg(feature = "serve")]
pub mod serve;
pub mod train;

/// The integration tests' helpers (`tests/common`), shared with the binary's unit tests: the
/// backends a test runs on, printing `SKIP` for CUDA without a GPU.
#[cfg(test)]
#[path = "../../tests/common/mod.rs"]
mod common;

/// Writes `text` to stdout as it is. A failed write comes back as [`Error::Io`] on `<stdout>`:
/// a reader that went away (`strata inspect model.safetensors | head`) ends the command there,
/// and the binary exits quietly with success on it ([`is_broken_pipe`]) rather than panic as
/// `print!` does.
pub fn print(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| Error::Io { path: "<stdout>".into(), source })
}

/// [`print`](fn@print) of `line` and a line break: the `progress` callback the demos take.
pub fn println(line: &str) -> Result<()> {
    print(&format!("{line}\n"))
}

/// Refuses to allocate `bytes` of host memory for `what` when the machine has less available
/// (`MemAvailable`): a model too large for this host is an error that says so, not an
/// allocation failure that aborts the process. `fix` says which of the command's flags make
/// it smaller.
pub(crate) fn check_host_memory(what: &str, bytes: u128, fix: &str) -> Result<()> {
    let Some(avail) = strata::host_memory_available() else { return Ok(()) };
    if bytes > avail as u128 {
        return Err(Error::InvalidArgument(format!(
            "{what} needs {} of host memory and {} is available: {fix}",
            strata::format_size(u64::try_from(bytes).unwrap_or(u64::MAX)),
            strata::format_size(avail)
        )));
    }
    Ok(())
}

/// Whether `e`, or an error it was caused by, is a write to a pipe whose reader has gone.
pub fn is_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
        {
            return true;
        }
        cur = err.source();
    }
    false
}

// A flag given twice takes its last value (as the hand-parsed examples before these commands
// did: scripts that repeat a flag keep working); repeatable flags still collect every value.
#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "A tiered tensor store: GPU HBM, pinned, mapped and NVMe tiers",
    args_override_self = true
)]
pub struct Cli {
    /// Log what strata does on stderr: -v its steps, -vv details (RUST_LOG overrides).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    #[command(subcommand)]
    pub cmd: Cmd,
}

// Each subcommand's doc: a one-line summary (`strata --help` lists these), a blank line, then
// what `strata SUBCOMMAND --help` adds.
#[derive(Subcommand)]
pub enum Cmd {
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
    /// parameters and gradients (--train) placed device first under the budgets, optimizer
    /// state (--train --optimizer sgd|sgd-momentum|adamw) in host memory (pinned, then disk) as
    /// the trainer keeps it, and the predicted
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
    /// Generates text (or token ids) with a Llama, Mistral or Qwen2 model, out of core.
    ///
    /// The model's blocks stream through a store under --device-budget, its KV cache in the
    /// store; several prompts form one batch (one pass of the weights per token serves them
    /// all). Prints the store's traffic, the prompt's and each token's pass, why each sequence
    /// stopped, and last the new tokens (one line a sequence, `;` between).
    #[cfg(feature = "text")]
    Generate(Box<generate::GenerateArgs>),
    /// Chats with a model interactively: its chat template, streamed tokens, /reset, /exit.
    ///
    /// Each line typed is a user message; the answer streams as it is generated. Ctrl-C during
    /// an answer stops it (what it said stays in the conversation) and returns to the prompt;
    /// Ctrl-C at the prompt, or twice, exits with status 130; /exit or Ctrl-D ends.
    #[cfg(feature = "text")]
    Chat(Box<chat::ChatArgs>),
    /// Trains a model, or LoRA adapters over it, out of core; Ctrl-C saves and stops.
    ///
    /// Full training or LoRA (--lora-rank R) in PEFT's format, on token ids, text or chat
    /// JSONL; a memory plan refuses what cannot fit before anything is allocated; a progress
    /// bar shows step, loss, tokens/s, bytes moved and the time left. Ctrl-C or SIGTERM
    /// finishes the step in flight, saves a checkpoint --resume continues, and exits 130.
    /// The blocks' attention runs on cuDNN's fused SDPA on a GPU where the library is built and
    /// takes the shape, else on strata's kernel: STRATA_ATTENTION=auto (the default), strata
    /// or cudnn chooses; the run prints which.
    #[cfg(feature = "text")]
    Finetune(Box<finetune::FinetuneArgs>),
    /// Serves a model over an OpenAI-compatible HTTP API, batching concurrent requests.
    ///
    /// GET /v1/models (and /v1/models/NAME), POST /v1/completions and /v1/chat/completions
    /// (streamed or not), /health and Prometheus /metrics. Requests arriving while others
    /// decode join the batch at the next token pass; a full queue answers 429; SIGTERM or
    /// Ctrl-C stops taking requests, finishes those in flight within --shutdown-timeout and
    /// exits 0; a second one exits at once (143 for SIGTERM, 130 for Ctrl-C).
    #[cfg(feature = "serve")]
    Serve(Box<serve::ServeArgs>),
}

/// Logs to stderr: `RUST_LOG` when set (`RUST_LOG=strata=debug`), else warnings, `-v` strata's
/// info events, `-vv` its debug events.
pub fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "warn,strata=info",
        _ => "warn,strata=debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

/// A progress bar on stderr over `len` steps (drawn only where stderr is a terminal).
pub(crate) fn bar(len: u64, msg: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} eta {eta}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(msg.to_string());
    bar
}
