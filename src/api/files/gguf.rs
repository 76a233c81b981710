//! GGUF files (llama.cpp's format), read in place: the header, the metadata (every value type,
//! arrays included), the tensor infos and the data's alignment, each checked against the file
//! before anything is kept.
//! The format: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>.
//!
//! Bounded: every count is checked against the bytes left before anything is allocated for it
//! (an element takes at least one byte), arrays nest at most [`MAX_DEPTH`] deep, a tensor has at
//! most four dimensions, and every offset and size is checked arithmetic; a file of `n` bytes
//! costs `O(n)` time and memory whatever its header claims.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use super::{bad, Found};
use crate::base::error::{Error, Result};
use crate::base::types::DType;
use crate::tiers::file::ExternalFile;

/// Arrays of arrays nest at most this deep (llama.cpp writes one level).
const MAX_DEPTH: usize = 4;
/// GGML's limit on a tensor's dimensions.
const MAX_DIMS: usize = 4;
/// The data's alignment when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;

/// A GGUF metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float32`.
    F32(f32),
    /// `float64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// `string` (UTF-8; invalid sequences replaced).
    String(String),
    /// `array`, of one value type.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The name of its kind, as the GGUF spec writes it: `uint32`, `string`, `array`.
    pub fn kind(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "uint8",
            GgufValue::I8(_) => "int8",
            GgufValue::U16(_) => "uint16",
            GgufValue::I16(_) => "int16",
            GgufValue::U32(_) => "uint32",
            GgufValue::I32(_) => "int32",
            GgufValue::U64(_) => "uint64",
            GgufValue::I64(_) => "int64",
            GgufValue::F32(_) => "float32",
            GgufValue::F64(_) => "float64",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
        }
    }

    /// An integer of any width, if it is one and fits a `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A float (`float32` or `float64`), as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array's values.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }

    /// A scalar or string as text (`None` for an array): how [`Store::load_checkpoint`]
    /// reports a GGUF file's metadata in [`LoadedFile::metadata`](crate::LoadedFile).
    ///
    /// [`Store::load_checkpoint`]: crate::Store::load_checkpoint
    pub fn to_text(&self) -> Option<String> {
        Some(match self {
            GgufValue::U8(v) => v.to_string(),
            GgufValue::I8(v) => v.to_string(),
            GgufValue::U16(v) => v.to_string(),
            GgufValue::I16(v) => v.to_string(),
            GgufValue::U32(v) => v.to_string(),
            GgufValue::I32(v) => v.to_string(),
            GgufValue::U64(v) => v.to_string(),
            GgufValue::I64(v) => v.to_string(),
            GgufValue::F32(v) => v.to_string(),
            GgufValue::F64(v) => v.to_string(),
            GgufValue::Bool(v) => v.to_string(),
            GgufValue::String(s) => s.clone(),
            GgufValue::Array(_) => return None,
        })
    }
}

/// One tensor's entry in a GGUF file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensor {
    /// Its name (llama.cpp's: `blk.0.attn_q.weight`, `token_embd.weight`).
    pub name: String,
    /// Its dtype (block-quantized ones included).
    pub dtype: DType,
    /// Its shape, outermost first, as the store and PyTorch write it (GGUF lists dimensions
    /// innermost first: this is that list reversed).
    pub shape: Vec<usize>,
    /// Where its bytes start in the file, and how many.
    pub offset: u64,
    /// Its size in bytes ([`DType::bytes_for`] of its shape).
    pub bytes: u64,
}

/// A GGUF file, mapped and its header read: metadata, tensor infos, alignment.
///
/// ```
/// # fn main() -> strata::Result<()> {
/// let f = strata::Gguf::open("tests/fixtures/quants.gguf")?;
/// assert_eq!(f.get("general.architecture").and_then(|v| v.as_str()), Some("llama"));
/// assert_eq!(f.alignment(), 32);
/// let t = f.tensor("Q4_K").unwrap();
/// assert_eq!((t.dtype, &t.shape[..]), (strata::DType::Q4K, &[4, 256][..]));
/// let x = strata::quant::dequantize(t.dtype, f.bytes(t))?;
/// assert_eq!(x.len(), 4 * 256);
/// # Ok(()) }
/// ```
pub struct Gguf {
    file: Arc<ExternalFile>,
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensor>,
    alignment: u64,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.file.path())
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Maps the file at `path` and reads its header. A file that is not GGUF (version 2 or 3,
    /// little-endian), or whose header is cut short, claims more than the file holds, names an
    /// unknown tensor type or a tensor whose bytes run past the file, or has a
    /// `general.alignment` that is not a power-of-two `uint32`, is an [`Error::BadFile`] naming
    /// the file and what is wrong (and the tensor, where it is one tensor's fault); a missing
    /// file is an [`Error::Io`].
    pub fn open(path: impl AsRef<Path>) -> Result<Gguf> {
        let file = Arc::new(ExternalFile::open(path.as_ref())?);
        Gguf::parse(file)
    }

    pub(super) fn parse(file: Arc<ExternalFile>) -> Result<Gguf> {
        let (version, metadata, tensors, alignment) = read(file.path(), file.bytes())?;
        Ok(Gguf { file, version, metadata, tensors, alignment })
    }

    /// Whether `bytes` start as a GGUF file does (its magic, `GGUF`).
    pub(super) fn sniff(bytes: &[u8]) -> bool {
        bytes.starts_with(b"GGUF")
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// Its format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Every metadata key and its value.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    /// The value of metadata key `key`.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// The tensors, in file order.
    pub fn tensors(&self) -> &[GgufTensor] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The alignment of the tensors' data (`general.alignment`, 32 when absent).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// A tensor's bytes, in the mapped file.
    pub fn bytes(&self, t: &GgufTensor) -> &[u8] {
        let (a, n) = (t.offset as usize, t.bytes as usize);
        self.file.bytes().get(a..a + n).unwrap_or_default()
    }

    /// The tensors as the loader takes them.
    pub(super) fn found(&self) -> Vec<Found> {
        self.tensors
            .iter()
            .map(|t| Found {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                offset: t.offset,
                len: t.bytes,
            })
            .collect()
    }
}

/// The dtype of GGML type id `id`; `None` for one strata does not hold.
fn dtype_of(id: u32) -> Option<DType> {
    Some(match id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        10 => DType::Q2K,
        11 => DType::Q3K,
        12 => DType::Q4K,
        13 => DType::Q5K,
        14 => DType::Q6K,
        15 => DType::Q8K,
        24 => DType::I8,
        25 => DType::I16,
        26 => DType::I32,
        27 => DType::I64,
        28 => DType::F64,
        30 => DType::BF16,
        _ => return None,
    })
}

/// A cursor over the header, every read checked against the end of the file.
struct Reader<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn cut(&self, what: &str) -> Error {
        bad(self.path, None, format!("truncated: the file ends inside {what} (byte {})", self.at))
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| self.cut(what))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn left(&self) -> u64 {
        (self.bytes.len() - self.at) as u64
    }

    /// A count of items each at least `min` bytes long, refused when they cannot all fit in
    /// what is left of the file.
    fn count(&mut self, min: u64, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        if n.checked_mul(min).is_none_or(|b| b > self.left()) {
            return Err(bad(
                self.path,
                None,
                format!("{what} is {n}, more than the {} bytes left in the file hold", self.left()),
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(1, what)?;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }

    /// A value of type `ty`; `key` names it in errors.
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue> {
        let what = format!("the value of {key:?}");
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(&what)?[0]),
            1 => GgufValue::I8(self.array::<1>(&what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(bad(self.path, None, format!("{key:?} is a bool of byte {b}"))),
            },
            8 => GgufValue::String(self.string(&what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(bad(
                        self.path,
                        None,
                        format!("{key:?} nests arrays more than {MAX_DEPTH} deep"),
                    ));
                }
                let elem = self.u32(&what)?;
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => {
                        return Err(bad(
                            self.path,
                            None,
                            format!("{key:?} is an array of unknown value type {t}"),
                        ))
                    }
                };
                let n = self.count(min, &format!("the length of array {key:?}"))?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(elem, key, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(&what)?)),
            t => return Err(bad(self.path, None, format!("{key:?} has unknown value type {t}"))),
        })
    }
}

type Header = (u32, BTreeMap<String, GgufValue>, Vec<GgufTensor>, u64);

/// Reads and checks the header of the GGUF file `bytes`.
fn read(path: &Path, bytes: &[u8]) -> Result<Header> {
    let mut r = Reader { path, bytes, at: 0 };
    if r.take(4, "the magic")? != b"GGUF" {
        return Err(bad(path, None, "not a GGUF file (its first bytes are not \"GGUF\")"));
    }
    let version = r.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(bad(
            path,
            None,
            format!("GGUF version {version}: strata reads versions 2 and 3 (little-endian)"),
        ));
    }
    // A tensor info takes at least 8 (name) + 4 (dims) + 4 (type) + 8 (offset) bytes; a
    // key-value pair 8 (key) + 4 (type) + 1.
    let n_tensors = r.count(24, "the tensor count")?;
    let n_kv = r.count(13, "the metadata count")?;
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string("a metadata key")?;
        let ty = r.u32(&format!("the type of {key:?}"))?;
        let v = r.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), v).is_some() {
            return Err(bad(path, None, format!("metadata key {key:?} appears twice")));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(GgufValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(v) => {
            return Err(bad(
                path,
                None,
                format!(
                    "general.alignment is {} {}: it must be a power-of-two uint32",
                    v.kind(),
                    v.to_text().unwrap_or_default()
                ),
            ))
        }
    };
    let mut infos = Vec::with_capacity(n_tensors);
    let mut names = HashSet::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = r.string("a tensor name")?;
        let t = Some(name.as_str());
        let n_dims = r.u32("a tensor's dimension count")? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(bad(path, t, format!("{n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")));
        }
        let mut shape = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            let d = r.u64("a tensor's dimensions")?;
            shape.push(usize::try_from(d).map_err(|_| bad(path, t, format!("dimension {d}")))?);
        }
        shape.reverse();
        let ty = r.u32("a tensor's type")?;
        let dtype = dtype_of(ty).ok_or_else(|| {
            let reads = "F32, F16, BF16, F64, I8-I64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K-Q8_K";
            bad(path, t, format!("GGML type {ty}, which strata does not read (it reads {reads})"))
        })?;
        let offset = r.u64("a tensor's offset")?;
        let size = dtype.bytes_for(&shape).map_err(|e| bad(path, t, e.to_string()))?;
        if !names.insert(name.clone()) {
            return Err(bad(path, t, "a second tensor of this name"));
        }
        if offset % alignment != 0 {
            return Err(bad(path, t, format!("offset {offset} is not a multiple of {alignment}")));
        }
        infos.push((name, dtype, shape, offset, size));
    }
    // The data starts at the next multiple of the alignment.
    let data = (r.at as u64).div_ceil(alignment) * alignment;
    let len = bytes.len() as u64;
    let mut tensors = Vec::with_capacity(infos.len());
    for (name, dtype, shape, offset, bytes) in infos {
        let start = data.checked_add(offset);
        let (Some(start), Some(end)) = (start, start.and_then(|s| s.checked_add(bytes))) else {
            return Err(bad(path, Some(&name), format!("offset {offset} overflows")));
        };
        if end > len {
            return Err(bad(
                path,
                Some(&name),
                format!(
                    "its {bytes} bytes at offset {offset} of the data (byte {start}) run past the \
                     end of the {len}-byte file: is it truncated?"
                ),
            ));
        }
        tensors.push(GgufTensor { name, dtype, shape, offset: start, bytes });
    }
    tensors.sort_by(|a, b| (a.offset, a.bytes, &a.name).cmp(&(b.offset, b.bytes, &b.name)));
    for w in tensors.windows(2) {
        if w[0].offset + w[0].bytes > w[1].offset {
            return Err(bad(
                path,
                Some(&w[1].name),
                format!("its bytes overlap {:?}'s", w[0].name),
            ));
        }
    }
    Ok((version, metadata, tensors, alignment))
}
