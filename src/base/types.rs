//! Small value types: tiers, element types, tensor ids.

use std::fmt;

/// A level of the memory hierarchy, fastest first.
///
/// The order of the variants is the order of speed from the GPU's point of view: `Device < Pinned <
/// Mapped < Disk` compares "faster than".
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub enum Tier {
    /// GPU HBM (device memory).
    Device,
    /// Page-locked host memory: reached by the GPU through DMA copies on the copy engines.
    Pinned,
    /// Page-locked host memory mapped into the device's address space: kernels read it in place
    /// over PCIe (zero-copy).
    Mapped,
    /// Files on NVMe, mapped with memmap2 for CPU access.
    Disk,
}

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::Pinned, Tier::Mapped, Tier::Disk];

    /// Position in [`Tier::ALL`] (0 for `Device`).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The next slower tier, `None` for `Disk`.
    pub const fn slower(self) -> Option<Tier> {
        match self {
            Tier::Device => Some(Tier::Pinned),
            Tier::Pinned => Some(Tier::Mapped),
            Tier::Mapped => Some(Tier::Disk),
            Tier::Disk => None,
        }
    }

    /// Lower-case name, as printed and as accepted by [`str::parse`].
    pub const fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Pinned => "pinned",
            Tier::Mapped => "mapped",
            Tier::Disk => "disk",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Tier {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| crate::Error::InvalidArgument(format!("unknown tier {s:?}")))
    }
}

/// Element type of a tensor.
///
/// Printed by its lower-case name (`bf16`, `f8e4m3`, `q4_k`); parsed from that name, from its
/// name in a safetensors header (`BF16`, `F8_E4M3`) or in GGUF (`Q4_K`), in any case.
///
/// The block-quantized types (GGUF's `Q4_0` … `Q8_K`) hold a tensor as blocks of
/// [`DType::block`] elements, each block a fixed number of bytes (scales and packed quants): a
/// tensor of one is sized by [`DType::bytes_for`] (its innermost dimension a whole number of
/// blocks), moved, checksummed and saved as those bytes, and turned into `f32` by
/// [`quant::dequantize`](crate::base::quant::dequantize).
///
/// ```
/// use strata::DType;
/// assert_eq!(DType::F32.bytes_for(&[2, 3]).unwrap(), 24);
/// assert_eq!(DType::Q4_0.block(), Some((32, 18)));
/// assert_eq!(DType::Q4K.bytes_for(&[2, 512]).unwrap(), 4 * 144);
/// assert!(DType::Q4K.bytes_for(&[2, 100]).is_err()); // 100 is not a multiple of 256
/// assert_eq!("Q6_K".parse::<DType>().unwrap(), DType::Q6K);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum DType {
    /// 64-bit float.
    F64,
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit float with 4 exponent and 3 mantissa bits, no infinities (OCP FP8 E4M3, PyTorch's
    /// `float8_e4m3fn`).
    F8E4M3,
    /// 8-bit float with 5 exponent and 2 mantissa bits (OCP FP8 E5M2, PyTorch's
    /// `float8_e5m2`).
    F8E5M2,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// 16-bit signed integer.
    I16,
    /// 8-bit signed integer.
    I8,
    /// 64-bit unsigned integer.
    U64,
    /// 32-bit unsigned integer.
    U32,
    /// 16-bit unsigned integer.
    U16,
    /// 8-bit unsigned integer.
    U8,
    /// Boolean, one byte.
    Bool,
    /// GGUF `Q4_0`: blocks of 32 4-bit quants and an f16 scale (18 bytes).
    Q4_0,
    /// GGUF `Q4_1`: blocks of 32 4-bit quants, an f16 scale and an f16 minimum (20 bytes).
    Q4_1,
    /// GGUF `Q5_0`: blocks of 32 5-bit quants and an f16 scale (22 bytes).
    Q5_0,
    /// GGUF `Q5_1`: blocks of 32 5-bit quants, an f16 scale and an f16 minimum (24 bytes).
    Q5_1,
    /// GGUF `Q8_0`: blocks of 32 8-bit quants and an f16 scale (34 bytes).
    Q8_0,
    /// GGUF `Q2_K`: super-blocks of 256 2-bit quants in 16 sub-blocks with 4-bit scales and
    /// minimums (84 bytes).
    Q2K,
    /// GGUF `Q3_K`: super-blocks of 256 3-bit quants in 16 sub-blocks with 6-bit scales
    /// (110 bytes).
    Q3K,
    /// GGUF `Q4_K`: super-blocks of 256 4-bit quants in 8 sub-blocks with 6-bit scales and
    /// minimums (144 bytes).
    Q4K,
    /// GGUF `Q5_K`: super-blocks of 256 5-bit quants in 8 sub-blocks with 6-bit scales and
    /// minimums (176 bytes).
    Q5K,
    /// GGUF `Q6_K`: super-blocks of 256 6-bit quants in 16 sub-blocks with 8-bit scales
    /// (210 bytes).
    Q6K,
    /// GGUF `Q8_K`: super-blocks of 256 8-bit quants with an f32 scale and 16 partial sums
    /// (292 bytes; llama.cpp's intermediate type for dot products).
    Q8K,
}

impl DType {
    /// Every dtype.
    pub const ALL: [DType; 26] = [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U64,
        DType::U32,
        DType::U16,
        DType::U8,
        DType::Bool,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::Q8K,
    ];

    /// Size of one element in bytes; for a block-quantized dtype, of one block (see
    /// [`DType::block`]: size a tensor with [`DType::bytes_for`]).
    pub const fn size_of(self) -> usize {
        match self.block() {
            Some((_, bytes)) => bytes,
            None => match self {
                DType::F64 | DType::I64 | DType::U64 => 8,
                DType::F32 | DType::I32 | DType::U32 => 4,
                DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
                _ => 1,
            },
        }
    }

    /// For a block-quantized dtype, `(elements, bytes)` of one block; `None` for the others.
    pub const fn block(self) -> Option<(usize, usize)> {
        Some(match self {
            DType::Q4_0 => (32, 18),
            DType::Q4_1 => (32, 20),
            DType::Q5_0 => (32, 22),
            DType::Q5_1 => (32, 24),
            DType::Q8_0 => (32, 34),
            DType::Q2K => (256, 84),
            DType::Q3K => (256, 110),
            DType::Q4K => (256, 144),
            DType::Q5K => (256, 176),
            DType::Q6K => (256, 210),
            DType::Q8K => (256, 292),
            _ => return None,
        })
    }

    /// Whether it is block-quantized (GGUF's `Q4_0` … `Q8_K`).
    pub const fn is_quantized(self) -> bool {
        self.block().is_some()
    }

    /// Bytes of a tensor of this dtype and `shape`: elements × [`DType::size_of`], or for a
    /// block-quantized dtype rows × blocks per row × block bytes. [`Error::BadShape`] when the
    /// count overflows, or when a quantized tensor's innermost dimension is not a whole number of
    /// blocks (or it has no dimension).
    ///
    /// [`Error::BadShape`]: crate::Error::BadShape
    ///
    /// ```
    /// use strata::DType;
    /// assert_eq!(DType::BF16.bytes_for(&[4, 4]).unwrap(), 32);
    /// assert_eq!(DType::Q8_0.bytes_for(&[3, 64]).unwrap(), 3 * 2 * 34);
    /// let e = DType::Q8_0.bytes_for(&[3, 48]).unwrap_err();
    /// assert!(e.to_string().contains("multiple of 32"), "{e}");
    /// ```
    pub fn bytes_for(self, shape: &[usize]) -> crate::Result<u64> {
        let overflow = || crate::Error::BadShape {
            shape: shape.to_vec(),
            why: "element count overflows".into(),
        };
        let Some((elems, bytes)) = self.block() else {
            return shape
                .iter()
                .try_fold(self.size_of() as u64, |acc, &d| acc.checked_mul(d as u64))
                .ok_or_else(overflow);
        };
        let Some((&inner, outer)) = shape.split_last() else {
            return Err(crate::Error::BadShape {
                shape: vec![],
                why: format!("a {self} tensor needs a dimension of blocks of {elems}"),
            });
        };
        if inner % elems != 0 {
            return Err(crate::Error::BadShape {
                shape: shape.to_vec(),
                why: format!(
                    "the innermost dimension of a {self} tensor must be a multiple of {elems} \
                     (its block), not {inner}"
                ),
            });
        }
        outer
            .iter()
            .try_fold(bytes as u64, |acc, &d| acc.checked_mul(d as u64))
            .and_then(|acc| acc.checked_mul((inner / elems) as u64))
            .ok_or_else(overflow)
    }

    /// Whether it is a floating-point type (f64, f32, f16, bf16 and the two FP8 types).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DType::F64 | DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
        )
    }

    /// Lower-case name, as printed: `f32`, `bf16`, `f8e4m3`, `u16`, `bool`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I16 => "i16",
            DType::I8 => "i8",
            DType::U64 => "u64",
            DType::U32 => "u32",
            DType::U16 => "u16",
            DType::U8 => "u8",
            DType::Bool => "bool",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q8_0 => "q8_0",
            DType::Q2K => "q2_k",
            DType::Q3K => "q3_k",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
            DType::Q8K => "q8_k",
        }
    }

    /// Its name in a safetensors header (`F32`, `BF16`, `F8_E4M3`, `U16`, `BOOL`); `None` for
    /// the block-quantized dtypes, which safetensors cannot hold.
    pub const fn safetensors_name(self) -> Option<&'static str> {
        Some(match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U64 => "U64",
            DType::U32 => "U32",
            DType::U16 => "U16",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::Error;
    /// A dtype by [`DType::name`] or [`DType::safetensors_name`], in any case: `bf16`, `BF16`,
    /// `f8e4m3`, `F8_E4M3`.
    fn from_str(s: &str) -> crate::Result<DType> {
        let s = s.trim();
        DType::ALL
            .into_iter()
            .find(|d| {
                d.name().eq_ignore_ascii_case(s)
                    || d.safetensors_name().is_some_and(|n| n.eq_ignore_ascii_case(s))
            })
            .ok_or_else(|| {
                let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
                crate::Error::InvalidArgument(format!(
                    "unknown dtype {s:?} (one of {})",
                    names.join(", ")
                ))
            })
    }
}

/// Handle of a tensor in a [`Store`](crate::Store).
///
/// An id names one tensor of one store: it never names another tensor later (a removed tensor's
/// id stays invalid), and an id of another store is [`Error::UnknownId`](crate::Error::UnknownId)
/// there. Ids compare in the order their tensors were created. Printed as `#n`, `n` counting
/// the store's tensors from 0.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId {
    store: u32,
    seq: u64,
    slot: u32,
}

impl TensorId {
    pub(crate) const fn new(store: u32, seq: u64, slot: u32) -> TensorId {
        TensorId { store, seq, slot }
    }

    pub(crate) const fn store(self) -> u32 {
        self.store
    }

    pub(crate) const fn seq(self) -> u64 {
        self.seq
    }

    pub(crate) const fn slot(self) -> u32 {
        self.slot
    }

    /// The tensor's number in its store: unique, never reused, in creation order.
    pub const fn as_u64(self) -> u64 {
        self.seq
    }

    /// An id for unit tests of policies: tensor `n` of store 0.
    #[cfg(test)]
    pub(crate) const fn test(n: u32) -> TensorId {
        TensorId::new(0, n as u64, n)
    }
}

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.seq)
    }
}

impl fmt::Debug for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TensorId({})", self.seq)
    }
}

/// What a tensor is for in training, for the memory accounting in [`Stats`](crate::Stats)
/// (bytes per group and tier). Chosen at [`Store::put_group`](crate::Store::put_group) or
/// changed with [`Store::set_group`](crate::Store::set_group); [`Store::put`](crate::Store::put)
/// gives `Other`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default, PartialOrd, Ord)]
pub enum Group {
    /// Model parameters (weights).
    Param,
    /// Gradients.
    Grad,
    /// Optimizer state: master weights, moments.
    OptimizerState,
    /// Activations kept for the backward pass.
    Activation,
    /// Anything else.
    #[default]
    Other,
}

impl Group {
    /// Every group.
    pub const ALL: [Group; 5] =
        [Group::Param, Group::Grad, Group::OptimizerState, Group::Activation, Group::Other];

    /// Position in [`Group::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Group::Param => "param",
            Group::Grad => "grad",
            Group::OptimizerState => "optimizer",
            Group::Activation => "activation",
            Group::Other => "other",
        }
    }
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which backend a store runs on.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum BackendKind {
    /// Tiers emulated in host memory; copies on worker threads. Used where there is no GPU.
    Host,
    /// NVIDIA GPU through the CUDA driver API (cudarc).
    Cuda,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Host => "host (no GPU: tiers emulated in host memory)",
            BackendKind::Cuda => "cuda",
        })
    }
}

/// Parses a byte size with an optional unit: `4096`, `24KiB`, `1.5GiB`, `64MB`, `1g`.
///
/// Binary units (`KiB`, `MiB`, `GiB`, `TiB`, and the short `K`, `M`, `G`, `T`) are powers of 1024;
/// decimal units (`KB`, `MB`, `GB`, `TB`) are powers of 1000.
///
/// ```
/// assert_eq!(strata::parse_size("24KiB").unwrap(), 24 * 1024);
/// assert_eq!(strata::parse_size("1GB").unwrap(), 1_000_000_000);
/// assert!(strata::parse_size("12 apples").is_err());
/// ```
pub fn parse_size(s: &str) -> crate::Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || crate::Error::InvalidArgument(format!("bad size {s:?} (try 4096, 24KiB, 1GiB)"));
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    if num.is_empty() {
        return Err(bad());
    }
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(bad);
    }
    let f: f64 = num.parse().map_err(|_| bad())?;
    let v = f * mult as f64;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(v.round() as u64)
}

/// Formats a byte count with a binary unit: `1.50 GiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_order_fastest_first() {
        assert!(Tier::Device < Tier::Pinned && Tier::Mapped < Tier::Disk);
        assert_eq!(Tier::Mapped.slower(), Some(Tier::Disk));
        assert_eq!("PINNED".parse::<Tier>().unwrap(), Tier::Pinned);
        assert!("hbm".parse::<Tier>().is_err());
    }

    #[test]
    fn dtypes_parse_by_either_name_and_print_lower_case() {
        for d in DType::ALL {
            assert_eq!(d.to_string().parse::<DType>().unwrap(), d, "{d}");
            if let Some(n) = d.safetensors_name() {
                assert_eq!(n.parse::<DType>().unwrap(), d, "{d}");
            }
            assert_eq!(d.name().to_ascii_uppercase().parse::<DType>().unwrap(), d, "{d}");
        }
        assert_eq!("F8_E4M3".parse::<DType>().unwrap(), DType::F8E4M3);
        assert_eq!("f8_e5m2".parse::<DType>().unwrap(), DType::F8E5M2);
        assert_eq!(" u16 ".parse::<DType>().unwrap(), DType::U16);
        assert_eq!(DType::F8E4M3.to_string(), "f8e4m3");
        assert_eq!((DType::U64.size_of(), DType::U32.size_of(), DType::U16.size_of()), (8, 4, 2));
        assert_eq!((DType::F8E4M3.size_of(), DType::F8E5M2.size_of()), (1, 1));
        assert!(DType::F8E5M2.is_float() && !DType::U32.is_float() && !DType::Bool.is_float());
        assert_eq!("Q2_K".parse::<DType>().unwrap(), DType::Q2K);
        assert_eq!(DType::Q5_1.safetensors_name(), None);
        for bad in ["", "f8", "float", "F8_E8M0", "c64", "u128", "q4", "Q8_1", "IQ4_NL"] {
            let e = bad.parse::<DType>().unwrap_err().to_string();
            assert!(e.contains("unknown dtype") && e.contains("f8e4m3"), "{bad}: {e}");
        }
    }

    #[test]
    fn quantized_dtypes_are_sized_by_whole_blocks() {
        for d in DType::ALL {
            let Some((elems, bytes)) = d.block() else {
                assert_eq!(d.bytes_for(&[3, 5]).unwrap(), 15 * d.size_of() as u64, "{d}");
                continue;
            };
            assert!(d.is_quantized() && !d.is_float(), "{d}");
            assert_eq!(d.bytes_for(&[2, 3, 2 * elems]).unwrap(), 12 * bytes as u64, "{d}");
            assert_eq!(d.bytes_for(&[0, elems]).unwrap(), 0, "{d}");
            for bad in [&[elems + 1][..], &[4, elems / 2], &[]] {
                let e = d.bytes_for(bad).unwrap_err();
                assert!(matches!(e, crate::Error::BadShape { .. }), "{d} {bad:?}: {e}");
            }
            let huge = d.bytes_for(&[usize::MAX, usize::MAX / elems * elems]).unwrap_err();
            assert!(huge.to_string().contains("overflows"), "{d}: {huge}");
        }
        assert_eq!(DType::Q8K.block(), Some((256, 292)));
        assert_eq!(DType::Q3K.block(), Some((256, 110)));
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("24KiB").unwrap(), 24 << 10);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
        assert_eq!(parse_size("7").unwrap(), 7);
        assert_eq!(parse_size("2MB").unwrap(), 2_000_000);
        for bad in ["", "GiB", "1QiB", "-1", "1e99GiB", "99999999999999999999"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert_eq!(format_size(1536), "1.50 KiB");
    }
}
