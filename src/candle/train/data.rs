//! A run's data: token files and other inputs read within bounds ([`load_tokens`],
//! [`read_input`]), and each step's micro-batches and loss masks checked before they are used.

use std::path::Path;

use candle_core::{DType as CDType, Tensor};

use super::{invalid, LlamaConfig, TrainConfig, TrainError};

/// Reads a token stream from `path` for a model of `vocab` tokens trained on sequences of
/// `seq` tokens: u32 ids, the first tensor (by name) of a `.safetensors` file (u32), or else
/// the whole file as raw little-endian u32s. Bounded before a byte is read: the path must be a
/// regular file (a FIFO, a device such as `/dev/zero`, a socket or a directory is refused
/// without being opened for reading, so nothing blocks or reads without end), sized first and
/// read to that size, and no larger than the host memory available. Fewer than `seq + 1`
/// tokens (one sequence and its last target), a size that is not whole u32s, and ids past the
/// vocabulary are [`TrainError::BadData`] too.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let p = dir.path().join("tokens.bin");
/// std::fs::write(&p, [1u32, 2, 3, 4, 5].iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
/// assert_eq!(strata::candle::train::load_tokens(&p, 10, 4)?, vec![1, 2, 3, 4, 5]);
/// // One sequence of 8 needs 9 tokens; /dev/zero is not a regular file.
/// assert!(strata::candle::train::load_tokens(&p, 10, 8).is_err());
/// assert!(strata::candle::train::load_tokens("/dev/zero", 10, 4).is_err());
/// # Ok(()) }
/// ```
pub fn load_tokens(
    path: impl AsRef<Path>,
    vocab: usize,
    seq: usize,
) -> candle_core::Result<Vec<u32>> {
    let path = path.as_ref();
    let bad = |why: String| TrainError::BadData { path: path.to_path_buf(), why }.into_candle();
    // The bytes and the ids decoded from them.
    let bytes = read_input(path, "the token file", u64::MAX, 2, "train on a smaller file")?;
    let ids: Vec<u32> = match safetensors::SafeTensors::deserialize(&bytes) {
        Ok(st) => {
            let mut names = st.names();
            names.sort();
            let name =
                names.first().ok_or_else(|| bad("a safetensors file with no tensor".into()))?;
            let t = st.tensor(name).map_err(|e| bad(e.to_string()))?;
            if t.dtype() != safetensors::Dtype::U32 {
                return Err(bad(format!("{name} is {:?}: u32 token ids are read", t.dtype())));
            }
            t.data().chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
        Err(_) => {
            if bytes.len() % 4 != 0 {
                return Err(bad(format!(
                    "{} bytes: not a whole number of u32 token ids",
                    bytes.len()
                )));
            }
            bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
    };
    let need = seq.saturating_add(1);
    if ids.len() < need {
        return Err(bad(format!(
            "{} tokens, fewer than one sequence of {seq} and its last target ({need})",
            ids.len()
        )));
    }
    if let Some((i, bad_id)) = ids.iter().enumerate().find(|&(_, &t)| t as usize >= vocab) {
        return Err(bad(format!("token {i} is {bad_id}, past the vocabulary of {vocab}")));
    }
    Ok(ids)
}

/// The whole of an input file (`--data`, `--text`, `--jsonl`), bounded before a byte is read:
/// `path` must be a regular file (a FIFO, a device such as `/dev/zero`, a socket or a
/// directory is [`TrainError::BadData`] naming it, never opened for reading, so nothing blocks
/// or reads without end), of at most `limit` bytes, and `copies` times its size must fit the
/// host memory available ([`TrainError::TooLarge`], with `hint`). Read to the size it had when
/// looked at; a file that changed meanwhile is refused.
///
/// ```
/// use strata::candle::train::read_input;
/// assert!(read_input("/dev/zero".as_ref(), "text", 1 << 30, 1, "").is_err());
/// let dir = tempfile::tempdir().unwrap();
/// assert!(read_input(dir.path(), "text", 1 << 30, 1, "").is_err());
/// ```
pub fn read_input(
    path: &Path,
    what: &str,
    limit: u64,
    copies: u64,
    hint: &str,
) -> candle_core::Result<Vec<u8>> {
    use std::io::Read;
    let bad = |why: String| TrainError::BadData { path: path.to_path_buf(), why }.into_candle();
    let file = crate::tiers::file::open_regular(path, 0).map_err(|e| bad(e.chain()))?;
    let size = file.metadata().map_err(|e| bad(e.to_string()))?.len();
    if size > limit {
        return Err(bad(format!(
            "{} ({size} bytes): {what} may be at most {}",
            crate::format_size(size),
            crate::format_size(limit)
        )));
    }
    let asked = size.saturating_mul(copies.max(1));
    if let Some(available) = crate::host_memory_available() {
        if asked > available {
            return Err(TrainError::TooLarge {
                what: format!("{what} {} ({})", path.display(), crate::format_size(size)),
                asked,
                available,
                hint: hint.into(),
            }
            .into_candle());
        }
    }
    let len = usize::try_from(size).map_err(|_| bad(format!("{size} bytes")))?;
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(len).map_err(|_| bad(format!("{size} bytes: no memory for them")))?;
    file.take(size).read_to_end(&mut bytes).map_err(|e| bad(e.to_string()))?;
    if bytes.len() != len {
        return Err(bad(format!("{} bytes read of {size}: it changed while read", bytes.len())));
    }
    Ok(bytes)
}

/// A step's micro-batches, checked: `accum` of them, each `[micro_batch, seq + 1]` u32 token
/// ids below the vocabulary's size. Gives each one's ids (row-major), read to the host in one go:
/// one host sync for the step's tokens, before any of them is used.
pub(super) fn check_batches(
    tc: &TrainConfig,
    cfg: &LlamaConfig,
    batches: &[Tensor],
) -> candle_core::Result<Vec<Vec<u32>>> {
    if batches.len() != tc.accum {
        candle_core::bail!("{} micro-batches for a step of {}", batches.len(), tc.accum);
    }
    let mut flat = Vec::with_capacity(batches.len());
    for b in batches {
        if b.dims() != [tc.micro_batch, tc.seq + 1] || b.dtype() != CDType::U32 {
            candle_core::bail!(
                "a micro-batch of {:?} {:?}: [{}, {}] u32 token ids are needed",
                b.dims(),
                b.dtype(),
                tc.micro_batch,
                tc.seq + 1
            );
        }
        flat.push(b.flatten_all()?);
    }
    let all = Tensor::cat(&flat, 0)?.to_vec1::<u32>()?;
    if let Some(&max) = all.iter().max().filter(|&&m| m as usize >= cfg.vocab_size) {
        candle_core::bail!("token id {max} in a vocabulary of {}", cfg.vocab_size);
    }
    Ok(all.chunks(tc.micro_batch * (tc.seq + 1)).map(<[u32]>::to_vec).collect())
}

/// A step's loss masks, checked: one `[micro_batch, seq]` a micro-batch, every value 0 (the
/// target does not count) or 1, at least one target counted in the step. Gives them as f32
/// `[micro_batch · seq]` (what the loss multiplies by) and how many targets count.
pub(super) fn prepare_masks(
    tc: &TrainConfig,
    masks: &[Tensor],
) -> candle_core::Result<(Vec<Tensor>, usize)> {
    if masks.len() != tc.accum {
        candle_core::bail!("{} loss masks for a step of {} micro-batches", masks.len(), tc.accum);
    }
    let mut out = Vec::with_capacity(masks.len());
    let mut count = 0usize;
    for m in masks {
        if m.dims() != [tc.micro_batch, tc.seq] {
            candle_core::bail!(
                "a loss mask of {:?}: [{}, {}] (one flag a target) is needed",
                m.dims(),
                tc.micro_batch,
                tc.seq
            );
        }
        let f = m.to_dtype(CDType::F32)?.flatten_all()?.contiguous()?;
        let v = f.to_vec1::<f32>()?;
        if let Some(x) = v.iter().find(|&&x| x != 0.0 && x != 1.0) {
            candle_core::bail!("a loss mask holds {x}: 0 (not counted) or 1 (counted)");
        }
        count += v.iter().filter(|&&x| x == 1.0).count();
        out.push(f);
    }
    if count == 0 {
        return Err(invalid(
            "no target of the step counts in the loss (every mask is 0): leave such rows out"
                .into(),
        ));
    }
    Ok((out, count))
}
