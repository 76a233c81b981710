//! `strata inspect`: a checkpoint's tensors and a memory plan, without reading the data.

use super::args::InspectArgs;

use strata::plan::{Bandwidths, Optimizer, PlanConfig};

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

/// Runs `strata inspect`.
pub fn run(a: InspectArgs) -> anyhow::Result<()> {
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
