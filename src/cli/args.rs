//! The command line of `strata train-demo` and `examples/out_of_core.rs` ([`TrainDemoArgs`],
//! parsed with clap), and the value parsers every `strata` subcommand shares, so that an option
//! is spelled, checked and explained the same way wherever it appears (the test
//! `train_demo_flags_parse_and_a_bad_one_says_why` shows a parse).

use std::path::{Path, PathBuf};

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, ValueEnum};

use strata::optim::Engine;
use strata::plan::OptimizerStep;
use strata::{
    parse_size, DType, Error, LinkSharing, Machine, PolicyKind, Result, Simulation, Tier,
};

/// Refuses a value with white space in it (`' 3'`, `'1 GiB'`): a quoting mistake in a script,
/// better caught than guessed at.
fn no_spaces(s: &str) -> std::result::Result<&str, String> {
    if s.chars().any(char::is_whitespace) {
        Err(format!("{s:?} has white space in it: write the value alone (3, 24KiB)"))
    } else {
        Ok(s)
    }
}

/// A size with units (`4096`, `24KiB`, `1GiB`; 0 allowed).
pub fn size(s: &str) -> std::result::Result<u64, String> {
    parse_size(no_spaces(s)?).map_err(|e| e.to_string())
}

/// A count of at least 1.
pub fn count(s: &str) -> std::result::Result<usize, String> {
    match no_spaces(s)?.parse::<i128>() {
        Ok(n) if n >= 1 && n <= usize::MAX as i128 => Ok(n as usize),
        Ok(_) => Err("must be a whole number of at least 1".into()),
        Err(_) => Err("not a whole number".into()),
    }
}

/// A count that may be 0.
pub fn count0(s: &str) -> std::result::Result<usize, String> {
    match no_spaces(s)?.parse::<i128>() {
        Ok(n) if n >= 0 && n <= usize::MAX as i128 => Ok(n as usize),
        Ok(_) => Err("must be a whole number of at least 0".into()),
        Err(_) => Err("not a whole number".into()),
    }
}

fn number(s: &str) -> std::result::Result<f64, String> {
    let x: f64 = no_spaces(s)?.parse().map_err(|_| "not a number".to_string())?;
    if x.is_finite() {
        Ok(x)
    } else {
        Err("must be a finite number".into())
    }
}

/// A finite number above 0 (a learning rate, eps).
pub fn positive(s: &str) -> std::result::Result<f64, String> {
    match number(s) {
        Ok(x) if x > 0.0 => Ok(x),
        _ => Err("must be a positive finite number".into()),
    }
}

/// A finite number of at least 0 (a weight decay).
pub fn non_negative(s: &str) -> std::result::Result<f64, String> {
    match number(s) {
        Ok(x) if x >= 0.0 => Ok(x),
        _ => Err("must be a finite number of at least 0".into()),
    }
}

/// A number in `[0, 1)` (Adam's betas).
pub fn beta(s: &str) -> std::result::Result<f64, String> {
    match number(s) {
        Ok(x) if (0.0..1.0).contains(&x) => Ok(x),
        _ => Err("must be a number from 0 up to (not including) 1".into()),
    }
}

/// A seed: any whole number from 0 to 2^64 − 1.
pub fn seed(s: &str) -> std::result::Result<u64, String> {
    no_spaces(s)?
        .parse()
        .map_err(|_| "must be a whole number from 0 to 18446744073709551615".into())
}

/// A store policy: `frequency`, `lru` or `schedule` (listed in `--help`).
pub fn policy() -> impl TypedValueParser<Value = PolicyKind> {
    PossibleValuesParser::new(["frequency", "lru", "schedule"]).try_map(|s| s.parse::<PolicyKind>())
}

/// A tier: `device`, `pinned`, `mapped` or `disk`.
pub fn tier() -> impl TypedValueParser<Value = Tier> {
    PossibleValuesParser::new(["device", "pinned", "mapped", "disk"]).try_map(|s| s.parse::<Tier>())
}

/// Where the weights live off the device: `pinned` or `disk`.
pub fn weights_tier() -> impl TypedValueParser<Value = Tier> {
    PossibleValuesParser::new(["pinned", "disk"]).try_map(|s| s.parse::<Tier>())
}

/// Checks, before any long work, that a file can be written at `path`: its directory exists,
/// a file can be created in it (tried with an unnamed file, which leaves nothing behind: a
/// permission check would be wrong for root and on some mounts), and `path` is not a
/// directory, a FIFO or a device.
pub fn check_output(path: &Path) -> Result<()> {
    let bad =
        |why: String| Error::InvalidArgument(format!("cannot write {}: {why}", path.display()));
    if path.as_os_str().is_empty() {
        return Err(Error::InvalidArgument("an empty output path".into()));
    }
    if path.is_dir() {
        return Err(bad("it is a directory".into()));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(bad(format!("{} is not a directory", dir.display()))),
        Err(e) => return Err(bad(format!("directory {}: {e}", dir.display()))),
    }
    if let Ok(m) = std::fs::metadata(path) {
        if !m.is_file() {
            return Err(bad("it is not a regular file".into()));
        }
    }
    // Whether a file can be created there: an unnamed one, gone when dropped.
    tempfile::tempfile_in(dir)
        .map(drop)
        .map_err(|e| bad(format!("cannot create a file in {}: {e}", dir.display())))
}

/// An output file ([`check_output`]).
pub fn output(s: &str) -> std::result::Result<PathBuf, String> {
    let p = PathBuf::from(s);
    check_output(&p).map_err(|e| e.to_string())?;
    Ok(p)
}

/// An SVG output file: [`output`], and a name ending in `.svg` (the plot is SVG only; a
/// `.png` holding SVG would not open as a PNG).
pub fn svg_output(s: &str) -> std::result::Result<PathBuf, String> {
    let p = output(s)?;
    match p.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => Ok(p),
        _ => Err("the plot is written as SVG: give a file name ending in .svg".into()),
    }
}

/// `on` or `off` (also `true`/`false`, `1`/`0`): the old spelling of `--hints` and
/// `--compare`, which `--no-hints` and `--no-compare` replace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    /// On.
    #[value(alias = "true", alias = "1")]
    On,
    /// Off.
    #[value(alias = "false", alias = "0")]
    Off,
}

impl OnOff {
    /// `true` for on.
    pub fn on(self) -> bool {
        self == OnOff::On
    }
}

/// `--mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Forward passes: the bf16 inference benchmark.
    Forward,
    /// Training steps: the trainer, or with `--optimizer device-sgd` the bf16 benchmark's
    /// training loop.
    Train,
}

/// `--optimizer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    /// SGD without momentum (the trainer).
    Sgd,
    /// AdamW with fp32 master weights and moments (the trainer).
    Adamw,
    /// SGD applied on the device to the bf16 weights themselves (the bf16 benchmark loop).
    DeviceSgd,
}

/// `--engine`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    /// Host threads over pinned state.
    Cpu,
    /// A kernel reading the state zero-copy from mapped memory.
    GpuMapped,
    /// A kernel over state migrated to the device.
    GpuResident,
    /// The fastest of the three, from measured bandwidths.
    Auto,
    /// Each of them (and auto) in turn, compared.
    All,
}

impl EngineArg {
    /// The engine, or `None` for `all`.
    pub fn engine(self) -> Option<Engine> {
        match self {
            EngineArg::Cpu => Some(Engine::Cpu),
            EngineArg::GpuMapped => Some(Engine::GpuMapped),
            EngineArg::GpuResident => Some(Engine::GpuResident),
            EngineArg::Auto => Some(Engine::Auto),
            EngineArg::All => None,
        }
    }
}

/// `--dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    /// 32-bit floats.
    F32,
    /// bfloat16.
    Bf16,
}

impl DTypeArg {
    /// The dtype.
    pub fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
        }
    }
}

/// `--activations`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ActivationsArg {
    /// Every layer's input stays on the device.
    Keep,
    /// Inputs go to the store in the forward pass and are prefetched back for backward.
    Offload,
    /// Every k-th input is stored; the others are recomputed in backward.
    Recompute,
}

/// `--machine`: a machine's figures written down (a preset, not a measurement of the machine
/// that runs), for plans and predictions made for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MachineArg {
    /// The lent H100 (80 GB HBM, PCIe Gen5 as measured on it): `strata::Machine::h100()`.
    H100,
    /// The H200 lent now (141 GB HBM; its PCIe and GEMM rates assumed to be the H100's):
    /// `strata::Machine::h200()`.
    H200,
}

impl MachineArg {
    /// The preset.
    pub fn machine(self) -> Machine {
        match self {
            MachineArg::H100 => Machine::h100(),
            MachineArg::H200 => Machine::h200(),
        }
    }

    /// What it is called where a given figure changes it: "the H100 preset".
    pub fn label(self) -> &'static str {
        match self {
            MachineArg::H100 => "the H100 preset",
            MachineArg::H200 => "the H200 preset",
        }
    }
}

/// `--simulate`: a preset machine (`strata::Machine`) and how opposite copies share its link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SimulateArg {
    /// The H100 preset (`Machine::h100()`), the reference of docs/benchmarks.md's simulated
    /// figures.
    H100,
    /// The H200 preset (`Machine::h200()`: its PCIe and GEMM rates assumed to be the H100's).
    H200,
    /// The H100 preset, opposite copies sharing the link half and half (`LinkSharing::Half`).
    H100Half,
}

impl SimulateArg {
    /// The preset simulated.
    pub fn machine(self) -> Machine {
        match self {
            SimulateArg::H100 | SimulateArg::H100Half => Machine::h100(),
            SimulateArg::H200 => Machine::h200(),
        }
    }

    /// What the figures are for: "the H100 preset", "the H200 preset", "the H100 preset, link
    /// shared half and half".
    pub fn label(self) -> &'static str {
        match self {
            SimulateArg::H100 => "the H100 preset",
            SimulateArg::H200 => "the H200 preset",
            SimulateArg::H100Half => "the H100 preset, link shared half and half",
        }
    }

    /// The simulated machine: [`Simulation::of`] the preset, with the link sharing asked for.
    pub fn simulation(self) -> Result<Simulation> {
        let mut s = Simulation::of(&self.machine())?;
        if self == SimulateArg::H100Half {
            s.sharing = LinkSharing::Half;
        }
        Ok(s)
    }
}

const BOTH: &str = "Both loops";
const TRAINER: &str = "The trainer (--mode train)";
const BENCH: &str =
    "The bf16 benchmark loop (--mode forward, or --mode train --optimizer device-sgd)";

/// The flags of `strata train-demo` and `examples/out_of_core.rs`. Two loops share them:
/// `--mode train` runs the trainer ([`crate::cli::train`]: relu MLP, SGD or AdamW with fp32
/// state in the store); `--mode forward` (the default) and `--mode train --optimizer
/// device-sgd` run the bf16 benchmark loop ([`crate::cli::mlp`]). A flag left out takes the
/// loop's default; a flag of the other loop is an error that says so. A flag given twice takes
/// its last value (so a script can append to a base command).
#[derive(Args, Clone, Debug, Default, PartialEq)]
#[command(args_override_self = true)]
pub struct TrainDemoArgs {
    /// forward: the bf16 inference benchmark; train: the trainer (or, with --optimizer
    /// device-sgd, the benchmark's training loop). [default: forward]
    #[arg(long, value_enum, help_heading = BOTH)]
    pub mode: Option<ModeArg>,
    /// Layers [default: 32; with --init, the file's].
    #[arg(long, value_name = "L", value_parser = count, allow_negative_numbers = true, help_heading = BOTH)]
    pub layers: Option<usize>,
    /// Width: every layer is [H, H] [default: 8192; with --init, the file's].
    #[arg(long, value_name = "H", value_parser = count, allow_negative_numbers = true, help_heading = BOTH)]
    pub hidden: Option<usize>,
    /// Batch rows [default: 2048; with --data, the file's].
    #[arg(long, value_name = "R", value_parser = count, allow_negative_numbers = true, help_heading = BOTH)]
    pub rows: Option<usize>,
    /// Steps; the first is a warm-up for the figures [default: 10 benchmark, 5 trainer].
    #[arg(long, value_name = "N", value_parser = count, allow_negative_numbers = true, help_heading = BOTH)]
    pub steps: Option<usize>,
    /// Learning rate [default: 0.001].
    #[arg(long, value_name = "X", value_parser = positive, allow_negative_numbers = true, help_heading = BOTH)]
    pub lr: Option<f64>,
    /// Seed of the weights and inputs [default: 0].
    #[arg(long, value_name = "S", value_parser = seed, allow_negative_numbers = true, help_heading = BOTH)]
    pub seed: Option<u64>,
    /// Device tier budget (units: 4096, 24KiB, 1GiB) [default: 1GiB benchmark, 8GiB trainer].
    #[arg(long, value_name = "SIZE", value_parser = size, help_heading = BOTH)]
    pub device_budget: Option<u64>,
    /// Layers a layer scope prefetches ahead [default: 1 benchmark, 2 trainer].
    #[arg(long, value_name = "K", value_parser = count0, allow_negative_numbers = true, help_heading = BOTH)]
    pub ahead: Option<usize>,
    /// The store's policy [default: schedule].
    #[arg(long, value_parser = policy(), help_heading = BOTH)]
    pub policy: Option<PolicyKind>,
    /// Skip the run with every weight resident (the compute floor and, for the benchmark, the
    /// bit-for-bit reference), which runs by default.
    #[arg(long, help_heading = BOTH, conflicts_with = "compare")]
    pub no_compare: bool,
    /// The old spelling of --no-compare: `--compare off` (kept so that recorded commands run).
    #[arg(long, value_enum, hide = true)]
    pub compare: Option<OnOff>,
    /// Use the host backend even when a GPU is present.
    #[arg(long, help_heading = BOTH)]
    pub host: bool,

    /// sgd or adamw (the trainer) [default: adamw]; device-sgd runs the benchmark's training
    /// loop.
    #[arg(long, value_enum, help_heading = TRAINER)]
    pub optimizer: Option<OptimizerArg>,
    /// AdamW's beta1 [default: 0.9].
    #[arg(long, value_name = "X", value_parser = beta, allow_negative_numbers = true, help_heading = TRAINER)]
    pub beta1: Option<f64>,
    /// AdamW's beta2 [default: 0.999].
    #[arg(long, value_name = "X", value_parser = beta, allow_negative_numbers = true, help_heading = TRAINER)]
    pub beta2: Option<f64>,
    /// AdamW's eps [default: 1e-8].
    #[arg(long, value_name = "X", value_parser = positive, allow_negative_numbers = true, help_heading = TRAINER)]
    pub eps: Option<f64>,
    /// Weight decay: decoupled for AdamW, L2 for SGD [default: 0].
    #[arg(long, value_name = "X", value_parser = non_negative, allow_negative_numbers = true, help_heading = TRAINER)]
    pub weight_decay: Option<f64>,
    /// Where the optimizer update runs [default: auto].
    #[arg(long, value_enum, help_heading = TRAINER)]
    pub engine: Option<EngineArg>,
    /// Threads of the cpu engine; 0: every core [default: 0].
    #[arg(long, value_name = "N", value_parser = count0, allow_negative_numbers = true, help_heading = TRAINER)]
    pub threads: Option<usize>,
    /// Micro-batches per step, gradients accumulated in f32 [default: 1].
    #[arg(long, value_name = "N", value_parser = count, allow_negative_numbers = true, help_heading = TRAINER)]
    pub accumulate: Option<usize>,
    /// Compute dtype [default: bf16 on CUDA, f32 on the host backend].
    #[arg(long, value_enum, help_heading = TRAINER)]
    pub dtype: Option<DTypeArg>,
    /// What happens to the activations backward needs [default: keep].
    #[arg(long, value_enum, help_heading = TRAINER)]
    pub activations: Option<ActivationsArg>,
    /// With --activations recompute: store every K-th layer's input [default: 4].
    #[arg(long, value_name = "K", value_parser = count, allow_negative_numbers = true, help_heading = TRAINER)]
    pub checkpoint_every: Option<usize>,
    /// Initial weights: layers.{i}.weight, [H, H], f32 or bf16 (sets L and H).
    #[arg(long, value_name = "FILE", help_heading = TRAINER)]
    pub init: Option<PathBuf>,
    /// Inputs and targets: x and y, [R, H], f32 (sets R).
    #[arg(long, value_name = "FILE", help_heading = TRAINER)]
    pub data: Option<PathBuf>,
    /// Write the final weights here (safetensors, f32).
    #[arg(long, value_name = "FILE", value_parser = output, help_heading = TRAINER)]
    pub save: Option<PathBuf>,
    /// Pinned tier budget [default: room for everything host-side].
    #[arg(long, value_name = "SIZE", value_parser = size, help_heading = TRAINER)]
    pub pinned_budget: Option<u64>,
    /// Mapped tier budget [default: room for the optimizer state when the engine may use it].
    #[arg(long, value_name = "SIZE", value_parser = size, help_heading = TRAINER)]
    pub mapped_budget: Option<u64>,

    /// No layer scopes around the layers: on-demand migration only (the policy alone).
    #[arg(long, help_heading = BENCH, conflicts_with = "hints")]
    pub no_hints: bool,
    /// The old spelling of --no-hints: `--hints off` (kept so that recorded commands run).
    #[arg(long, value_enum, hide = true)]
    pub hints: Option<OnOff>,
    /// The store's prefetch budget [default: `ahead` layers, at least one].
    #[arg(long, value_name = "SIZE", value_parser = size, help_heading = BENCH)]
    pub prefetch_budget: Option<u64>,
    /// Layers pinned on the device for the whole run [default: in training with hints, half
    /// of what the device budget holds; else 0].
    #[arg(long, value_name = "K", value_parser = count0, allow_negative_numbers = true, help_heading = BENCH)]
    pub keep: Option<usize>,
    /// Where the weights live off the device [default: pinned].
    #[arg(long, value_parser = weights_tier(), help_heading = BENCH)]
    pub weights_in: Option<Tier>,
    /// Run in simulated time on the host backend, a small model timed as the one asked for on
    /// a preset machine's figures, not a measurement (h100-half: opposite copies share the link
    /// half and half).
    #[arg(long, value_enum, help_heading = BENCH)]
    pub simulate: Option<SimulateArg>,
    /// Write a Chrome trace of the out-of-core run's copies and waits here.
    #[arg(long, value_name = "FILE", value_parser = output, help_heading = BENCH)]
    pub trace: Option<PathBuf>,
}

/// `train-demo` as a command of its own (what `examples/out_of_core.rs` parses, and what
/// [`TrainDemoArgs::try_parse`] parses with).
#[derive(Parser, Clone, Debug)]
#[command(
    name = "train-demo",
    about = "Out-of-core training and inference of an MLP whose state lives in a strata store \
             with a device budget smaller than the model"
)]
pub struct TrainDemoCommand {
    /// The flags.
    #[command(flatten)]
    pub args: TrainDemoArgs,
}

impl TrainDemoArgs {
    /// Whether the all-resident comparison runs (`--no-compare` or `--compare off` turn it off).
    pub fn compare(&self) -> bool {
        !self.no_compare && self.compare.is_none_or(OnOff::on)
    }

    /// Whether `--no-hints` (or `--hints off`) was given; `None` when neither, nor `--hints on`.
    pub fn hints(&self) -> Option<bool> {
        if self.no_hints {
            Some(false)
        } else {
            self.hints.map(OnOff::on)
        }
    }

    /// Parses flags (without a program name): clap's rules (`--flag value`, `--flag=value`),
    /// its error messages as [`Error::InvalidArgument`].
    #[cfg(test)] // the binary parses its whole command line (`Cli`)
    pub fn try_parse<I, S>(args: I) -> Result<TrainDemoArgs>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let argv = std::iter::once("train-demo".to_string())
            .chain(args.into_iter().map(|s| s.as_ref().to_string()));
        TrainDemoCommand::try_parse_from(argv)
            .map(|c| c.args)
            .map_err(|e| Error::InvalidArgument(e.to_string().trim_end().to_string()))
    }

    /// Whether these flags run the trainer (`--mode train` without `--optimizer device-sgd`).
    pub fn runs_trainer(&self) -> bool {
        self.mode == Some(ModeArg::Train) && self.optimizer != Some(OptimizerArg::DeviceSgd)
    }

    /// The trainer's own flags that were given.
    fn trainer_flags(&self) -> Vec<&'static str> {
        let given = [
            ("--beta1", self.beta1.is_some()),
            ("--beta2", self.beta2.is_some()),
            ("--eps", self.eps.is_some()),
            ("--weight-decay", self.weight_decay.is_some()),
            ("--engine", self.engine.is_some()),
            ("--threads", self.threads.is_some()),
            ("--accumulate", self.accumulate.is_some()),
            ("--dtype", self.dtype.is_some()),
            ("--activations", self.activations.is_some()),
            ("--checkpoint-every", self.checkpoint_every.is_some()),
            ("--init", self.init.is_some()),
            ("--data", self.data.is_some()),
            ("--save", self.save.is_some()),
            ("--pinned-budget", self.pinned_budget.is_some()),
            ("--mapped-budget", self.mapped_budget.is_some()),
        ];
        given.into_iter().filter(|g| g.1).map(|g| g.0).collect()
    }

    /// The benchmark loop's own flags that were given.
    fn bench_flags(&self) -> Vec<&'static str> {
        let given = [
            ("--no-hints", self.no_hints || self.hints.is_some()),
            ("--prefetch-budget", self.prefetch_budget.is_some()),
            ("--keep", self.keep.is_some()),
            ("--weights-in", self.weights_in.is_some()),
            ("--simulate", self.simulate.is_some()),
            ("--trace", self.trace.is_some()),
        ];
        given.into_iter().filter(|g| g.1).map(|g| g.0).collect()
    }

    /// An error naming flags of the trainer given to the benchmark loop.
    pub(crate) fn refuse_trainer_flags(&self) -> Result<()> {
        refuse(&self.trainer_flags(), "the trainer", "the bf16 benchmark loop")
    }

    /// An error naming flags of the benchmark loop given to the trainer.
    pub(crate) fn refuse_bench_flags(&self) -> Result<()> {
        refuse(&self.bench_flags(), "the bf16 benchmark loop", "the trainer")
    }
}

/// "`flags` belong to `owner`, not to `other`" (with how to run each), unless `flags` is empty.
fn refuse(flags: &[&str], owner: &str, other: &str) -> Result<()> {
    if flags.is_empty() {
        return Ok(());
    }
    let how = |loop_: &str| match loop_ {
        "the trainer" => "the trainer (--mode train)",
        _ => "the bf16 benchmark loop (--mode forward, or --optimizer device-sgd)",
    };
    Err(Error::InvalidArgument(format!(
        "{} belong{} to {}, not to {}",
        flags.join(", "),
        if flags.len() == 1 { "s" } else { "" },
        how(owner),
        how(other)
    )))
}

/// The sizes swept when none are given.
pub const DEFAULT_SIZES: &str = "4KiB,64KiB,1MiB,16MiB,256MiB,1GiB";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn train_demo_flags_parse_and_a_bad_one_says_why() -> Result<()> {
        let a = TrainDemoArgs::try_parse(["--mode=train", "--layers", "4", "--lr", "0.01"])?;
        assert_eq!(a.layers, Some(4));
        let e = TrainDemoArgs::try_parse(["--lr", "-1"]).unwrap_err().to_string();
        assert!(e.contains("must be a positive finite number"), "{e}");
        let e = TrainDemoArgs::try_parse(["--layer", "4"]).unwrap_err().to_string();
        assert!(e.contains("unexpected argument '--layer'"), "{e}");
        Ok(())
    }

    #[test]
    fn numbers_are_checked_with_a_reason() {
        assert_eq!(count("3"), Ok(3));
        assert!(count("0").unwrap_err().contains("at least 1"));
        assert!(count("-1").unwrap_err().contains("at least 1"));
        assert_eq!(count0("0"), Ok(0));
        assert!(count0("x").is_err());
        assert_eq!(positive("1e-3"), Ok(1e-3));
        for bad in ["0", "-1", "nan", "inf", "-inf", "x"] {
            assert!(positive(bad).is_err(), "{bad}");
        }
        assert!(non_negative("0").is_ok() && non_negative("-0.1").is_err());
        assert!(beta("0.9").is_ok() && beta("1").is_err() && beta("-0.1").is_err());
        assert!(seed("-1").is_err() && seed("18446744073709551615").is_ok());
        // Strict: no white space anywhere (a `' 3'` from a script is a mistake, not a 3).
        for bad in [" 3", "3 ", "\t3", "3\n"] {
            assert!(count(bad).unwrap_err().contains("white space"), "{bad:?}");
            assert!(count0(bad).is_err() && seed(bad).is_err() && positive(bad).is_err());
        }
        assert!(size(" 1MiB").is_err() && size("1 MiB").is_err() && size("1MiB ").is_err());
        assert_eq!(size("1MiB"), Ok(1 << 20));
    }

    #[test]
    fn output_paths_are_checked_before_work() {
        let dir = tempfile::tempdir().unwrap();
        assert!(output(dir.path().join("a.csv").to_str().unwrap()).is_ok());
        assert!(output("relative-file.csv").is_ok());
        let missing = dir.path().join("nope").join("a.csv");
        let e = output(missing.to_str().unwrap()).unwrap_err();
        assert!(e.contains("nope") && e.contains("cannot write"), "{e}");
        assert!(output(dir.path().to_str().unwrap()).unwrap_err().contains("is a directory"));
        assert!(svg_output(dir.path().join("p.svg").to_str().unwrap()).is_ok());
        let png = svg_output(dir.path().join("p.png").to_str().unwrap()).unwrap_err();
        assert!(png.contains(".svg"), "{png}");
    }

    #[test]
    fn train_demo_flags_parse_with_clap() {
        let a = TrainDemoArgs::try_parse([
            "--mode=train",
            "--optimizer",
            "adamw",
            "--lr=0.01",
            "--device-budget",
            "64KiB",
            "--policy",
            "lru",
            "--no-compare",
            "--host",
        ])
        .unwrap();
        assert_eq!(a.mode, Some(ModeArg::Train));
        assert_eq!(a.lr, Some(0.01));
        assert_eq!(a.device_budget, Some(64 << 10));
        assert_eq!(a.policy, Some(PolicyKind::Lru));
        assert!(!a.compare());
        assert!(a.host && a.runs_trainer());
        let none = TrainDemoArgs::try_parse(["--mode", "forward"]).unwrap();
        assert!(none.compare() && none.hints().is_none());
        assert_eq!(TrainDemoArgs::try_parse(["--no-hints"]).unwrap().hints(), Some(false));
        // The old spellings still parse (recorded commands use them); help shows the new.
        let old = TrainDemoArgs::try_parse(["--hints", "off", "--compare", "off"]).unwrap();
        assert_eq!((old.hints(), old.compare()), (Some(false), false));
        let on = TrainDemoArgs::try_parse(["--hints", "1", "--compare", "true"]).unwrap();
        assert_eq!((on.hints(), on.compare()), (Some(true), true));
        assert!(TrainDemoArgs::try_parse(["--no-hints", "--hints", "on"]).is_err());
        let cases = [
            (&["--lr", "nan"][..], "--lr"),
            (&["--lr", "-1"], "positive"),
            (&["--layers", "-1"], "at least 1"),
            (&["--steps", "0"], "at least 1"),
            (&["--bogus", "1"], "unexpected argument '--bogus'"),
            (&["--policy", "mru"], "schedule"),
            (&["--weights-in", "device"], "pinned"),
            (&["--rows"], "value is required"),
        ];
        for (args, want) in cases {
            let e = TrainDemoArgs::try_parse(args).unwrap_err().to_string();
            assert!(e.contains(want), "{args:?}: {e}");
        }
        let twice = TrainDemoArgs::try_parse(["--simulate", "h100", "--simulate=h100-half"]);
        assert_eq!(twice.unwrap().simulate, Some(SimulateArg::H100Half));
        let h200 = TrainDemoArgs::try_parse(["--simulate", "h200"]).unwrap().simulate.unwrap();
        assert_eq!(h200.machine(), Machine::h200());
        assert_eq!(h200.simulation().unwrap().memory_bytes_per_s, 4.3e12);
        let e = TrainDemoArgs::try_parse(["--simulate", "a100"]).unwrap_err().to_string();
        assert!(e.contains("h100, h200, h100-half"), "{e}");
        let help = TrainDemoArgs::try_parse(["--help"]).unwrap_err().to_string();
        assert!(help.contains("--checkpoint-every") && help.contains("--simulate"), "{help}");
        assert!(help.contains("--no-compare") && help.contains("--no-hints"), "{help}");
        assert!(!help.contains("--compare <") && !help.contains("--hints <"), "{help}");
    }

    #[test]
    fn a_flag_of_the_other_loop_is_named() {
        let a = TrainDemoArgs::try_parse(["--engine", "cpu", "--save", "w.safetensors"]).unwrap();
        let e = a.refuse_trainer_flags().unwrap_err().to_string();
        assert!(e.contains("--engine, --save belong to the trainer"), "{e}");
        let b = TrainDemoArgs::try_parse(["--mode", "train", "--keep", "2"]).unwrap();
        let e = b.refuse_bench_flags().unwrap_err().to_string();
        assert!(e.contains("--keep belongs to the bf16 benchmark loop"), "{e}");
    }
}

/// Tier budgets, as `strata inspect` and `strata load` take them (defaults: the store's).
#[derive(clap::Args)]
pub struct Budgets {
    /// Device tier budget (units: 4096, 24KiB, 1MiB, 1GiB; 0 disables the tier).
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = size)]
    pub(crate) device_budget: u64,
    /// Pinned tier budget [default: 1GiB; with `inspect --train`, the host memory available less
    /// what the trainer keeps for the system and the process, as the trainer's plan sizes it].
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub(crate) pinned_budget: Option<u64>,
    /// Mapped tier budget.
    #[arg(long, value_name = "SIZE", default_value = "256MiB", value_parser = size)]
    pub(crate) mapped_budget: u64,
    /// Disk tier budget (the store's own file; tensors loaded in place do not use it).
    #[arg(long, value_name = "SIZE", default_value = "64GiB", value_parser = size)]
    pub(crate) disk_budget: u64,
}

impl Budgets {
    /// The store's budget of a Pinned tier (`--pinned-budget`'s default).
    pub(crate) const PINNED: u64 = 1 << 30;

    /// The budgets, `--pinned-budget` defaulting to `pinned` (for [`Budgets::PINNED`]: the
    /// store's).
    pub(crate) fn array_with(&self, pinned: u64) -> [u64; 4] {
        let p = self.pinned_budget.unwrap_or(pinned);
        [self.device_budget, p, self.mapped_budget, self.disk_budget]
    }

    /// The budgets, the store's where not given.
    pub(crate) fn array(&self) -> [u64; 4] {
        self.array_with(Budgets::PINNED)
    }
}

/// The checkpoint argument's help, for `inspect` and `load`.
const CHECKPOINT_HELP: &str = "The checkpoint, in one of three forms: a .safetensors file; a \
    sharded checkpoint's index (model.safetensors.index.json, its shards beside it); or a \
    directory (its *.safetensors.index.json if it has one, else every *.safetensors file in it, \
    in name order)";

#[derive(clap::Args)]
pub struct InspectArgs {
    #[arg(value_name = "CHECKPOINT", help = CHECKPOINT_HELP)]
    pub(crate) path: std::path::PathBuf,
    #[command(flatten)]
    pub(crate) budgets: Budgets,
    /// Optimizer whose state is counted with --train, named as train-demo names them: none, sgd
    /// (no momentum, as train-demo's and strata::optim's; alias sgd-plain), sgd-momentum (one
    /// fp32 buffer), adamw (two fp32 moments; alias adam).
    #[arg(long, value_name = "OPTIMIZER", default_value = "none", value_parser = optimizer())]
    pub(crate) optimizer: OptimizerStep,
    /// Plan for training steps (gradients, optimizer state) rather than forward passes.
    #[arg(long)]
    pub(crate) train: bool,
    /// Count gradients in fp32 (4 bytes per element), as for accumulation over micro-batches.
    #[arg(long)]
    pub(crate) fp32_grads: bool,
    /// Bandwidths from a `strata bench --json` results file [default: measured briefly on this
    /// machine].
    #[arg(long, value_name = "FILE.json", conflicts_with = "machine")]
    pub(crate) bench: Option<std::path::PathBuf>,
    /// Predict for a preset machine's figures (written down, not measured here) instead.
    #[arg(long, value_enum)]
    pub(crate) machine: Option<MachineArg>,
}

#[derive(clap::Args)]
pub struct LoadArgs {
    #[arg(value_name = "CHECKPOINT", help = CHECKPOINT_HELP)]
    pub(crate) path: std::path::PathBuf,
    #[command(flatten)]
    pub(crate) budgets: Budgets,
    /// Copy every tensor into this tier (those it cannot hold stay in place) [default: in
    /// place].
    #[arg(long, value_name = "TIER", value_parser = tier())]
    pub(crate) copy_to: Option<Tier>,
    /// Use the host backend even when a GPU is present.
    #[arg(long)]
    pub(crate) host: bool,
    /// After loading, read every tensor back through the store and print its crc32 (to compare
    /// checkpoints bit for bit).
    #[arg(long)]
    pub(crate) checksums: bool,
}

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Layers of the synthetic model (each a weight matrix and a bias).
    #[arg(long, value_name = "N", default_value = "12", value_parser = count, allow_negative_numbers = true)]
    pub(crate) layers: usize,
    /// Size of each layer's weight (units: 4096, 24KiB, 1MiB, 1GiB).
    #[arg(long, value_name = "SIZE", default_value = "2MiB", value_parser = size)]
    pub(crate) layer_size: u64,
    /// Passes over the model (each forward 0..L then backward L..0).
    #[arg(long, value_name = "N", default_value = "3", value_parser = count, allow_negative_numbers = true)]
    pub(crate) passes: usize,
    /// Device tier budget.
    #[arg(long, value_name = "SIZE", default_value = "6MiB", value_parser = size)]
    pub(crate) device_budget: u64,
    /// Pinned tier budget.
    #[arg(long, value_name = "SIZE", default_value = "6MiB", value_parser = size)]
    pub(crate) pinned_budget: u64,
    /// Mapped tier budget.
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = size)]
    pub(crate) mapped_budget: u64,
    /// Disk tier budget.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = size)]
    pub(crate) disk_budget: u64,
    /// Eviction policy (schedule learns the repeating access order and prefetches along it;
    /// train-demo's default too).
    #[arg(long, value_name = "POLICY", default_value = "schedule", value_parser = policy())]
    pub(crate) policy: PolicyKind,
    /// Use the host backend even when a GPU is present.
    #[arg(long)]
    pub(crate) host: bool,
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Sizes to sweep, comma-separated, with units.
    #[arg(long, value_name = "SIZE,...", default_value = DEFAULT_SIZES)]
    pub(crate) sizes: String,
    /// Timed runs per path and size [default: 20 up to 16 MiB, 5 above].
    #[arg(long, value_name = "N", value_parser = count, allow_negative_numbers = true)]
    pub(crate) reps: Option<usize>,
    /// Write the results as CSV (path,size_bytes,gbps,median_s,reps).
    #[arg(long, value_name = "FILE", value_parser = output)]
    pub(crate) csv: Option<std::path::PathBuf>,
    /// Write the results and a description of the machine as JSON.
    #[arg(long, value_name = "FILE", value_parser = output)]
    pub(crate) json: Option<std::path::PathBuf>,
    /// Write a plot of bandwidth against size as SVG (the name must end in .svg).
    #[arg(long, value_name = "FILE.svg", value_parser = svg_output)]
    pub(crate) plot: Option<std::path::PathBuf>,
    /// Host and disk paths only (the store on its host backend), even with a GPU present.
    #[arg(long)]
    pub(crate) host: bool,
    /// Directory for the disk paths' file and the store's disk tier [default: a temporary one].
    #[arg(long, value_name = "DIR")]
    pub(crate) disk_dir: Option<std::path::PathBuf>,
    /// Paths to run, comma-separated names or prefixes ending in '*' (h2d_pinned,store_*)
    /// [default: all].
    #[arg(long, value_name = "PATH,...")]
    pub(crate) paths: Option<String>,
}

/// A plan's optimizer, by train-demo's names (and the old ones as aliases).
pub(crate) fn optimizer() -> impl clap::builder::TypedValueParser<Value = OptimizerStep> {
    clap::builder::PossibleValuesParser::new([
        PossibleValue::new("none"),
        PossibleValue::new("sgd").alias("sgd-plain"),
        PossibleValue::new("sgd-momentum"),
        PossibleValue::new("adamw").alias("adam"),
    ])
    .try_map(|s| s.parse::<OptimizerStep>())
}
