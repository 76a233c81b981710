//! Checkpoints as models ship: which files a path names (one `.safetensors` file, a sharded
//! checkpoint's `*.index.json`, or a directory), the checks of the shards against their index,
//! and [`Loaded`], what a load returns.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};

use crate::base::error::{Error, Result};
use crate::base::types::TensorId;
use crate::tiers::file::{check_regular, read_regular};
use crate::Store;

use super::bad;

/// The files a checkpoint path names, in the order their tensors load.
#[derive(Debug)]
pub(super) struct Layout {
    /// The `.safetensors` files.
    pub(super) files: Vec<PathBuf>,
    /// The index they came from, if any.
    pub(super) index: Option<Index>,
}

/// A sharded checkpoint's index, as Hugging Face writes it:
/// `{"metadata": {...}, "weight_map": {"tensor name": "shard file name", ...}}`.
#[derive(Debug)]
pub(super) struct Index {
    pub(super) path: PathBuf,
    /// Tensor name to the position of its shard in [`Layout::files`].
    pub(super) weight_map: BTreeMap<String, usize>,
}

/// The suffix of a sharded checkpoint's index in a directory.
const INDEX_SUFFIX: &str = ".safetensors.index.json";

/// Which files `path` names: a directory (its `*.safetensors.index.json` when it has one, else
/// every `*.safetensors` in it, in name order, hidden files left out), an index (any file whose
/// name ends in `.json`), or one `.safetensors` file. Anything but a regular file where a file
/// is read (the path, an index, a checkpoint's name in the directory) is [`Error::NotAFile`].
pub(super) fn resolve(path: &Path) -> Result<Layout> {
    let md = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !md.is_dir() {
        // A FIFO, a socket or a device is refused here, before anything opens it.
        check_regular(path)?;
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")) {
            return read_index(path);
        }
        return Ok(Layout { files: vec![path.to_path_buf()], index: None });
    }
    let mut indexes = Vec::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| Error::io(path, e))? {
        let entry = entry.map_err(|e| Error::io(path, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.starts_with('.') {
            continue;
        }
        let wanted = name.ends_with(INDEX_SUFFIX) || name.ends_with(".safetensors");
        if !wanted {
            continue;
        }
        // Through links: a Hugging Face cache's snapshot links every file to its blob. A name
        // of the checkpoint's that is not a regular file (a FIFO, a directory, a dangling link)
        // is refused rather than skipped: the checkpoint would load without its tensors.
        check_regular(&entry.path())?;
        if name.ends_with(INDEX_SUFFIX) {
            indexes.push(name.to_string());
        } else {
            files.push(name.to_string());
        }
    }
    indexes.sort();
    files.sort();
    match &indexes[..] {
        [one] => read_index(&path.join(one)),
        [] if files.is_empty() => Err(bad(
            path,
            None,
            format!("a directory with no .safetensors file and no *{INDEX_SUFFIX}"),
        )),
        [] => Ok(Layout { files: files.iter().map(|f| path.join(f)).collect(), index: None }),
        several => Err(bad(
            path,
            None,
            format!(
                "a directory with several indexes ({}): name the one to load",
                several.join(", ")
            ),
        )),
    }
}

/// Reads an index: its `weight_map` (required: every value a file name relative to the index's
/// directory) and the shard files it names, in name order (Hugging Face numbers them
/// `model-00001-of-00003.safetensors`, ...). Its `metadata` (`total_size`) is not used.
fn read_index(path: &Path) -> Result<Layout> {
    let text = read_regular(path)?;
    let json: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| bad(path, None, format!("not a checkpoint index (bad JSON: {e})")))?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(bad(path, None, "not a checkpoint index: no \"weight_map\" object"));
    };
    let dir = path.parent().unwrap_or(Path::new(""));
    let mut shard_of = BTreeMap::new();
    for (name, shard) in map {
        let Some(shard) = shard.as_str() else {
            return Err(bad(path, Some(name), format!("its shard {shard} is not a file name")));
        };
        let rel = Path::new(shard);
        let inside =
            !shard.is_empty() && rel.components().all(|c| matches!(c, Component::Normal(_)));
        if !inside {
            return Err(bad(
                path,
                Some(name),
                format!("its shard {shard:?} is not a relative path inside the index's directory"),
            ));
        }
        shard_of.insert(name.clone(), shard);
    }
    let shards: Vec<&str> =
        shard_of.values().copied().collect::<BTreeSet<_>>().into_iter().collect();
    let position: HashMap<&str, usize> = shards.iter().enumerate().map(|(i, s)| (*s, i)).collect();
    let weight_map = shard_of.iter().map(|(n, s)| (n.clone(), position[s])).collect();
    Ok(Layout {
        files: shards.iter().map(|s| dir.join(s)).collect(),
        index: Some(Index { path: path.to_path_buf(), weight_map }),
    })
}

/// Checks the tensors found in each file (`names[i]`: the names in `files[i]`) against each
/// other and the index: no name in two files; with an index, every tensor of a shard is mapped to
/// that shard, and every tensor of the map is in its shard. The error names the tensor and the
/// file at fault.
pub(super) fn check_names<'a>(
    layout: &Layout,
    names: impl IntoIterator<Item = (usize, &'a str)>,
) -> Result<()> {
    let files = &layout.files;
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (f, name) in names {
        if let Some(&first) = seen.get(name) {
            return Err(bad(
                &files[f],
                Some(name),
                format!("also in {}: a tensor may be in one file only", files[first].display()),
            ));
        }
        seen.insert(name, f);
        if let Some(index) = &layout.index {
            match index.weight_map.get(name) {
                None => {
                    return Err(bad(
                        &files[f],
                        Some(name),
                        format!("not in the weight_map of {}", index.path.display()),
                    ))
                }
                Some(&g) if g != f => {
                    return Err(bad(
                        &files[f],
                        Some(name),
                        format!("{} maps it to {}", index.path.display(), files[g].display()),
                    ))
                }
                Some(_) => {}
            }
        }
    }
    if let Some(index) = &layout.index {
        if let Some((name, &f)) =
            index.weight_map.iter().find(|(n, _)| !seen.contains_key(n.as_str()))
        {
            return Err(bad(
                &files[f],
                Some(name),
                format!("{} maps it to this file, which does not hold it", index.path.display()),
            ));
        }
    }
    Ok(())
}

/// What [`Store::load_checkpoint`] loaded: each tensor's name in its file, its name in the
/// store and its id, in load order (file by file, each in file order), the files and their
/// `__metadata__`. [`Loaded::save`] writes it back in one call, under the names of the files.
///
/// ```
/// # use strata::{DType, LoadOptions, Store};
/// # use std::collections::BTreeMap;
/// # fn main() -> strata::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let path = dir.path().join("model.safetensors");
/// # let src = Store::builder().host_backend().build()?;
/// # let w = src.put("w", DType::F32, &[2], &[0u8; 8])?;
/// # let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
/// # src.save_safetensors_with(&path, &[(w, "w".to_string())], &meta)?;
/// let store = Store::builder().host_backend().build()?;
/// let opts = LoadOptions { name_prefix: "student.".into(), ..Default::default() };
/// let mut model = store.load_checkpoint(&path, opts)?;
/// let w = model.get("w").unwrap(); // by its name in the file
/// assert_eq!(store.info(w)?.name, "student.w");
/// assert_eq!(model.metadata()["format"], "pt");
/// store.write(w, &[1u8; 8])?;
/// model.metadata_mut().insert("step".into(), "1".into());
/// let out = dir.path().join("trained.safetensors");
/// model.save(&store, &out)?; // "w" (no prefix), with {"format": "pt", "step": "1"}
/// # let back = Store::builder().host_backend().build()?.load_checkpoint(&out, LoadOptions::default())?;
/// # assert_eq!(back.metadata().len(), 2);
/// # assert!(back.get("w").is_some());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct Loaded {
    tensors: Vec<LoadedTensor>,
    by_name: HashMap<String, usize>,
    metadata: BTreeMap<String, String>,
    files: Vec<LoadedFile>,
    index: Option<PathBuf>,
}

/// One tensor of a [`Loaded`] checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadedTensor {
    /// Its name in its file (and in the index).
    pub name: String,
    /// Its name in the store: [`LoadOptions::name_prefix`](crate::LoadOptions::name_prefix)
    /// followed by `name`.
    pub store_name: String,
    /// Its id in the store.
    pub id: TensorId,
    /// Its file: a position in [`Loaded::files`].
    pub file: usize,
}

/// One file of a [`Loaded`] checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadedFile {
    /// Its path.
    pub path: PathBuf,
    /// Its header's `__metadata__` (empty when it has none).
    pub metadata: BTreeMap<String, String>,
}

impl Loaded {
    pub(super) fn new(
        tensors: Vec<LoadedTensor>,
        files: Vec<LoadedFile>,
        index: Option<PathBuf>,
    ) -> Loaded {
        let by_name = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        // Every file's keys; where files disagree, the first file's value (each file keeps its
        // own in `files`).
        let mut metadata = BTreeMap::new();
        for f in &files {
            for (k, v) in &f.metadata {
                metadata.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        Loaded { tensors, by_name, metadata, files, index }
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether no tensor was loaded.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The tensors, in load order.
    pub fn iter(&self) -> std::slice::Iter<'_, LoadedTensor> {
        self.tensors.iter()
    }

    /// Every id, in load order.
    pub fn ids(&self) -> Vec<TensorId> {
        self.tensors.iter().map(|t| t.id).collect()
    }

    /// The id of the tensor of this name in its file (without the load's prefix).
    pub fn get(&self, name: &str) -> Option<TensorId> {
        self.by_name.get(name).map(|&i| self.tensors[i].id)
    }

    /// `(name in the store, id)` pairs, in load order: what
    /// [`Store::load_safetensors`] returns.
    pub fn into_pairs(self) -> Vec<(String, TensorId)> {
        self.tensors.into_iter().map(|t| (t.store_name, t.id)).collect()
    }

    /// The `__metadata__` of the files, merged: every key of every file, with the first file's
    /// value where files disagree. [`Loaded::save`] writes it.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The metadata [`Loaded::save`] writes, to change.
    pub fn metadata_mut(&mut self) -> &mut BTreeMap<String, String> {
        &mut self.metadata
    }

    /// The files the tensors came from, in load order, each with its own `__metadata__`.
    pub fn files(&self) -> &[LoadedFile] {
        &self.files
    }

    /// The sharded checkpoint's index, when the load read one.
    pub fn index(&self) -> Option<&Path> {
        self.index.as_deref()
    }

    /// Writes every tensor's current contents to one `.safetensors` file at `path`, under its
    /// name in its file (without the load's
    /// [`name_prefix`](crate::LoadOptions::name_prefix)), with [`Loaded::metadata`] as the
    /// header's `__metadata__`: [`Store::save_safetensors_with`], atomic. To save under the
    /// store's names instead, `store.save_safetensors(path, &loaded.ids())`.
    pub fn save(&self, store: &Store, path: impl AsRef<Path>) -> Result<()> {
        let named: Vec<(TensorId, String)> =
            self.tensors.iter().map(|t| (t.id, t.name.clone())).collect();
        store.save_safetensors_with(path, &named, &self.metadata)
    }
}

impl<'a> IntoIterator for &'a Loaded {
    type Item = &'a LoadedTensor;
    type IntoIter = std::slice::Iter<'a, LoadedTensor>;
    fn into_iter(self) -> Self::IntoIter {
        self.tensors.iter()
    }
}
