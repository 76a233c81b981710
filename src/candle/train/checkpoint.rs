//! Checkpoints that are whole or absent.
//!
//! A run directory holds one directory per checkpoint, `step-NNNNNNNN` (the steps done). A save
//! writes every file of a new checkpoint into a hidden directory beside them (`.tmp-…`), each
//! file flushed to disk, reads each back (its size, its crc32, and that every float in it is
//! finite), writes the **commit record** `checkpoint.json` last (the run's identity, the step,
//! the optimizer's step count, the training config, and every file with its size and crc32),
//! flushes the directory, and only then renames it into place: a checkpoint is visible whole
//! or not at all, and the one before stays as it was until then. The newest `keep` are kept.
//! A step saved again replaces its checkpoint with no window (`replace`: the old one renamed
//! aside, the new one into place, then the old one removed), and a save killed between two of
//! these leaves a whole checkpoint that [`Checkpoint::newest`] finds and the next save puts
//! back. The commit record holds the crc32 of the rest of it (`record_crc32`): the settings a
//! resume takes from it cannot be edited unseen.
//!
//! Opening a checkpoint ([`Checkpoint::open`]) reads its record and checks every file against
//! it before anything is used: a file missing, cut short, changed or of another save is a
//! [`TrainError::BadCheckpoint`] naming it. Every file also carries the save's identity (the
//! run and the step, in each safetensors file's `__metadata__`, in the indexes' `metadata`
//! and in `config.json`), checked when the tensors are loaded.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::{LlamaConfig, LoraConfig, LrSchedule, TrainConfig, TrainError, Trainer};
use crate::base::types::{DType, TensorId};
use crate::candle::lora::{is_adapter, peft_name, ADAPTER_CONFIG, ADAPTER_FILE};
use crate::compute::optim::{AdamW, Engine};
use crate::LoadOptions;

/// The commit record's name in a checkpoint directory.
pub(super) const RECORD: &str = "checkpoint.json";
/// The commit record's field holding the crc32 of the rest of it.
const RECORD_CRC: &str = "record_crc32";
const FORMAT: &str = "strata-train-checkpoint";
const VERSION: u64 = 1;
const MODEL_INDEX: &str = "model.safetensors.index.json";
const OPT_INDEX: &str = "optimizer.safetensors.index.json";
const CONFIG: &str = "config.json";
const STEP_PREFIX: &str = "step-";
/// The most bytes read of a commit record or a `config.json`.
const SMALL: u64 = 64 << 20;
/// Bytes read at a time when a file is checked.
const CHUNK: usize = 1 << 20;

/// One file of a checkpoint, as its commit record lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointFile {
    /// Its name in the checkpoint directory.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// The crc32 (IEEE, `crc32fast`) of its bytes.
    pub crc32: u32,
}

/// A checkpoint [`Trainer::save`] wrote, read from its commit record, every file of it checked
/// against the record ([`Checkpoint::open`]).
///
/// ```no_run
/// # fn main() -> candle_core::Result<()> {
/// use strata::candle::train::Checkpoint;
/// let ck = Checkpoint::open("runs/a")?;     // the run's newest checkpoint, verified
/// println!("{} at step {} of {}", ck.path.display(), ck.step, ck.train.schedule.total);
/// if ck.finished() {
///     println!("nothing to do");
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Checkpoint {
    /// The checkpoint's directory.
    pub path: PathBuf,
    /// The run's identity ([`Trainer::run_id`]).
    pub run: u64,
    /// Steps done, skipped ones included.
    pub step: u64,
    /// Updates the optimizer had made: `step - skipped`.
    pub optimizer_steps: u64,
    /// Steps skipped for a non-finite loss or gradient.
    pub skipped: u64,
    /// The model (its `config.json`, with its floats exactly as they were).
    pub config: LlamaConfig,
    /// How the run trains.
    pub train: TrainConfig,
    /// The parameters' dtype.
    pub dtype: DType,
    /// The frozen parameters' names.
    pub frozen: Vec<String>,
    /// Every file, as the commit record lists it.
    pub files: Vec<CheckpointFile>,
    /// The caller's notes on the run ([`Trainer::set_notes`]).
    pub notes: BTreeMap<String, String>,
    /// The kind of the model's blocks ([`Block::kind`](crate::candle::block::Block::kind)).
    pub block: String,
    /// A LoRA run's frozen base, which its checkpoints do not hold: the crc32 of its values
    /// (a resume checks the trainer's base against it).
    pub base_crc32: Option<u32>,
}

fn bad(path: &Path, why: impl Into<String>) -> candle_core::Error {
    TrainError::BadCheckpoint { path: path.to_path_buf(), why: why.into() }.into_candle()
}

fn io(path: &Path, e: std::io::Error) -> candle_core::Error {
    crate::Error::io(path, e).into()
}

impl Checkpoint {
    /// Opens `path`: a checkpoint directory (it has a commit record), or a run directory (its
    /// newest `step-*` checkpoint). Reads the commit record, checks every file it lists (a
    /// regular file, of the size and crc32 it says), then reads `config.json`. Anything
    /// missing, cut short, changed or not a file is a [`TrainError::BadCheckpoint`] naming the
    /// file.
    pub fn open(path: impl AsRef<Path>) -> candle_core::Result<Checkpoint> {
        let path = path.as_ref();
        let dir = checkpoint_dir(path)?;
        let ck = read_record(&dir)?;
        for f in &ck.files {
            let p = dir.join(&f.name);
            let (bytes, crc, _) = scan(&p, false)?;
            if bytes != f.bytes {
                return Err(bad(
                    &p,
                    format!(
                        "{bytes} bytes, the commit record says {}: cut short or replaced",
                        f.bytes
                    ),
                ));
            }
            if crc != f.crc32 {
                return Err(bad(
                    &p,
                    format!(
                        "its bytes are not the ones the save wrote (crc32 {crc:08x}, the commit \
                         record says {:08x}): changed or damaged since",
                        f.crc32
                    ),
                ));
            }
        }
        let mut ck = ck;
        let text = read_small(&dir.join(CONFIG))?;
        ck.config = LlamaConfig::from_json(&String::from_utf8_lossy(&text))?;
        let rec = record_value(&dir)?;
        let bits = |k: &str| rec["model_float_bits"][k].as_u64().map(f64::from_bits);
        match (bits("rms_norm_eps"), bits("rope_theta")) {
            (Some(eps), Some(theta)) => {
                ck.config.rms_norm_eps = eps;
                ck.config.rope_theta = theta;
            }
            _ => return Err(bad(&dir.join(RECORD), "no model_float_bits")),
        }
        Ok(ck)
    }

    /// The newest checkpoint (by step) in run directory `dir`; `None` when it has none.
    /// A whole checkpoint that a save killed while replacing it left hidden (`.tmp-…` or
    /// `.old-…`, the step having no `step-*` directory) counts as its step's; the next save
    /// puts it back in place.
    pub fn newest(dir: impl AsRef<Path>) -> candle_core::Result<Option<PathBuf>> {
        let dir = dir.as_ref();
        let mut all = list(dir)?;
        let stranded = stranded(dir, &all);
        all.extend(stranded);
        Ok(all.into_iter().max_by_key(|(s, _)| *s).map(|(_, p)| p))
    }

    /// How to start a new run from this checkpoint's weights, in the command line's words,
    /// naming paths that exist: a full run's `--model CK/model.safetensors.index.json`; a
    /// LoRA run's, which holds the adapters only, `--model BASE --adapter CK` (BASE the run's
    /// note `base_model`, where it has one).
    pub fn start_from(&self) -> String {
        match self.train.lora {
            None => format!("--model {}", self.path.join(MODEL_INDEX).display()),
            Some(_) => format!(
                "--model {} --adapter {}",
                self.notes.get("base_model").map_or("BASE (the run's base model)", String::as_str),
                self.path.display()
            ),
        }
    }

    /// Whether the run has done the steps it planned: its schedule has a horizon
    /// (`schedule.total` > 0) and the checkpoint is at it or past it.
    pub fn finished(&self) -> bool {
        self.train.schedule.total > 0 && self.step >= self.train.schedule.total
    }
}

/// The checkpoint `path` names: itself when it has a commit record (or is not a directory),
/// else its newest `step-*` checkpoint.
fn checkpoint_dir(path: &Path) -> candle_core::Result<PathBuf> {
    if path.join(RECORD).exists() || !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if let Some(p) = Checkpoint::newest(path)? {
        return Ok(p);
    }
    let holds_files = std::fs::read_dir(path)
        .map_err(|e| io(path, e))?
        .flatten()
        .any(|e| !e.file_name().to_string_lossy().starts_with('.'));
    Err(if holds_files {
        bad(
            &path.join(RECORD),
            "missing: no commit record, so no whole checkpoint (a save cut short, or one written \
             by an older strata): it cannot be trusted",
        )
    } else {
        bad(path, format!("no checkpoint in it (no {RECORD}, no {STEP_PREFIX}* checkpoint)"))
    })
}

/// The `step-*` checkpoints of run directory `dir`, unordered.
pub(super) fn list(dir: &Path) -> candle_core::Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io(dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| io(dir, e))?;
        let name = entry.file_name();
        let Some(step) = name.to_str().and_then(|n| n.strip_prefix(STEP_PREFIX)) else {
            continue;
        };
        if let (Ok(step), true) = (step.parse::<u64>(), entry.path().is_dir()) {
            out.push((step, entry.path()));
        }
    }
    Ok(out)
}

/// A small regular file (a record, a config), refused past [`SMALL`] bytes.
fn read_small(path: &Path) -> candle_core::Result<Vec<u8>> {
    let md = crate::tiers::file::check_regular(path).map_err(|e| bad(path, e.chain()))?;
    if md.len() > SMALL {
        return Err(bad(path, format!("{} bytes: not a checkpoint's", md.len())));
    }
    crate::tiers::file::read_regular(path).map_err(|e| bad(path, e.chain()))
}

fn record_value(dir: &Path) -> candle_core::Result<serde_json::Value> {
    let p = dir.join(RECORD);
    let mut v: serde_json::Value =
        serde_json::from_slice(&read_small(&p)?).map_err(|e| bad(&p, format!("not JSON ({e})")))?;
    // The record covers itself: an edit of the settings a resume takes from it (seq, the
    // schedule, the data's notes) is found, not trained on.
    match v.as_object_mut().and_then(|m| m.remove(RECORD_CRC)) {
        Some(c) => {
            let saved = c.as_str().and_then(|c| u32::from_str_radix(c, 16).ok());
            let now = record_crc(&v);
            if saved != Some(now) {
                return Err(bad(
                    &p,
                    format!(
                        "its {RECORD_CRC} is {c}, its text's is {now:08x}: edited or damaged \
                         since the save (a resume takes the run's settings from it, so it must \
                         be as written)"
                    ),
                ));
            }
        }
        None => tracing::warn!(
            record = %p.display(),
            "a commit record without {RECORD_CRC} (written by an older strata): its settings \
             are not checked"
        ),
    }
    Ok(v)
}

/// The crc32 of a commit record's JSON without its own crc (keys in order: serde_json's map is
/// sorted).
fn record_crc(v: &serde_json::Value) -> u32 {
    crc32fast::hash(v.to_string().as_bytes())
}

/// The commit record of checkpoint directory `dir` (its config a placeholder until the files
/// are checked).
fn read_record(dir: &Path) -> candle_core::Result<Checkpoint> {
    let p = dir.join(RECORD);
    let v = record_value(dir)?;
    let miss = |k: &str| bad(&p, format!("no {k} (not a commit record strata wrote)"));
    if v["format"].as_str() != Some(FORMAT) || v["version"].as_u64() != Some(VERSION) {
        return Err(bad(&p, format!("not a commit record of format {FORMAT} version {VERSION}")));
    }
    let u = |k: &str| v[k].as_u64().ok_or_else(|| miss(k));
    let run = v["run"]
        .as_str()
        .and_then(|r| u64::from_str_radix(r, 16).ok())
        .ok_or_else(|| miss("run"))?;
    let dtype = match v["dtype"].as_str() {
        Some("f32") => DType::F32,
        Some("bf16") => DType::BF16,
        _ => return Err(miss("dtype (f32 or bf16)")),
    };
    let frozen = strings(&v["frozen"]).ok_or_else(|| miss("frozen"))?;
    let train = train_from(&v["train"]).ok_or_else(|| miss("train (a whole training config)"))?;
    let mut files = Vec::new();
    for f in v["files"].as_array().ok_or_else(|| miss("files"))? {
        let name = f["name"].as_str().ok_or_else(|| miss("files[].name"))?;
        if name.is_empty() || name.contains('/') || name.starts_with('.') || name == RECORD {
            return Err(bad(&p, format!("lists {name:?}, which is not a file of the checkpoint")));
        }
        let bytes = f["bytes"].as_u64().ok_or_else(|| miss("files[].bytes"))?;
        let crc32 = f["crc32"]
            .as_str()
            .and_then(|c| u32::from_str_radix(c, 16).ok())
            .ok_or_else(|| miss("files[].crc32"))?;
        files.push(CheckpointFile { name: name.to_string(), bytes, crc32 });
    }
    let lora = train.lora.is_some();
    for required in [CONFIG, if lora { ADAPTER_FILE } else { MODEL_INDEX }] {
        if !files.iter().any(|f| f.name == required) {
            return Err(bad(&p, format!("does not list {required}")));
        }
    }
    let base_crc32 = match lora {
        false => None,
        true => Some(
            v["base_crc32"]
                .as_str()
                .and_then(|c| u32::from_str_radix(c, 16).ok())
                .ok_or_else(|| miss("base_crc32 (a LoRA run's base)"))?,
        ),
    };
    // Records from before blocks of one's own were Llama's.
    let block = v["block"].as_str().unwrap_or("llama").to_string();
    let mut notes = BTreeMap::new();
    for (k, n) in v["notes"].as_object().ok_or_else(|| miss("notes"))? {
        notes.insert(k.clone(), n.as_str().ok_or_else(|| miss("notes (strings)"))?.to_string());
    }
    let (step, optimizer_steps, skipped) = (u("step")?, u("optimizer_steps")?, u("skipped")?);
    if optimizer_steps.checked_add(skipped) != Some(step) {
        return Err(bad(
            &p,
            format!(
                "{optimizer_steps} optimizer steps and {skipped} skipped do not make its {step} \
                 steps"
            ),
        ));
    }
    Ok(Checkpoint {
        path: dir.to_path_buf(),
        run,
        step,
        optimizer_steps,
        skipped,
        config: placeholder_config(),
        train,
        dtype,
        frozen,
        files,
        notes,
        block,
        base_crc32,
    })
}

fn placeholder_config() -> LlamaConfig {
    LlamaConfig {
        hidden_size: 0,
        intermediate_size: 0,
        num_hidden_layers: 0,
        num_attention_heads: 0,
        num_key_value_heads: 0,
        head_dim: 0,
        vocab_size: 0,
        rms_norm_eps: 0.0,
        rope_theta: 0.0,
        rope_scaling: None,
        max_position_embeddings: 0,
        tie_word_embeddings: false,
        qkv_bias: false,
        sliding_window: None,
        dtype: None,
    }
}

fn strings(v: &serde_json::Value) -> Option<Vec<String>> {
    v.as_array()?.iter().map(|s| s.as_str().map(str::to_string)).collect()
}

/// A float as the record keeps it: Rust's shortest representation that reads back exactly.
fn float(x: f64) -> String {
    x.to_string()
}

fn train_json(t: &TrainConfig) -> serde_json::Value {
    let (s, a) = (&t.schedule, &t.adamw);
    serde_json::json!({
        "micro_batch": t.micro_batch, "seq": t.seq, "accum": t.accum,
        "lr_peak": float(s.peak), "lr_min": float(s.min), "lr_warmup": s.warmup,
        "lr_total": s.total,
        "lr": float(a.lr), "beta1": float(a.beta1), "beta2": float(a.beta2), "eps": float(a.eps),
        "weight_decay": float(a.weight_decay),
        "clip": t.clip.map(float),
        "engine": t.engine.name(), "optimizer_threads": t.optimizer_threads,
        "speculation_bytes": t.speculation_bytes,
        "frozen": t.frozen, "skip_nonfinite": t.skip_nonfinite,
        "lora": t.lora.as_ref().map(|l| serde_json::json!({
            "rank": l.rank, "alpha": float(l.alpha), "targets": l.targets, "rslora": l.rslora,
            "seed": l.seed,
        })),
    })
}

fn lora_from(v: &serde_json::Value) -> Option<Option<LoraConfig>> {
    if v.is_null() {
        return Some(None);
    }
    Some(Some(LoraConfig {
        rank: usize::try_from(v["rank"].as_u64()?).ok()?,
        alpha: v["alpha"].as_str()?.parse().ok()?,
        targets: strings(&v["targets"])?,
        rslora: v["rslora"].as_bool()?,
        seed: v["seed"].as_u64()?,
    }))
}

fn train_from(v: &serde_json::Value) -> Option<TrainConfig> {
    let n = |k: &str| v[k].as_u64();
    let us = |k: &str| n(k).and_then(|x| usize::try_from(x).ok());
    let f = |k: &str| v[k].as_str()?.parse::<f64>().ok();
    let peak = f("lr_peak")?;
    Some(TrainConfig {
        micro_batch: us("micro_batch")?,
        seq: us("seq")?,
        accum: us("accum")?,
        adamw: AdamW {
            lr: f("lr")?,
            beta1: f("beta1")?,
            beta2: f("beta2")?,
            eps: f("eps")?,
            weight_decay: f("weight_decay")?,
        },
        schedule: LrSchedule {
            peak,
            min: f("lr_min")?,
            warmup: n("lr_warmup")?,
            total: n("lr_total")?,
        },
        clip: if v["clip"].is_null() { None } else { Some(f("clip")?) },
        engine: v["engine"].as_str()?.parse::<Engine>().ok()?,
        optimizer_threads: us("optimizer_threads")?,
        // Records from before speculative updates have none: the default.
        speculation_bytes: n("speculation_bytes")
            .unwrap_or(TrainConfig::default().speculation_bytes),
        frozen: strings(&v["frozen"])?,
        skip_nonfinite: v["skip_nonfinite"].as_bool()?,
        lora: lora_from(&v["lora"])?,
    })
}

/// What [`scan`] found: the size, the crc32, and the first tensor holding a value that is not
/// finite, with that value.
type Scanned = (u64, u32, Option<(String, f64)>);

/// Reads the regular file at `path` once: its size, its crc32 and, when `floats`, the first
/// tensor of a safetensors file (in offset order) holding a value that is not finite.
fn scan(path: &Path, floats: bool) -> candle_core::Result<Scanned> {
    let file = crate::tiers::file::open_regular(path, 0).map_err(|e| bad(path, e.chain()))?;
    let size = file.metadata().map_err(|e| io(path, e))?.len();
    // Never more than the size it had when it was looked at.
    let mut r = Hashing { inner: file.take(size), crc: crc32fast::Hasher::new(), read: 0 };
    let mut first_bad = None;
    let mut buf = vec![0u8; CHUNK];
    if floats {
        let mut len = [0u8; 8];
        r.exact(&mut len).map_err(|e| io(path, e))?;
        let n = u64::from_le_bytes(len);
        if n > SMALL || n > size - 8 {
            return Err(bad(path, format!("a safetensors header of {n} bytes")));
        }
        let mut header = vec![0u8; n as usize];
        r.exact(&mut header).map_err(|e| io(path, e))?;
        let h: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| bad(path, format!("its header: {e}")))?;
        let mut tensors: Vec<(u64, u64, &str, &str)> = Vec::new();
        for (name, t) in &h {
            if name == "__metadata__" {
                continue;
            }
            let off = |i: usize| t["data_offsets"][i].as_u64();
            let (Some(a), Some(b), Some(d)) = (off(0), off(1), t["dtype"].as_str()) else {
                return Err(bad(path, format!("tensor {name}: no dtype or offsets")));
            };
            tensors.push((a, b, d, name));
        }
        tensors.sort();
        let mut at = 0u64;
        for (a, b, dtype, name) in tensors {
            if a < at || b < a {
                return Err(bad(path, format!("tensor {name}: offsets overlap")));
            }
            skip(&mut r, a - at, &mut buf).map_err(|e| io(path, e))?;
            let elem = match dtype {
                "F32" => 4,
                "BF16" | "F16" => 2,
                _ => 0,
            };
            let mut left = b - a;
            // Whole elements at a time.
            let step = if elem == 0 { CHUNK } else { CHUNK - CHUNK % elem };
            while left > 0 {
                let k = (left as usize).min(step);
                r.exact(&mut buf[..k]).map_err(|e| io(path, e))?;
                if first_bad.is_none() {
                    if let Some(v) = non_finite(dtype, &buf[..k]) {
                        first_bad = Some((name.to_string(), v));
                    }
                }
                left -= k as u64;
            }
            at = b;
        }
    }
    loop {
        let k = r.inner.read(&mut buf).map_err(|e| io(path, e))?;
        if k == 0 {
            break;
        }
        r.crc.update(&buf[..k]);
        r.read += k as u64;
    }
    if r.read != size {
        return Err(bad(path, format!("{} bytes read of {size}: it changed while read", r.read)));
    }
    Ok((size, r.crc.finalize(), first_bad))
}

/// The first value of `bytes` (little-endian `dtype` elements) that is not finite.
fn non_finite(dtype: &str, bytes: &[u8]) -> Option<f64> {
    match dtype {
        "F32" => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .find(|x| !x.is_finite())
            .map(f64::from),
        "BF16" => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
            .find(|x| !x.is_finite())
            .map(f64::from),
        "F16" => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
            .find(|x| !x.is_finite())
            .map(f64::from),
        _ => None,
    }
}

/// A reader that hashes what it reads.
struct Hashing<R> {
    inner: R,
    crc: crc32fast::Hasher,
    read: u64,
}

impl<R: Read> Hashing<R> {
    fn exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        self.inner.read_exact(buf)?;
        self.crc.update(buf);
        self.read += buf.len() as u64;
        Ok(())
    }
}

fn skip<R: Read>(r: &mut Hashing<R>, mut n: u64, buf: &mut [u8]) -> std::io::Result<()> {
    while n > 0 {
        let k = (n as usize).min(buf.len());
        r.exact(&mut buf[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Hidden directories this process is writing now (not stale, whatever their name says).
static WRITING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Whether process `pid` is alive.
pub(super) fn alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// A hidden directory a save makes in a run directory, by its name's prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hidden {
    /// `.tmp-PID-NONCE-step-N`: a checkpoint being written; whole once its commit record is
    /// there (written last), before it is renamed into place.
    Tmp,
    /// `.old-PID-NONCE-step-N`: a whole checkpoint of step N moved aside while that step is
    /// saved again, removed once the new one is in place.
    Old,
    /// `.trash-PID-NONCE-NAME`: a checkpoint being removed.
    Trash,
}

/// What a hidden entry's name says: its kind, the process that made it, and the step (of a
/// `.tmp-` or `.old-` one).
fn hidden(name: &str) -> Option<(Hidden, u32, Option<u64>)> {
    let (kind, rest) = [(Hidden::Tmp, ".tmp-"), (Hidden::Old, ".old-"), (Hidden::Trash, ".trash-")]
        .into_iter()
        .find_map(|(k, prefix)| Some((k, name.strip_prefix(prefix)?)))?;
    let mut parts = rest.splitn(3, '-');
    let pid = parts.next()?.parse::<u32>().ok()?;
    let _nonce = parts.next()?;
    let step = parts
        .next()
        .and_then(|n| n.strip_prefix(STEP_PREFIX))
        .and_then(|n| n.parse::<u64>().ok())
        .filter(|_| kind != Hidden::Trash);
    Some((kind, pid, step))
}

/// Whether the hidden entry `path` of process `pid` is left by a save that no longer runs: its
/// process is gone, or is this one and not writing it (a restarted container's process may get
/// its old pid).
fn stale(path: &Path, pid: u32) -> bool {
    let writing = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    (!alive(pid) || pid == std::process::id()) && !writing.iter().any(|p| p == path)
}

/// Whole checkpoints a killed save left hidden in `dir`, for steps that have no `step-*`
/// directory: a `.tmp-` one written whole (killed before or while the old one of its step was
/// moved aside), else the `.old-` one moved aside. Each is checked file by file first.
fn stranded(dir: &Path, have: &[(u64, PathBuf)]) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found: Vec<(u64, Hidden, PathBuf)> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((kind, pid, Some(step))) = name.to_str().and_then(hidden) else { continue };
        let path = entry.path();
        if kind == Hidden::Trash || have.iter().any(|(s, _)| *s == step) || !stale(&path, pid) {
            continue;
        }
        if path.join(RECORD).is_file() && Checkpoint::open(&path).is_ok() {
            found.push((step, kind, path));
        }
    }
    // The new one (`.tmp-`) before the one it replaces (`.old-`).
    found.sort_by_key(|(s, k, _)| (*s, *k != Hidden::Tmp));
    found.dedup_by_key(|(s, ..)| *s);
    found.into_iter().map(|(s, _, p)| (s, p)).collect()
}

/// Puts back what a killed save left hidden ([`stranded`]) under its step's name, then removes
/// what dead saves left: `.tmp-` (cut short, or not needed), `.old-` (replaced) and `.trash-`
/// directories. A failure leaves an entry for the next save to look at again.
fn recover_and_clean(dir: &Path) {
    let have = list(dir).unwrap_or_default();
    for (step, p) in stranded(dir, &have) {
        let dest = dir.join(format!("{STEP_PREFIX}{step:08}"));
        match std::fs::rename(&p, &dest) {
            Ok(()) => tracing::warn!(
                checkpoint = %dest.display(),
                from = %p.display(),
                "a whole checkpoint a killed save left hidden is put back in place"
            ),
            Err(e) => tracing::warn!(checkpoint = %p.display(), error = %e, "not put back"),
        }
    }
    let _ = sync_dir(dir);
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((_, pid, _)) = name.to_str().and_then(hidden) else { continue };
        let path = entry.path();
        if stale(&path, pid) {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

fn nonce() -> u64 {
    super::new_run_id()
}

/// Moves checkpoint `p` out of sight (one rename), then removes it.
fn discard(dir: &Path, p: &Path) -> candle_core::Result<()> {
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("checkpoint");
    let trash = dir.join(format!(".trash-{}-{:016x}-{name}", std::process::id(), nonce()));
    std::fs::rename(p, &trash).map_err(|e| io(p, e))?;
    let _ = std::fs::remove_dir_all(&trash);
    Ok(())
}

/// Flushes directory `dir`'s entries to disk.
pub(super) fn sync_dir(dir: &Path) -> candle_core::Result<()> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io(dir, e))
}

fn write_synced(path: &Path, bytes: &[u8]) -> candle_core::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| io(path, e))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(|e| io(path, e))
}

/// The run of the checkpoint in `dir`, from its commit record.
pub(super) fn run_of(dir: &Path) -> Option<u64> {
    let v = record_value(dir).ok()?;
    u64::from_str_radix(v["run"].as_str()?, 16).ok()
}

/// [`Trainer::save_keeping`]: the trainer's updates are done.
pub(super) fn save(tr: &Trainer, dir: &Path, keep: usize) -> candle_core::Result<PathBuf> {
    if keep == 0 {
        return Err(super::invalid(
            "keep 0: a save keeps at least the checkpoint it writes".into(),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let existing = list(dir)?;
    for (step, p) in &existing {
        if let Some(run) = run_of(p) {
            if run != tr.run {
                return Err(TrainError::Mismatch {
                    path: p.clone(),
                    what: format!("run (step {step})"),
                    saved: format!("{run:016x}"),
                    here: format!("{:016x}", tr.run),
                    hint: "a run directory holds one run's checkpoints: save elsewhere, or \
                           resume that run from it"
                        .into(),
                }
                .into_candle());
            }
        }
    }
    recover_and_clean(dir);
    let name = format!("{STEP_PREFIX}{:08}", tr.step);
    let tmp = dir.join(format!(".tmp-{}-{:016x}-{name}", std::process::id(), nonce()));
    WRITING.lock().unwrap_or_else(|e| e.into_inner()).push(tmp.clone());
    let written = write_checkpoint(tr, &tmp);
    let dest = dir.join(&name);
    let placed = written.and_then(|()| replace(dir, &tmp, &dest));
    WRITING.lock().unwrap_or_else(|e| e.into_inner()).retain(|p| *p != tmp);
    if let Err(e) = placed {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // The newest `keep` up to this step stay; later steps (of a history this run went back
    // from) and older ones go. A failure here leaves one more checkpoint, not a broken one.
    let mut mine: Vec<(u64, PathBuf)> =
        list(dir)?.into_iter().filter(|(_, p)| run_of(p) == Some(tr.run)).collect();
    mine.sort_by_key(|(s, _)| std::cmp::Reverse(*s));
    let mut kept = 0;
    for (step, p) in mine {
        if step <= tr.step && kept < keep {
            kept += 1;
        } else if let Err(e) = discard(dir, &p) {
            tracing::warn!(checkpoint = %p.display(), error = %e, "an old checkpoint stays");
        }
    }
    Ok(dest)
}

/// Puts the whole checkpoint `tmp` in place as `dest` with no moment where neither the old
/// `dest` nor the new one is whole under a name a resume finds: the old one is renamed aside
/// (`.old-…`), the new one renamed into place, the directory flushed, then the old one removed.
/// A kill between two of these leaves the old one in place (a `.tmp-` whole beside it), or
/// both hidden, or the new one in place (an `.old-` beside it): [`Checkpoint::newest`] and the
/// next save find the newest whole one ([`stranded`]). A failure puts the old one back.
fn replace(dir: &Path, tmp: &Path, dest: &Path) -> candle_core::Result<()> {
    use crate::base::failpoint::{check, Site};
    let name = dest.file_name().and_then(|n| n.to_str()).unwrap_or("checkpoint");
    let aside = match dest.exists() {
        false => None,
        true => {
            // The same step saved before (by this run: checked by the caller).
            let old = dir.join(format!(".old-{}-{:016x}-{name}", std::process::id(), nonce()));
            check(Site::SaveRename, dest)?;
            std::fs::rename(dest, &old).map_err(|e| io(dest, e))?;
            Some(old)
        }
    };
    let put_back = |e: candle_core::Error| {
        if let Some(old) = &aside {
            if let Err(r) = std::fs::rename(old, dest) {
                tracing::warn!(checkpoint = %old.display(), error = %r, "not put back");
            }
        }
        e
    };
    check(Site::SaveRename, tmp).map_err(|e| put_back(e.into()))?;
    std::fs::rename(tmp, dest).map_err(|e| put_back(io(dest, e)))?;
    if let Err(e) = sync_dir(dir) {
        // Not known to be durable: the new one goes back to where it was written.
        return match std::fs::rename(dest, tmp) {
            Ok(()) => Err(put_back(e)),
            Err(_) => Err(e),
        };
    }
    if let Some(old) = aside {
        let removed = check(Site::SaveRename, &old)
            .map_err(candle_core::Error::from)
            .and_then(|()| std::fs::remove_dir_all(&old).map_err(|e| io(&old, e)));
        if let Err(e) = removed {
            // The new one is in place; the next save removes this.
            tracing::warn!(checkpoint = %old.display(), error = %e, "a replaced checkpoint stays");
        }
    }
    Ok(())
}

/// Every file of the trainer's checkpoint in the new directory `tmp`, each flushed and read
/// back, the commit record last; the directory flushed.
fn write_checkpoint(tr: &Trainer, tmp: &Path) -> candle_core::Result<()> {
    std::fs::create_dir(tmp).map_err(|e| io(tmp, e))?;
    let meta = metadata(tr);
    let stages = tr.config.num_hidden_layers + 2;
    let mut model_map = serde_json::Map::new();
    let mut opt_map = serde_json::Map::new();
    let mut names = Vec::new();
    let lora = tr.train.lora.is_some();
    if lora {
        // The adapters in PEFT's format (PeftModel.from_pretrained loads the checkpoint); the
        // frozen base does not change and is not written (the record names it by its crc32).
        tr.write_adapter(tmp, &meta)?;
        names.push(ADAPTER_FILE.into());
        names.push(ADAPTER_CONFIG.into());
    }
    for stage in 0..stages {
        let mine: Vec<&super::Param> = tr.params.iter().filter(|p| p.stage == stage).collect();
        if !lora {
            let file = format!("model-{:05}-of-{stages:05}.safetensors", stage + 1);
            let tensors: Vec<(TensorId, String)> =
                mine.iter().map(|p| (p.id, p.name.clone())).collect();
            tr.store.save_safetensors_with(tmp.join(&file), &tensors, &meta)?;
            for p in &mine {
                model_map.insert(p.name.clone(), file.clone().into());
            }
            names.push(file);
        }
        let mut state = Vec::new();
        for p in mine.iter().filter(|p| p.trainable) {
            for suffix in ["master", "exp_avg", "exp_avg_sq"] {
                let name = format!("{}.{suffix}", p.name);
                if let Some(id) = tr.store.lookup(&name) {
                    state.push((id, name));
                }
            }
        }
        if !state.is_empty() {
            let file = format!("optimizer-{:05}-of-{stages:05}.safetensors", stage + 1);
            tr.store.save_safetensors_with(tmp.join(&file), &state, &meta)?;
            for (_, name) in state {
                opt_map.insert(name, file.clone().into());
            }
            names.push(file);
        }
    }
    let mut config: serde_json::Value = serde_json::from_str(&tr.config.to_json())
        .map_err(|e| candle_core::Error::Msg(format!("the model's config: {e}")))?;
    config["strata_checkpoint"] = serde_json::json!({ "run": meta["strata_run"], "step": tr.step });
    write_synced(&tmp.join(CONFIG), config.to_string().as_bytes())?;
    names.push(CONFIG.into());
    for (index, map) in [(MODEL_INDEX, model_map), (OPT_INDEX, opt_map)] {
        if map.is_empty() {
            continue;
        }
        let json = serde_json::json!({ "metadata": meta, "weight_map": map });
        write_synced(&tmp.join(index), json.to_string().as_bytes())?;
        names.push(index.into());
    }
    // Each file read back: what the record lists is what is on disk, and no value of a
    // diverged run is kept.
    let mut files = Vec::new();
    for name in names {
        let p = tmp.join(&name);
        let (bytes, crc32, non_finite) = scan(&p, name.ends_with(".safetensors"))?;
        if let Some((tensor, value)) = non_finite {
            return Err(TrainError::NonFinite {
                step: tr.step,
                what: format!("{tensor} (in the state a save would write)"),
                value,
            }
            .into_candle());
        }
        files.push(serde_json::json!({
            "name": name, "bytes": bytes, "crc32": format!("{crc32:08x}"),
        }));
    }
    let frozen: Vec<&str> =
        tr.params.iter().filter(|p| !p.trainable).map(|p| p.name.as_str()).collect();
    let mut record = serde_json::json!({
        "format": FORMAT,
        "version": VERSION,
        "run": meta["strata_run"],
        "step": tr.step,
        "optimizer_steps": optimizer_steps(tr),
        "skipped": tr.skipped,
        "dtype": if tr.dtype == candle_core::DType::BF16 { "bf16" } else { "f32" },
        "model_float_bits": {
            "rms_norm_eps": tr.config.rms_norm_eps.to_bits(),
            "rope_theta": tr.config.rope_theta.to_bits(),
        },
        "train": train_json(&tr.train),
        "frozen": frozen,
        "notes": tr.notes,
        "files": files,
        "block": tr.block.kind(),
    });
    if let Some(c) = tr.base_crc.filter(|_| lora) {
        record["base_crc32"] = format!("{c:08x}").into();
    }
    record[RECORD_CRC] = format!("{:08x}", record_crc(&record)).into();
    write_synced(
        &tmp.join(RECORD),
        serde_json::to_string_pretty(&record).unwrap_or_default().as_bytes(),
    )?;
    sync_dir(tmp)
}

/// The optimizer's updates so far (those of a run with nothing to train: the steps not
/// skipped, as if it had one).
fn optimizer_steps(tr: &Trainer) -> u64 {
    tr.opt.as_ref().map_or(tr.step - tr.skipped, |o| o.steps())
}

/// Every file's `__metadata__` (and the indexes' `metadata`): the save's identity, the step,
/// the optimizer's step count and the schedule.
fn metadata(tr: &Trainer) -> BTreeMap<String, String> {
    let s = &tr.train.schedule;
    BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("strata_run".to_string(), format!("{:016x}", tr.run)),
        ("strata_step".to_string(), tr.step.to_string()),
        ("step".to_string(), tr.step.to_string()),
        ("optimizer_steps".to_string(), optimizer_steps(tr).to_string()),
        ("skipped".to_string(), tr.skipped.to_string()),
        ("lr_peak".to_string(), float(s.peak)),
        ("lr_min".to_string(), float(s.min)),
        ("lr_warmup".to_string(), s.warmup.to_string()),
        ("lr_total".to_string(), s.total.to_string()),
    ])
}

/// Refuses checkpoint `ck` for a trainer of another run shape: another model, dtype, frozen
/// set, batch, optimizer or schedule (the engine and its threads may differ: they change no
/// bit of the result).
fn check_compatible(tr: &Trainer, ck: &Checkpoint) -> candle_core::Result<()> {
    let mismatch = |what: &str, saved: String, here: String, hint: &str| {
        Err(TrainError::Mismatch {
            path: ck.path.clone(),
            what: what.to_string(),
            saved,
            here,
            hint: hint.to_string(),
        }
        .into_candle())
    };
    let fresh = format!(
        "resume with the run's own settings (--resume reads them from the checkpoint), or \
         start a new run from its weights ({})",
        ck.start_from()
    );
    let fresh = fresh.as_str();
    if ck.config != tr.config {
        let (a, b): (serde_json::Value, serde_json::Value) = (
            serde_json::from_str(&ck.config.to_json()).unwrap_or_default(),
            serde_json::from_str(&tr.config.to_json()).unwrap_or_default(),
        );
        let key = a
            .as_object()
            .and_then(|m| {
                m.iter().find(|(k, v)| b.get(k.as_str()) != Some(*v)).map(|(k, _)| k.clone())
            })
            .unwrap_or_else(|| "float".into());
        let (sa, sb) = if key == "float" {
            (
                format!(
                    "rms_norm_eps {:e}, rope_theta {:e}",
                    ck.config.rms_norm_eps, ck.config.rope_theta
                ),
                format!(
                    "rms_norm_eps {:e}, rope_theta {:e}",
                    tr.config.rms_norm_eps, tr.config.rope_theta
                ),
            )
        } else {
            (a[&key].to_string(), b[&key].to_string())
        };
        return mismatch(
            &format!("model ({key})"),
            sa,
            sb,
            "the checkpoint is of another architecture",
        );
    }
    if ck.block != tr.block.kind() {
        return mismatch(
            "blocks",
            ck.block.clone(),
            tr.block.kind(),
            "the checkpoint is of another architecture",
        );
    }
    let dtype = if tr.dtype == candle_core::DType::BF16 { DType::BF16 } else { DType::F32 };
    if ck.dtype != dtype {
        return mismatch("dtype", ck.dtype.to_string(), dtype.to_string(), fresh);
    }
    let show_lora = |l: &Option<LoraConfig>| match l {
        None => "none".to_string(),
        Some(l) => format!(
            "rank {}, alpha {}, targets {}, rslora {}",
            l.rank,
            l.alpha,
            l.targets.join(","),
            l.rslora
        ),
    };
    let (saved_lora, lora) = (show_lora(&ck.train.lora), show_lora(&tr.train.lora));
    if saved_lora != lora {
        return mismatch("LoRA adapters", saved_lora, lora, fresh);
    }
    let mut frozen: Vec<String> =
        tr.params.iter().filter(|p| !p.trainable).map(|p| p.name.clone()).collect();
    let mut saved = ck.frozen.clone();
    frozen.sort();
    saved.sort();
    if saved != frozen {
        let show = |v: &[String]| if v.is_empty() { "none".to_string() } else { v.join(", ") };
        return mismatch("frozen parameters", show(&saved), show(&frozen), fresh);
    }
    let (a, b) = (&ck.train, &tr.train);
    let horizon = format!(
        "a run goes on to the horizon it planned (--steps): to train further, start a new run \
         from the checkpoint's weights ({})",
        ck.start_from()
    );
    let horizon = horizon.as_str();
    let fields: [(&str, String, String, &str); 11] = [
        ("micro_batch", a.micro_batch.to_string(), b.micro_batch.to_string(), fresh),
        ("seq", a.seq.to_string(), b.seq.to_string(), fresh),
        ("accum", a.accum.to_string(), b.accum.to_string(), fresh),
        (
            "schedule's horizon (schedule.total)",
            a.schedule.total.to_string(),
            b.schedule.total.to_string(),
            horizon,
        ),
        ("schedule's peak learning rate", float(a.schedule.peak), float(b.schedule.peak), fresh),
        ("schedule's minimum learning rate", float(a.schedule.min), float(b.schedule.min), fresh),
        ("schedule's warmup", a.schedule.warmup.to_string(), b.schedule.warmup.to_string(), fresh),
        (
            "AdamW betas",
            format!("{}, {}", a.adamw.beta1, a.adamw.beta2),
            format!("{}, {}", b.adamw.beta1, b.adamw.beta2),
            fresh,
        ),
        ("AdamW eps", float(a.adamw.eps), float(b.adamw.eps), fresh),
        ("weight decay", float(a.adamw.weight_decay), float(b.adamw.weight_decay), fresh),
        ("gradient clipping", format!("{:?}", a.clip), format!("{:?}", b.clip), fresh),
    ];
    for (what, saved, here, hint) in fields {
        if saved != here {
            return mismatch(what, saved, here, hint);
        }
    }
    if let (Some(saved), Some(here)) = (ck.base_crc32, tr.base_crc) {
        if saved != here {
            return mismatch(
                "frozen base (crc32 of its values)",
                format!("{saved:08x}"),
                format!("{here:08x}"),
                "a LoRA checkpoint holds the adapters only: resume it over the base it was \
                 trained on (the run's --model, or its --init random --seed)",
            );
        }
    }
    Ok(())
}

/// [`Trainer::resume`]: the trainer's updates are done.
pub(super) fn resume(tr: &mut Trainer, path: &Path) -> candle_core::Result<()> {
    let ck = Checkpoint::open(path)?;
    if tr.train.lora.is_some() {
        tr.base_crc()?;
    }
    check_compatible(tr, &ck)?;
    let opts = LoadOptions { name_prefix: "resume/".into(), ..LoadOptions::default() };
    let mut loaded = Vec::new();
    let mut r = Ok(());
    for f in [MODEL_INDEX, OPT_INDEX, ADAPTER_FILE] {
        if r.is_ok() && ck.files.iter().any(|x| x.name == f) {
            match tr.store.load_checkpoint(ck.path.join(f), opts.clone()) {
                Ok(l) => loaded.push(l),
                Err(e) => r = Err(candle_core::Error::from(e)),
            }
        }
    }
    let r = r.and_then(|()| copy_state(tr, &ck, &loaded));
    for l in &loaded {
        for t in l.iter() {
            let _ = tr.store.remove(t.id);
        }
    }
    r?;
    if let Some(o) = tr.opt.as_mut() {
        o.set_steps(ck.optimizer_steps).map_err(candle_core::Error::from)?;
    }
    tr.step = ck.step;
    tr.skipped = ck.skipped;
    tr.run = ck.run;
    tr.notes = ck.notes;
    tr.torn = None;
    Ok(())
}

/// Checks every loaded file's identity and every tensor the trainer needs, then (only then)
/// writes them into the trainer's tensors.
fn copy_state(
    tr: &mut Trainer,
    ck: &Checkpoint,
    loaded: &[crate::Loaded],
) -> candle_core::Result<()> {
    let run = format!("{:016x}", ck.run);
    for l in loaded {
        for f in l.files() {
            let name = f.path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if !ck.files.iter().any(|x| x.name == name) {
                return Err(bad(&f.path, "not listed in the commit record"));
            }
            let (r, s) = (f.metadata.get("strata_run"), f.metadata.get("strata_step"));
            if r != Some(&run) || s.map(String::as_str) != Some(ck.step.to_string().as_str()) {
                return Err(bad(
                    &f.path,
                    format!(
                        "of run {} step {}, the checkpoint's is run {run} step {}: a file of \
                         another save",
                        r.map_or("(none)", String::as_str),
                        s.map_or("(none)", String::as_str),
                        ck.step
                    ),
                ));
            }
        }
    }
    let find = |name: &str| {
        let peft = peft_name(name);
        loaded.iter().find_map(|l| l.get(name).or_else(|| l.get(&peft)))
    };
    // A LoRA checkpoint holds the adapters, not the frozen base.
    let lora = tr.train.lora.is_some();
    let mut targets: Vec<(String, TensorId)> = tr
        .params
        .iter()
        .filter(|p| !lora || is_adapter(&p.name))
        .map(|p| (p.name.clone(), p.id))
        .collect();
    for p in tr.params.iter().filter(|p| p.trainable) {
        for suffix in ["master", "exp_avg", "exp_avg_sq"] {
            let name = format!("{}.{suffix}", p.name);
            if let Some(id) = tr.store.lookup(&name) {
                targets.push((name, id));
            }
        }
    }
    let mut plan = Vec::with_capacity(targets.len());
    for (name, id) in targets {
        let src = find(&name).ok_or_else(|| bad(&ck.path, format!("no tensor {name}")))?;
        let (a, b) = (
            tr.store.info(src).map_err(|e| super::strata_err(&name, e))?,
            tr.store.info(id).map_err(|e| super::strata_err(&name, e))?,
        );
        if (a.dtype, &a.shape) != (b.dtype, &b.shape) {
            return Err(bad(
                &ck.path,
                format!(
                    "{name} is {} {:?} there, {} {:?} here",
                    a.dtype, a.shape, b.dtype, b.shape
                ),
            ));
        }
        plan.push((name, src, id));
    }
    tr.torn = Some(ck.path.clone());
    for (name, src, id) in plan {
        let bytes = tr.store.read(src).map_err(|e| super::strata_err(&name, e))?;
        tr.store.write(id, &bytes).map_err(|e| super::strata_err(&name, e))?;
    }
    Ok(())
}
