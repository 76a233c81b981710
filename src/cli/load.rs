//! `strata load`: a checkpoint into a store, in place or copied into a tier.

use std::time::Instant;

use super::args::LoadArgs;
use super::inspect::{files_line, metadata_line};
use strata::{format_size, LoadOptions, Store, Tier};

/// Runs `strata load`.
pub fn run(a: LoadArgs) -> anyhow::Result<()> {
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
