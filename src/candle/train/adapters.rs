//! What a trainer does with its LoRA adapters beside training them: save them in PEFT's format
//! ([`Trainer::save_adapter`]), start from a PEFT adapter ([`Trainer::load_adapter`]), export
//! the model with the adapters merged ([`Trainer::save_merged`], in a dtype of your choice:
//! [`Trainer::save_merged_as`]); and the forward alone
//! ([`Trainer::logits`]).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType as CDType, Device, Tensor};

use super::checkpoint::{alive, sync_dir};
use super::{read_f32, refs, strata_err, TrainError, Trainer};
use crate::base::types::DType;
use crate::candle::llama::{embed, head_logits, EMBED};
use crate::candle::lora::{
    is_adapter, merge, peft_name, read_adapter, write_adapter_config, LoraConfig, ADAPTER_FILE,
};
use crate::candle::LlamaConfig;

fn io(path: &Path, e: std::io::Error) -> candle_core::Error {
    crate::Error::io(path, e).into()
}

impl Trainer {
    /// The f32 logits (`[batch · seq, vocab]`) of `ids` (`[batch, seq]` u32 token ids, `seq`
    /// at most the training sequence), computed out of core stage by stage as a step's forward
    /// computes them (adapters included), after the last step's updates have run; each
    /// projection its own GEMM (a step joins q/k/v and gate/up, [`Block::joined_linears`]: the
    /// same values, f32 rounding apart), as [`LlamaTwin::logits`](crate::candle::LlamaTwin::logits)
    /// computes them.
    ///
    /// [`Block::joined_linears`]: crate::candle::block::Block::joined_linears
    pub fn logits(&mut self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.check_whole()?;
        self.settle()?;
        let (_, s) = ids.dims2()?;
        if s == 0 || s > self.train.seq || ids.dtype() != CDType::U32 {
            candle_core::bail!(
                "ids of {:?} {:?}: [batch, seq] u32 with seq from 1 to {}",
                ids.dims(),
                ids.dtype(),
                self.train.seq
            );
        }
        let max = ids.max_all()?.to_scalar::<u32>()?;
        if max as usize >= self.config.vocab_size {
            candle_core::bail!("token id {max} in a vocabulary of {}", self.config.vocab_size);
        }
        let n = self.config.num_hidden_layers;
        let w = self.layers.fetch(&[EMBED], &refs(&self.stage_names(1)))?;
        let mut x = embed(w.get(EMBED).expect("fetched"), ids)?;
        drop(w);
        for l in 0..n {
            let (this, next) = (self.stage_names(l + 1), self.stage_names(l + 2));
            let w = self.layers.fetch(&refs(&this), &refs(&next))?;
            let bw = self.weights_of(l, |name| w.get(name).cloned())?;
            x = self.block.forward(l, &bw, &x)?;
        }
        let head = self.stage_names(n + 1);
        let w = self.layers.fetch(&refs(&head), &[])?;
        let [norm, out] = self.config.head_names();
        head_logits(&self.config, &x, w.get(norm).expect("fetched"), w.get(out).expect("fetched"))
    }

    /// The LoRA config, or an error saying the run has none.
    fn lora(&self) -> candle_core::Result<LoraConfig> {
        self.train.lora.clone().ok_or_else(|| {
            TrainError::Invalid("the run has no LoRA adapters (TrainConfig::lora)".into())
                .into_candle()
        })
    }

    /// The adapters' tensors with their names in PEFT's file.
    fn peft_tensors(&self) -> Vec<(crate::TensorId, String)> {
        self.specs
            .iter()
            .flat_map(|s| [&s.a.0, &s.b.0])
            .map(|n| (self.layers.id(n).expect("an adapter"), peft_name(n)))
            .collect()
    }

    /// The adapters written into `dir` (the checkpoint's, or a standalone directory) in PEFT's
    /// format, `meta` in the tensors' file.
    pub(super) fn write_adapter(
        &self,
        dir: &Path,
        meta: &BTreeMap<String, String>,
    ) -> candle_core::Result<()> {
        let lora = self.lora()?;
        self.store.save_safetensors_with(dir.join(ADAPTER_FILE), &self.peft_tensors(), meta)?;
        write_adapter_config(dir, &lora, self.notes.get("base_model").map(String::as_str))
    }

    /// Saves the adapters as a PEFT adapter directory: `dir/adapter_model.safetensors`
    /// (PEFT's tensor names, `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`,
    /// f32) and `dir/adapter_config.json` (its `base_model_name_or_path` the run's note
    /// `base_model`, [`Trainer::set_notes`]), which PyTorch's `PeftModel.from_pretrained(base,
    /// dir)` loads. Ends the last step's updates first. (A checkpoint of a LoRA run,
    /// [`Trainer::save`], holds the same two files.)
    pub fn save_adapter(&mut self, dir: impl AsRef<Path>) -> candle_core::Result<()> {
        self.check_whole()?;
        self.settle()?;
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        // Written beside, then renamed: a failed save leaves the directory as it was.
        let tmp = tempfile::Builder::new()
            .prefix(".tmp-adapter-")
            .tempdir_in(dir)
            .map_err(|e| io(dir, e))?;
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        self.write_adapter(tmp.path(), &meta)?;
        for f in [ADAPTER_FILE, crate::candle::lora::ADAPTER_CONFIG] {
            std::fs::rename(tmp.path().join(f), dir.join(f)).map_err(|e| io(&dir.join(f), e))?;
        }
        Ok(())
    }

    /// Starts the adapters from a PEFT adapter directory (`PeftModel.save_pretrained`'s, or
    /// [`Trainer::save_adapter`]'s): its config must be the run's (rank, alpha, targets,
    /// rsLoRA: [`TrainError::Mismatch`] names what differs; [`LoraConfig::from_peft`] reads
    /// one to start a run with), and its file must hold every adapter of the run and nothing
    /// else, of the run's shapes (f32, bf16 or f16, stored here as f32). Only before the first
    /// step (to continue a run, resume its checkpoint); everything is checked before a value
    /// is written.
    pub fn load_adapter(&mut self, dir: impl AsRef<Path>) -> candle_core::Result<()> {
        self.check_whole()?;
        let dir = dir.as_ref();
        let lora = self.lora()?;
        if self.step > 0 {
            return Err(TrainError::Invalid(format!(
                "the run is at step {}: adapters are loaded before the first step (to continue \
                 a run, resume its checkpoint)",
                self.step
            ))
            .into_candle());
        }
        let (theirs, tensors) = read_adapter(dir)?;
        let mut mine = lora.clone();
        mine.targets.sort();
        let mismatch = |what: &str, saved: String, here: String| {
            Err(TrainError::Mismatch {
                path: dir.to_path_buf(),
                what: what.into(),
                saved,
                here,
                hint: "train with the adapter's LoRA config (LoraConfig::from_peft)".into(),
            }
            .into_candle())
        };
        if theirs.rank != mine.rank {
            return mismatch("LoRA rank", theirs.rank.to_string(), mine.rank.to_string());
        }
        if theirs.alpha != mine.alpha || theirs.rslora != mine.rslora {
            let show = |c: &LoraConfig| format!("alpha {}, rslora {}", c.alpha, c.rslora);
            return mismatch("LoRA scale", show(&theirs), show(&mine));
        }
        if theirs.targets != mine.targets {
            return mismatch("LoRA targets", theirs.targets.join(","), mine.targets.join(","));
        }
        let mut plan = Vec::new();
        for s in &self.specs {
            for (name, shape) in [&s.a, &s.b] {
                let t = tensors.get(name).ok_or_else(|| {
                    TrainError::BadCheckpoint {
                        path: dir.join(ADAPTER_FILE),
                        why: format!("no tensor {}", peft_name(name)),
                    }
                    .into_candle()
                })?;
                if t.dims() != shape.as_slice() {
                    return Err(crate::candle::shape_mismatch(name, shape, t.dims()));
                }
                plan.push((name.clone(), t.flatten_all()?.to_vec1::<f32>()?));
            }
        }
        if let Some(extra) = tensors.keys().find(|n| !plan.iter().any(|(p, _)| p == *n)) {
            return Err(TrainError::BadCheckpoint {
                path: dir.join(ADAPTER_FILE),
                why: format!(
                    "tensor {} is not an adapter of this run (another model or targets)",
                    peft_name(extra)
                ),
            }
            .into_candle());
        }
        for (name, values) in plan {
            let id = self.layers.id(&name).expect("an adapter");
            self.store
                .write(id, bytemuck::cast_slice(&values))
                .map_err(|e| strata_err(&name, e))?;
        }
        Ok(())
    }

    /// Writes the model with its adapters merged (`W + scale · B·A` in f32, rounded once to the
    /// weights' dtype, f32 for a quantized base's weights, which are dequantized as the `gguf`
    /// package dequantizes them: PEFT's `merge_and_unload`) into the new directory `dir` as a plain
    /// Hugging Face checkpoint: one `model-NNNNN-of-NNNNN.safetensors` a stage,
    /// `model.safetensors.index.json` and `config.json` (loadable by
    /// [`load_weights`](crate::candle::load_weights), `LlamaForCausalLM.from_pretrained`, and this
    /// crate's generation). A stage at a time is held in memory. Written as a checkpoint is:
    /// into a hidden directory beside `dir` (`.tmp-merged-PID-…`), each file flushed to disk,
    /// then renamed into place and the directory above flushed: whole or absent, even across
    /// a power loss. A failure removes the hidden directory; one a killed export left is
    /// removed by the next export beside it. The files get the mode new files get (0666 less
    /// the umask). Ends the last step's updates first. `dir` must not exist, or be an empty
    /// directory ([`check_outputs`](super::check_outputs) checks it before a run).
    /// [`Trainer::save_merged_as`] chooses the weights' dtype.
    pub fn save_merged(&mut self, dir: impl AsRef<Path>) -> candle_core::Result<()> {
        self.save_merged_as(dir, None)
    }

    /// [`Trainer::save_merged`], every weight written in `dtype` (f32 or bf16: the merge in f32
    /// rounded once to bf16, as `merge_and_unload` on a bf16 model, then `save_pretrained`,
    /// rounds it), or with `None` in the weights' own dtype (bf16 stays bf16; f32, f16 and
    /// quantized weights are written in f32). `config.json` names the dtype written
    /// (`torch_dtype`). Another dtype is refused before anything is written.
    ///
    /// A quantized base's export in bf16 (`--export-dtype bf16`) is half the f32 one's bytes; it
    /// is what `from_pretrained(dir, dtype=torch.bfloat16)` would compute from the f32 export.
    pub fn save_merged_as(
        &mut self,
        dir: impl AsRef<Path>,
        dtype: Option<DType>,
    ) -> candle_core::Result<()> {
        if let Some(d) = dtype.filter(|d| !matches!(d, DType::F32 | DType::BF16)) {
            candle_core::bail!("a merged export in {d}: f32 or bf16");
        }
        self.check_whole()?;
        self.settle()?;
        let dir = dir.as_ref();
        if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
            candle_core::bail!(
                "{}: a file: a merged export goes into a new directory",
                dir.display()
            );
        }
        if std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some()) {
            candle_core::bail!(
                "{}: not empty: a merged export goes into a new directory",
                dir.display()
            );
        }
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => std::path::PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(|e| io(&parent, e))?;
        clean_stale_exports(&parent);
        let tmp =
            parent.join(format!("{MERGED_TMP}{}-{:016x}", std::process::id(), super::new_run_id()));
        {
            use std::os::unix::fs::DirBuilderExt;
            // The mode a new directory gets (0777 less the umask), as the other files' are.
            std::fs::DirBuilder::new().mode(0o777).create(&tmp).map_err(|e| io(&tmp, e))?;
        }
        let written = self.write_merged(&tmp, dtype).and_then(|()| {
            if dir.exists() {
                std::fs::remove_dir(dir).map_err(|e| io(dir, e))?;
            }
            crate::base::failpoint::check(crate::base::failpoint::Site::SaveRename, dir)?;
            std::fs::rename(&tmp, dir).map_err(|e| io(dir, e))?;
            sync_dir(&parent)
        });
        if written.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        written
    }

    /// The merged model's files in the new directory `tmp` (the weights in `dtype`, or their
    /// own: [`Trainer::save_merged_as`]), each flushed to disk, then the directory.
    fn write_merged(&self, tmp: &Path, dtype: Option<DType>) -> candle_core::Result<()> {
        let stages = self.config.num_hidden_layers + 2;
        let mut written: Option<DType> = None;
        let mut mixed = false;
        let scale = self.train.lora.as_ref().map_or(1.0, LoraConfig::scale);
        let mut map = serde_json::Map::new();
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        for stage in 0..stages {
            let mut tensors: Vec<(String, DType, Vec<usize>, Vec<u8>)> = Vec::new();
            let base = self.params.iter().filter(|p| p.stage == stage && !is_adapter(&p.name));
            for p in base {
                let info = self.store.info(p.id).map_err(|e| strata_err(&p.name, e))?;
                let w = Tensor::from_vec(
                    read_f32(&self.store, &p.name, p.id)?,
                    info.shape.as_slice(),
                    &Device::Cpu,
                )?;
                let spec = self.specs.iter().find(|s| {
                    format!("{}{}", LlamaConfig::block_prefix(s.layer), s.linear) == p.name
                });
                let w = match spec {
                    None => w,
                    Some(s) => {
                        let get = |n: &str| -> candle_core::Result<Tensor> {
                            let id = self.layers.id(n).expect("an adapter");
                            Tensor::from_vec(
                                read_f32(&self.store, n, id)?,
                                self.shape(n),
                                &Device::Cpu,
                            )
                        };
                        merge(&w, &get(&s.a.0)?, &get(&s.b.0)?, scale)?
                    }
                };
                // A quantized base weight (a GGUF file's) is written dequantized: in f32, or
                // in the dtype asked for.
                let out = dtype.unwrap_or(match info.dtype {
                    DType::BF16 => DType::BF16,
                    _ => DType::F32,
                });
                let bytes: Vec<u8> = match out {
                    DType::BF16 => bytemuck::cast_slice(
                        &w.to_dtype(CDType::BF16)?.flatten_all()?.to_vec1::<half::bf16>()?,
                    )
                    .to_vec(),
                    _ => bytemuck::cast_slice(&w.flatten_all()?.to_vec1::<f32>()?).to_vec(),
                };
                mixed |= written.is_some_and(|d| d != out);
                written = Some(out);
                tensors.push((p.name.clone(), out, info.shape, bytes));
            }
            if tensors.is_empty() {
                continue;
            }
            let file = format!("model-{:05}-of-{stages:05}.safetensors", stage + 1);
            let views = tensors
                .iter()
                .map(|(n, d, s, b)| {
                    let dt = if *d == DType::BF16 {
                        safetensors::Dtype::BF16
                    } else {
                        safetensors::Dtype::F32
                    };
                    safetensors::tensor::TensorView::new(dt, s.clone(), b).map(|v| (n.clone(), v))
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| candle_core::Error::Msg(format!("{file}: {e}")))?;
            let path = tmp.join(&file);
            let bytes = safetensors::serialize(views, Some(meta.clone()))
                .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
            write_synced(&path, &bytes)?;
            for (n, ..) in &tensors {
                map.insert(n.clone(), file.clone().into());
            }
        }
        let index = serde_json::json!({ "metadata": {}, "weight_map": map });
        write_synced(&tmp.join("model.safetensors.index.json"), index.to_string().as_bytes())?;
        // The dtype the weights are in, as transformers records it (`torch_dtype`).
        let config = LlamaConfig {
            dtype: match (written, mixed) {
                (Some(DType::BF16), false) => Some(CDType::BF16),
                (Some(_), false) => Some(CDType::F32),
                _ => None,
            },
            ..self.config.clone()
        };
        write_synced(&tmp.join("config.json"), config.to_json().as_bytes())?;
        sync_dir(tmp)
    }

    /// A parameter's shape.
    fn shape(&self, name: &str) -> Vec<usize> {
        self.layers
            .id(name)
            .and_then(|id| self.store.info(id).ok())
            .map(|i| i.shape)
            .unwrap_or_default()
    }

    /// The crc32 of a LoRA run's frozen base (every parameter not trained, in the model's
    /// order), computed once: a checkpoint of the run does not hold the base (it does not
    /// change), so its record names the base by this, and a resume checks it.
    pub(super) fn base_crc(&mut self) -> candle_core::Result<u32> {
        if let Some(c) = self.base_crc {
            return Ok(c);
        }
        let mut h = crc32fast::Hasher::new();
        for p in self.params.iter().filter(|p| !p.trainable && !is_adapter(&p.name)) {
            h.update(&self.store.read(p.id).map_err(|e| strata_err(&p.name, e))?);
        }
        let c = h.finalize();
        self.base_crc = Some(c);
        Ok(c)
    }
}

/// The name's prefix of a merged export being written ([`Trainer::save_merged`]), before the
/// writing process's id.
const MERGED_TMP: &str = ".tmp-merged-";

/// Removes what killed merged exports left in `parent`: `.tmp-merged-PID-…` directories whose
/// process is gone.
fn clean_stale_exports(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(MERGED_TMP)) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !alive(pid) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Writes a new file (the mode a new file gets: 0666 less the umask) and flushes it to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> candle_core::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    crate::base::failpoint::check(crate::base::failpoint::Site::SaveWrite, path)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o666)
        .open(path)
        .map_err(|e| io(path, e))?;
    f.write_all(bytes).map_err(|e| io(path, e))?;
    crate::base::failpoint::check(crate::base::failpoint::Site::SaveSync, path)?;
    f.sync_all().map_err(|e| io(path, e))
}
