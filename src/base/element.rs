//! Rust element types of tensors, for the typed API ([`Store::put_slice`],
//! [`Store::read_vec`], typed views).
//!
//! [`Store::put_slice`]: crate::Store::put_slice
//! [`Store::read_vec`]: crate::Store::read_vec

use crate::base::types::DType;

/// A Rust type that holds one element of a tensor of dtype [`Element::DTYPE`]: `f64`, `f32`,
/// [`half::f16`], [`half::bf16`], `i64`, `i32`, `i16`, `i8`, `u64`, `u32`, `u16`, `u8` and `bool`.
/// The FP8 dtypes have no Rust type here: read and write their bytes.
///
/// Values are in native byte order, as in the byte API (`put`, `read`, `write`).
///
/// ```
/// # fn main() -> strata::Result<()> {
/// use strata::{DType, Element, Store};
/// let store = Store::builder().host_backend().build()?;
/// let w = store.put_slice("w", &[2, 2], &[1.0f32, 2.0, 3.0, 4.0])?;
/// assert_eq!(store.info(w)?.dtype, <f32 as Element>::DTYPE);
/// assert_eq!(store.read_vec::<f32>(w)?, [1.0, 2.0, 3.0, 4.0]);
/// assert!(store.read_vec::<half::bf16>(w).is_err()); // an f32 tensor read as bf16
/// # Ok(()) }
/// ```
pub trait Element:
    sealed::Sealed
    + Copy
    + PartialEq
    + Send
    + Sync
    + std::fmt::Debug
    + cudarc::driver::DeviceRepr
    + 'static
{
    /// The dtype of tensors of this type.
    const DTYPE: DType;
}

pub(crate) mod sealed {
    /// The conversions of an element type to and from bytes (not for other crates' types: the
    /// casts below are sound only for these).
    pub trait Sealed: Sized {
        /// The values' bytes.
        fn as_bytes(vals: &[Self]) -> &[u8];
        /// Bytes as values: `None` when they are misaligned, not a whole number of values, or
        /// (for `bool`) not all 0 or 1.
        fn from_bytes(bytes: &[u8]) -> Option<&[Self]>;
        /// [`Sealed::from_bytes`], for writing.
        fn from_bytes_mut(bytes: &mut [u8]) -> Option<&mut [Self]>;
        /// Values copied out of bytes of any alignment (`None` as for [`Sealed::from_bytes`]).
        fn to_vec(bytes: &[u8]) -> Option<Vec<Self>>;
        /// A buffer of `n` values to read into, as bytes (`None` for `bool`, which not every
        /// byte is).
        fn zeroed_vec(n: usize) -> Option<Vec<Self>>;
        /// A buffer's bytes, for writing.
        fn bytes_mut(vals: &mut [Self]) -> &mut [u8];
    }
}

macro_rules! pod_element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {
            fn as_bytes(vals: &[Self]) -> &[u8] {
                bytemuck::cast_slice(vals)
            }
            fn from_bytes(bytes: &[u8]) -> Option<&[Self]> {
                bytemuck::try_cast_slice(bytes).ok()
            }
            fn from_bytes_mut(bytes: &mut [u8]) -> Option<&mut [Self]> {
                bytemuck::try_cast_slice_mut(bytes).ok()
            }
            fn to_vec(bytes: &[u8]) -> Option<Vec<Self>> {
                if bytes.len() % std::mem::size_of::<Self>() != 0 {
                    return None;
                }
                let mut out = vec![<$t as bytemuck::Zeroable>::zeroed(); bytes.len() / std::mem::size_of::<Self>()];
                bytemuck::cast_slice_mut::<$t, u8>(&mut out).copy_from_slice(bytes);
                Some(out)
            }
            fn zeroed_vec(n: usize) -> Option<Vec<Self>> {
                Some(vec![<$t as bytemuck::Zeroable>::zeroed(); n])
            }
            fn bytes_mut(vals: &mut [Self]) -> &mut [u8] {
                bytemuck::cast_slice_mut(vals)
            }
        }
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

pod_element! {
    f64 => F64, f32 => F32, half::f16 => F16, half::bf16 => BF16,
    i64 => I64, i32 => I32, i16 => I16, i8 => I8,
    u64 => U64, u32 => U32, u16 => U16, u8 => U8,
}

impl sealed::Sealed for bool {
    fn as_bytes(vals: &[Self]) -> &[u8] {
        bytemuck::cast_slice(vals)
    }
    fn from_bytes(bytes: &[u8]) -> Option<&[Self]> {
        bytemuck::checked::try_cast_slice(bytes).ok()
    }
    fn from_bytes_mut(bytes: &mut [u8]) -> Option<&mut [Self]> {
        bytemuck::checked::try_cast_slice_mut(bytes).ok()
    }
    fn to_vec(bytes: &[u8]) -> Option<Vec<Self>> {
        bytes
            .iter()
            .map(|&b| match b {
                0 => Some(false),
                1 => Some(true),
                _ => None,
            })
            .collect()
    }
    fn zeroed_vec(_: usize) -> Option<Vec<Self>> {
        None
    }
    fn bytes_mut(vals: &mut [Self]) -> &mut [u8] {
        // Never called: `zeroed_vec` gives no buffer for bool. A bool's bytes may only be
        // written with 0 or 1, which a `&mut [u8]` does not promise.
        let _ = vals;
        &mut []
    }
}

impl Element for bool {
    const DTYPE: DType = DType::Bool;
}

/// How to read a tensor of `dtype` with the typed API (for error messages).
pub(crate) fn how_to_read(dtype: DType) -> &'static str {
    match dtype {
        DType::F64 => "read it as f64",
        DType::F32 => "read it as f32",
        DType::F16 => "read it as half::f16",
        DType::BF16 => "read it as half::bf16",
        DType::F8E4M3 | DType::F8E5M2 => "read its bytes (FP8 has no Rust type here)",
        DType::I64 => "read it as i64",
        DType::I32 => "read it as i32",
        DType::I16 => "read it as i16",
        DType::I8 => "read it as i8",
        DType::U64 => "read it as u64",
        DType::U32 => "read it as u32",
        DType::U16 => "read it as u16",
        DType::U8 => "read it as u8",
        DType::Bool => "read it as bool",
        _ => "read its bytes, or dequantize them with strata::quant::dequantize",
    }
}

#[cfg(test)]
mod tests {
    use super::sealed::Sealed;
    use super::*;

    #[test]
    fn every_element_has_its_dtypes_size() {
        fn check<T: Element>() {
            assert_eq!(std::mem::size_of::<T>(), T::DTYPE.size_of(), "{}", T::DTYPE);
        }
        check::<f64>();
        check::<f32>();
        check::<half::f16>();
        check::<half::bf16>();
        check::<i64>();
        check::<i32>();
        check::<i16>();
        check::<i8>();
        check::<u64>();
        check::<u32>();
        check::<u16>();
        check::<u8>();
        check::<bool>();
    }

    #[test]
    fn bytes_round_trip_and_bad_bytes_are_refused() {
        let v = [1.5f32, -2.0, 3.25];
        let b = <f32 as Sealed>::as_bytes(&v).to_vec();
        assert_eq!(<f32 as Sealed>::to_vec(&b).unwrap(), v);
        assert_eq!(<f32 as Sealed>::to_vec(&b[1..]), None, "not a whole number of f32s");
        // Misaligned by one byte: no in-place cast, but a copy works.
        let mut shifted = vec![0u8; b.len() + 1];
        shifted[1..].copy_from_slice(&b);
        assert!(<f32 as Sealed>::from_bytes(&shifted[1..]).is_none());
        assert_eq!(<f32 as Sealed>::to_vec(&shifted[1..]).unwrap(), v);
        assert_eq!(<bool as Sealed>::to_vec(&[0, 1, 1]).unwrap(), [false, true, true]);
        assert_eq!(<bool as Sealed>::to_vec(&[0, 2]), None, "2 is no bool");
        assert!(<bool as Sealed>::from_bytes(&[3]).is_none());
    }
}
