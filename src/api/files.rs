//! Tensor files: loading safetensors checkpoints (one file, or a sharded checkpoint by its index
//! or its directory) and GGUF files in place (the Disk tier refers to the mapped files) or by
//! copy, and saving tensors to a new safetensors file atomically, with its `__metadata__`.

mod checkpoint;
mod gguf;
mod save;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use safetensors::tensor::{Dtype as StDtype, SafeTensors};

pub use checkpoint::{Loaded, LoadedFile, LoadedTensor};
pub use gguf::{Gguf, GgufTensor, GgufValue};

use super::Store;
use crate::base::error::{Error, Result};
use crate::base::types::{DType, Group, TensorId, Tier};
use crate::migrate::load::{self, InFile};
use crate::tiers::file::ExternalFile;

/// How [`Store::load_checkpoint`] and [`Store::load_safetensors`] load a checkpoint.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// `None` (default): every tensor stays in the file, in place — the Disk tier refers to the
    /// mapped file and nothing is copied until a tensor is promoted. `Some(tier)`: each tensor is
    /// copied into `tier` instead (making room there as `move_to` does), and the file is no longer
    /// referred to.
    pub copy_to: Option<Tier>,
    /// Prepended to every tensor's name in the store (for loading several checkpoints side by
    /// side). [`Loaded`] keeps the names in the file too, and [`Loaded::save`] writes those.
    pub name_prefix: String,
    /// The group of the loaded tensors (default `Other`; weights are usually `Param`).
    pub group: Group,
}

/// A regular file mapped read-only, opened as [`Store::load_checkpoint`] opens a checkpoint's
/// files: a path that is not a regular file (a directory, a FIFO, a device) is
/// [`Error::NotAFile`] and is never opened, a missing or unreadable one an [`Error::Io`] naming
/// it. For a program that parses a format of its own from a file's bytes without copying them
/// (the `strata` binary's `train-demo` reads its `--init` and `--data` safetensors files so).
///
/// The file must not be truncated or rewritten while it is mapped (as with any memory-mapped
/// reader, and as [`Store::load_checkpoint`] asks of a checkpoint's files).
///
/// ```
/// # fn main() -> strata::Result<()> {
/// let f = strata::MappedFile::open("tests/fixtures/quants.gguf")?;
/// assert!(f.bytes().starts_with(b"GGUF"));
/// let dir = std::env::temp_dir();
/// assert!(matches!(strata::MappedFile::open(&dir), Err(strata::Error::NotAFile { .. })));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct MappedFile(ExternalFile);

impl MappedFile {
    /// Opens and maps the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<MappedFile> {
        ExternalFile::open(path.as_ref()).map(MappedFile)
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

fn from_st(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::F64 => DType::F64,
        StDtype::F32 => DType::F32,
        StDtype::F16 => DType::F16,
        StDtype::BF16 => DType::BF16,
        StDtype::F8_E4M3 => DType::F8E4M3,
        StDtype::F8_E5M2 => DType::F8E5M2,
        StDtype::I64 => DType::I64,
        StDtype::I32 => DType::I32,
        StDtype::I16 => DType::I16,
        StDtype::I8 => DType::I8,
        StDtype::U64 => DType::U64,
        StDtype::U32 => DType::U32,
        StDtype::U16 => DType::U16,
        StDtype::U8 => DType::U8,
        StDtype::BOOL => DType::Bool,
        _ => return None,
    })
}

/// Its safetensors dtype; `None` for a block-quantized dtype, which safetensors cannot hold.
fn to_st(d: DType) -> Option<StDtype> {
    Some(match d {
        DType::F64 => StDtype::F64,
        DType::F32 => StDtype::F32,
        DType::F16 => StDtype::F16,
        DType::BF16 => StDtype::BF16,
        DType::F8E4M3 => StDtype::F8_E4M3,
        DType::F8E5M2 => StDtype::F8_E5M2,
        DType::I64 => StDtype::I64,
        DType::I32 => StDtype::I32,
        DType::I16 => StDtype::I16,
        DType::I8 => StDtype::I8,
        DType::U64 => StDtype::U64,
        DType::U32 => StDtype::U32,
        DType::U16 => StDtype::U16,
        DType::U8 => StDtype::U8,
        DType::Bool => StDtype::BOOL,
        _ => return None,
    })
}

fn bad(path: &Path, tensor: Option<&str>, why: impl Into<String>) -> Error {
    Error::BadFile { path: path.to_path_buf(), tensor: tensor.map(str::to_string), why: why.into() }
}

/// One tensor found in a file.
struct Found {
    /// Its name in the file.
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    offset: u64,
    len: u64,
}

/// What a file holds: its tensors in file order, and its header's `__metadata__`.
struct Parsed {
    found: Vec<Found>,
    metadata: BTreeMap<String, String>,
}

/// Checks every tensor's entry of the header against the file before the `safetensors` crate
/// sees it: offsets in order and inside the data, size equal to shape × dtype, a name. The crate
/// checks these too, but without naming the tensor for some, and with unchecked arithmetic on
/// offsets near `u64::MAX`. Headers this cannot read are left to the crate to describe.
fn precheck(path: &Path, bytes: &[u8]) -> Result<()> {
    let Some(n) = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))) else {
        return Ok(());
    };
    let Some(data_len) = (bytes.len() as u64).checked_sub(8).and_then(|l| l.checked_sub(n)) else {
        return Ok(());
    };
    let Some(header) = bytes.get(8..8 + n as usize) else { return Ok(()) };
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(header)
    else {
        return Ok(());
    };
    for (name, v) in &map {
        if name == "__metadata__" {
            continue;
        }
        let t = Some(name.as_str());
        if name.is_empty() {
            return Err(bad(path, t, "empty tensor name"));
        }
        let offsets = v.get("data_offsets").and_then(|o| o.as_array());
        let (Some(begin), Some(end)) = (
            offsets.and_then(|o| o.first()).and_then(|x| x.as_u64()),
            offsets.and_then(|o| o.get(1)).and_then(|x| x.as_u64()),
        ) else {
            continue;
        };
        if begin > end || end > data_len {
            return Err(bad(
                path,
                t,
                format!("data offsets [{begin}, {end}] outside the {data_len} bytes of data"),
            ));
        }
        let size = match v.get("dtype").and_then(|d| d.as_str()) {
            Some("F64" | "I64" | "U64" | "C64") => 8,
            Some("F32" | "I32" | "U32") => 4,
            Some("F16" | "BF16" | "I16" | "U16") => 2,
            Some("U8" | "I8" | "BOOL" | "F8_E4M3" | "F8_E5M2") => 1,
            _ => continue,
        };
        let Some(shape) = v.get("shape").and_then(|s| s.as_array()) else { continue };
        let elems = shape.iter().try_fold(1u64, |a, d| d.as_u64().and_then(|d| a.checked_mul(d)));
        if elems.and_then(|e| e.checked_mul(size)) != Some(end - begin) {
            return Err(bad(
                path,
                t,
                format!("shape {shape:?} does not match its {} bytes", end - begin),
            ));
        }
    }
    Ok(())
}

/// Parses a mapped safetensors file: every tensor's dtype, shape and byte range, in file order,
/// and the header's `__metadata__`.
fn parse(file: &Arc<ExternalFile>) -> Result<Parsed> {
    let path = file.path();
    let bytes = file.bytes();
    let named_gguf = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if named_gguf || Gguf::sniff(bytes) {
        let g = Gguf::parse(Arc::clone(file))?;
        let metadata =
            g.metadata().iter().filter_map(|(k, v)| Some((k.clone(), v.to_text()?))).collect();
        return Ok(Parsed { found: g.found(), metadata });
    }
    precheck(path, bytes)?;
    let (n, header) = SafeTensors::read_metadata(bytes).map_err(|e| {
        use safetensors::SafeTensorError as E;
        let tensor = match &e {
            E::InvalidOffset(name) | E::TensorNotFound(name) => Some(name.as_str()),
            _ => None,
        };
        bad(path, tensor, e.to_string())
    })?;
    // The data starts after the 8-byte length and the header.
    let data = 8 + n as u64;
    let mut found = Vec::new();
    for (name, info) in header.tensors() {
        let dtype = from_st(info.dtype)
            .ok_or_else(|| bad(path, Some(&name), format!("unsupported dtype {:?}", info.dtype)))?;
        let (begin, end) = info.data_offsets;
        let len = end - begin;
        if dtype.bytes_for(&info.shape).ok() != Some(len as u64) {
            return Err(bad(
                path,
                Some(&name),
                format!("shape {:?} does not match {len} bytes", info.shape),
            ));
        }
        found.push(Found {
            name,
            dtype,
            shape: info.shape.clone(),
            offset: data + begin as u64,
            len: len as u64,
        });
    }
    // File order; zero-size tensors share an offset: the order among them is their names'.
    found.sort_by(|a, b| (a.offset, a.len, &a.name).cmp(&(b.offset, b.len, &b.name)));
    let metadata =
        header.metadata().iter().flatten().map(|(k, v)| (k.clone(), v.clone())).collect();
    Ok(Parsed { found, metadata })
}

impl Store {
    /// Loads a checkpoint: one `.safetensors` file, one GGUF file (named `*.gguf` or starting
    /// with GGUF's magic: its tensors keep their GGUF names and dtypes, block-quantized ones
    /// included, and its scalar and string metadata is the file's [`LoadedFile::metadata`];
    /// [`Gguf::open`] reads all of it, arrays included), a sharded checkpoint's index
    /// (`model.safetensors.index.json`: `{"metadata": {...}, "weight_map": {"tensor":
    /// "shard file", ...}}`, the shards beside it), or a directory (its
    /// `*.safetensors.index.json` when it has one, else every `*.safetensors` file in it, in name
    /// order). Returns the tensors (their names in the files, in the store and their ids: file by
    /// file, each in file order) and the files' `__metadata__`; [`Loaded::save`] writes them
    /// back in one call.
    ///
    /// By default nothing is copied: each tensor's home is its byte range of its file, mapped
    /// read-only (a multi-GB checkpoint costs no RAM until tensors are used), and promoting a
    /// tensor reads that range (with `O_DIRECT` where it is page-aligned). Writing a loaded
    /// tensor never modifies the file: the new bytes get a new home in the store.
    /// [`LoadOptions::copy_to`] copies the tensors into a tier instead.
    ///
    /// All or nothing: every file is read and checked before anything is loaded. Bad input is an
    /// [`Error::BadFile`] naming the file (and the tensor, where it is one tensor's fault): a
    /// malformed file or index, a tensor of the index missing from its shard, a tensor of a shard
    /// not in the index (or mapped to another shard), a tensor in two files. A missing or
    /// unreadable file (a shard included) is an [`Error::Io`] naming it; a name already in the
    /// store is [`Error::DuplicateName`].
    ///
    /// The files must not be truncated or rewritten while the store refers to them (as with any
    /// memory-mapped loader).
    ///
    /// ```
    /// # use strata::{DType, LoadOptions, Store, Tier};
    /// # fn main() -> strata::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let src = Store::builder().host_backend().build()?;
    /// # let a = src.put("a", DType::F32, &[2], &[1u8; 8])?;
    /// # let b = src.put("b", DType::U16, &[4], &[2u8; 8])?;
    /// # src.save_safetensors(dir.path().join("model-00001-of-00002.safetensors"), &[a])?;
    /// # src.save_safetensors(dir.path().join("model-00002-of-00002.safetensors"), &[b])?;
    /// # std::fs::write(dir.path().join("model.safetensors.index.json"), r#"{"metadata": {},
    /// #   "weight_map": {"a": "model-00001-of-00002.safetensors",
    /// #                  "b": "model-00002-of-00002.safetensors"}}"#).unwrap();
    /// let store = Store::builder().host_backend().build()?;
    /// // The directory, or dir.path().join("model.safetensors.index.json").
    /// let model = store.load_checkpoint(dir.path(), LoadOptions::default())?;
    /// assert_eq!((model.len(), model.files().len()), (2, 2));
    /// let b = model.get("b").unwrap();
    /// assert_eq!(store.info(b)?.dtype, DType::U16);
    /// assert_eq!(store.tier_of(b)?, Tier::Disk); // in its shard, in place
    /// assert_eq!(store.read(b)?, vec![2u8; 8]);
    /// # Ok(()) }
    /// ```
    pub fn load_checkpoint(&self, path: impl AsRef<Path>, opts: LoadOptions) -> Result<Loaded> {
        let layout = checkpoint::resolve(path.as_ref())?;
        let mut files = Vec::with_capacity(layout.files.len());
        let mut parsed = Vec::with_capacity(layout.files.len());
        for p in &layout.files {
            let file = Arc::new(ExternalFile::open(p)?);
            parsed.push(parse(&file)?);
            files.push(file);
        }
        // Every tensor with its file's position, in load order.
        let found: Vec<(usize, &Found)> = parsed
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.found.iter().map(move |f| (i, f)))
            .collect();
        checkpoint::check_names(&layout, found.iter().map(|&(i, f)| (i, f.name.as_str())))?;
        let new: Vec<InFile> = found
            .iter()
            .map(|&(file, f)| InFile {
                file,
                name: format!("{}{}", opts.name_prefix, f.name),
                dtype: f.dtype,
                shape: f.shape.clone(),
                offset: f.offset,
                bytes: f.len,
            })
            .collect();
        let ids = load::register(&self.shared, &files, &new, opts.copy_to, opts.group)?;
        let tensors = found
            .iter()
            .zip(ids)
            .map(|(&(file, f), id)| LoadedTensor {
                name: f.name.clone(),
                store_name: format!("{}{}", opts.name_prefix, f.name),
                id,
                file,
            })
            .collect();
        let loaded_files = layout
            .files
            .into_iter()
            .zip(parsed)
            .map(|(path, p)| LoadedFile { path, metadata: p.metadata })
            .collect();
        Ok(Loaded::new(tensors, loaded_files, layout.index.map(|i| i.path)))
    }

    /// [`Store::load_checkpoint`] (one file, an index or a directory), returning only the
    /// tensors' names in the store and their ids, in load order.
    ///
    /// ```
    /// # use strata::{DType, LoadOptions, Store, Tier};
    /// # fn main() -> strata::Result<()> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let path = dir.path().join("m.safetensors");
    /// # let src = Store::builder().host_backend().build()?;
    /// # let w = src.put("w", DType::F32, &[2, 2], &[0u8; 16])?;
    /// # src.save_safetensors(&path, &[w])?;
    /// let store = Store::builder().host_backend().capacity(Tier::Device, 1 << 20).build()?;
    /// let loaded = store.load_safetensors(&path, LoadOptions::default())?;
    /// let (name, id) = &loaded[0];
    /// assert_eq!(name, "w");
    /// assert_eq!(store.tier_of(*id)?, Tier::Disk); // in the file, in place
    /// assert_eq!(store.read(*id)?, vec![0u8; 16]);
    /// # Ok(()) }
    /// ```
    pub fn load_safetensors(
        &self,
        path: impl AsRef<Path>,
        opts: LoadOptions,
    ) -> Result<Vec<(String, TensorId)>> {
        self.load_checkpoint(path, opts).map(Loaded::into_pairs)
    }

    /// Writes these tensors' current contents (a copy written on the device included) to a new
    /// safetensors file at `path` under their names in the store (a load's
    /// [`name_prefix`](LoadOptions::name_prefix) included: [`Loaded::save`] writes the names of
    /// the files), atomically: the file is written unnamed in `path`'s directory, flushed to
    /// disk, then linked beside `path` and renamed over it, and the directory is flushed. A reader
    /// of `path` sees the old file or the new one, whole; a failed save leaves the old file as it
    /// was, and a process killed during a save leaves nothing behind (one killed in the
    /// microseconds between the link and the rename leaves `.NAME.strata-PID-N.tmp`, which the
    /// next save to that directory removes). An existing file's permissions carry over to the new
    /// one; a symlink is followed (the file it names is replaced, the link still names it); a
    /// directory, device or FIFO at `path` is refused, as is a tensor named `__metadata__`
    /// (the name safetensors reserves). The result loads with the Python `safetensors` package and with the Rust crate. One
    /// tensor is in memory at a time.
    ///
    /// ```
    /// # fn main() -> strata::Result<()> {
    /// use strata::{DType, LoadOptions, Store};
    /// let dir = tempfile::tempdir().unwrap();
    /// let store = Store::builder().host_backend().build()?;
    /// let w = store.put("w", DType::F32, &[2], &[0u8; 8])?;
    /// store.save_safetensors(dir.path().join("model.safetensors"), &[w])?;
    /// // Loaded beside the original: the store's names take a prefix.
    /// let opts = LoadOptions { name_prefix: "copy.".into(), ..LoadOptions::default() };
    /// let loaded = store.load_checkpoint(dir.path().join("model.safetensors"), opts)?;
    /// let w2 = loaded.get("w").expect("saved under its name");
    /// assert_eq!(store.read(w2)?, vec![0u8; 8]);
    /// # Ok(()) }
    /// ```
    pub fn save_safetensors(&self, path: impl AsRef<Path>, ids: &[TensorId]) -> Result<()> {
        let named =
            ids.iter().map(|&id| Ok((id, self.info(id)?.name))).collect::<Result<Vec<_>>>()?;
        self.save_safetensors_as(path, &named)
    }

    /// [`Store::save_safetensors`] under names of the caller's choosing: `(tensor, name in the
    /// file)` pairs (to save fp32 master weights under their parameters' names, for example).
    pub fn save_safetensors_as(
        &self,
        path: impl AsRef<Path>,
        tensors: &[(TensorId, String)],
    ) -> Result<()> {
        self.save_safetensors_with(path, tensors, &BTreeMap::new())
    }

    /// [`Store::save_safetensors_as`] with `metadata` as the header's `__metadata__` (none when
    /// empty): `{"format": "pt"}`, as PyTorch checkpoints carry, or anything of the caller's.
    /// [`Loaded::metadata`] is what a loaded checkpoint carried.
    pub fn save_safetensors_with(
        &self,
        path: impl AsRef<Path>,
        tensors: &[(TensorId, String)],
        metadata: &BTreeMap<String, String>,
    ) -> Result<()> {
        save::save(self, path.as_ref(), tensors, metadata)
    }
}
