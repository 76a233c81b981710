//! `strata inspect`: a checkpoint's tensors and a memory plan, without reading the data.

use super::args::InspectArgs;

use strata::plan::{OptimizerStep, PlanConfig};
use strata::Machine;

/// The files a checkpoint came from, when there are several or an index named them: `3 files
/// named by DIR/model.safetensors.index.json: a, b, c`; long lists shortened.
pub(crate) fn files_line(
    files: &[std::path::PathBuf],
    index: Option<&std::path::Path>,
) -> Option<String> {
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
pub(crate) fn metadata_line(
    metadata: &std::collections::BTreeMap<String, String>,
) -> Option<String> {
    if metadata.is_empty() {
        return None;
    }
    let json = serde_json::to_string(metadata).unwrap_or_default();
    Some(match json.char_indices().nth(200) {
        Some((cut, _)) => format!("{}... ({} bytes)", &json[..cut], json.len()),
        None => json,
    })
}

/// The plan's budgets: those given, the store's for the others, but with `--train` and no
/// `--pinned-budget` a Pinned tier of the host memory available (`host`) less what the trainer
/// keeps for the system and the process ([`strata::plan::host_reserve`]), as the trainer's plan
/// sizes it: the optimizer state then lands in the memory the trainer keeps it in.
fn budgets(a: &InspectArgs, host: Option<u64>) -> [u64; 4] {
    match (a.train, host) {
        (true, Some(h)) => a.budgets.array_with(h.saturating_sub(strata::plan::host_reserve(h))),
        _ => a.budgets.array(),
    }
}

/// Runs `strata inspect`.
pub fn run(a: InspectArgs) -> anyhow::Result<()> {
    let ckpt = strata::plan::read_headers(&a.path)?;
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
        budgets: budgets(&a, strata::host_memory_available()),
        optimizer: a.optimizer,
        train: a.train,
        fp32_grads: a.fp32_grads,
    };
    let plan = strata::plan::plan(&tensors, &cfg);
    out_raw!("{plan}")?;
    if !a.train && a.optimizer != OptimizerStep::None {
        out!("note: --optimizer {} counts only with --train", a.optimizer)?;
    }
    out!()?;
    let traffic = plan.traffic();
    let machine = match (&a.bench, a.machine) {
        (Some(path), _) => Machine::from_bench_json(path)?,
        (None, Some(preset)) => preset.machine(),
        (None, None) => {
            let mut m = Machine::unknown("this machine (measured now)");
            if traffic.h2d + traffic.d2h > 0 {
                m.measure_gpu_link();
            }
            if traffic.disk_read + traffic.disk_write > 0 {
                // The largest file: the disk figure is a read of up to 64 MiB of it.
                let largest =
                    ckpt.files.iter().max_by_key(|f| std::fs::metadata(f).map_or(0, |m| m.len()));
                if let Some(file) = largest {
                    m.measure_disk(file);
                }
            }
            m
        }
    };
    out!("on {}:", machine.name)?;
    out_raw!("{}", plan.predict(&machine))?;
    // The figures of the transfers there are, and where they come from (d2h falls back to
    // h2d's figure, disk_write to disk_read's, as the prediction takes them).
    let moved = [traffic.h2d, traffic.d2h, traffic.disk_read, traffic.disk_write];
    let used: Vec<&str> = ["h2d", "d2h", "disk_read", "disk_write"]
        .into_iter()
        .zip(moved)
        .filter(|&(_, bytes)| bytes > 0)
        .map(|(figure, _)| figure)
        .collect();
    for line in machine.describe(&used).lines() {
        out!("  {line}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Cmd};
    use clap::Parser;

    fn inspect(flags: &[&str]) -> InspectArgs {
        let argv = ["strata", "inspect", "m.safetensors"].iter().chain(flags);
        match Cli::try_parse_from(argv).unwrap().cmd {
            Cmd::Inspect(a) => a,
            _ => unreachable!("parsed as inspect"),
        }
    }

    /// `--train` plans the Pinned tier as the trainer does, from the host memory (64 GiB here,
    /// 8 of them kept back), unless a budget is given; forward plans keep the store's.
    #[test]
    fn a_training_plan_sizes_pinned_memory_as_the_trainer_does() {
        let gib = 1u64 << 30;
        let host = Some(64 * gib);
        assert_eq!(budgets(&inspect(&["--train"]), host), [gib, 56 * gib, 256 << 20, 64 * gib]);
        assert_eq!(budgets(&inspect(&["--train"]), None)[1], gib, "host memory unknown");
        assert_eq!(budgets(&inspect(&[]), host)[1], gib);
        let given = inspect(&["--train", "--pinned-budget", "2GiB"]);
        assert_eq!(budgets(&given, host)[1], 2 * gib);
    }
}
