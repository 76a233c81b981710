//! [`StoreBackend`]: candle-nn's `SimpleBackend` over a store, so that
//! `VarBuilder::from_backend` serves a model's weights out of strata.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType as CDType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use super::{candle_dtype, read_tensor, strata_err, unsupported_dtype};
use crate::base::types::TensorId;
use crate::{LoadOptions, Loaded, Store};

/// Serves the tensors of a store to a candle-nn `VarBuilder`, under their names in the
/// checkpoint: `VarBuilder::from_backend(Box::new(backend), dtype, device)`, or
/// [`StoreBackend::into_var_builder`].
///
/// Each `get` reads the tensor from its fastest replica without promoting it (a checkpoint
/// loaded in place is read from its file; nothing is left in the store's faster tiers), copies it
/// into a candle tensor on the asked device, converts it to the asked dtype and checks its
/// shape, as `VarBuilder::from_mmaped_safetensors` does, with the same results and errors:
/// a missing tensor is `CannotFindTensor`, a wrong shape `UnexpectedShape` ("shape mismatch for
/// NAME", checked before any byte is read), a dtype candle lacks (`i8`, `u64`, `bool`,
/// `f8e5m2`) `UnsupportedSafeTensorDtype` with a context naming the tensor.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use candle_core::{DType, Device};
/// use strata as st;
/// use st::candle::StoreBackend;
///
/// let store = st::candle::store_for(&Device::Cpu, st::Store::builder())?;
/// let w = store.put("layer.weight", st::DType::F32, &[2, 2], &[0u8; 16])?;
/// let vb = StoreBackend::new(store, [("layer.weight".to_string(), w)])
///     .into_var_builder(DType::F32, &Device::Cpu);
/// let lin = candle_nn::linear_no_bias(2, 2, vb.pp("layer"))?;
/// assert_eq!(lin.weight().dims(), &[2, 2]);
/// assert!(candle_nn::linear_no_bias(2, 3, vb.pp("layer")).is_err()); // shape mismatch
/// # Ok(()) }
/// ```
pub struct StoreBackend {
    store: Arc<Store>,
    names: HashMap<String, TensorId>,
}

impl std::fmt::Debug for StoreBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreBackend").field("tensors", &self.names.len()).finish()
    }
}

impl StoreBackend {
    /// Serves these tensors of `store` under these names.
    pub fn new(store: Arc<Store>, names: impl IntoIterator<Item = (String, TensorId)>) -> Self {
        StoreBackend { store, names: names.into_iter().collect() }
    }

    /// Serves a loaded checkpoint under its tensors' names in their files (without the load's
    /// [`name_prefix`](crate::LoadOptions::name_prefix)).
    pub fn from_loaded(store: Arc<Store>, loaded: &Loaded) -> Self {
        Self::new(store, loaded.iter().map(|t| (t.name.clone(), t.id)))
    }

    /// Loads a checkpoint into `store` in place ([`Store::load_checkpoint`]: a `.safetensors`
    /// file, a sharded checkpoint's `*.index.json`, or a directory) and serves it.
    pub fn load(store: Arc<Store>, path: impl AsRef<Path>) -> candle_core::Result<Self> {
        let loaded = store.load_checkpoint(path, LoadOptions::default())?;
        Ok(Self::from_loaded(store, &loaded))
    }

    /// The store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// `VarBuilder::from_backend(Box::new(self), dtype, device.clone())`.
    pub fn into_var_builder(self, dtype: CDType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self), dtype, device.clone())
    }

    fn id(&self, name: &str) -> candle_core::Result<TensorId> {
        self.names
            .get(name)
            .copied()
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.to_string() }.bt())
    }

    /// The tensor as stored, on `dev`, after checking its shape against `want`.
    fn fetch(&self, name: &str, want: Option<&Shape>, dev: &Device) -> candle_core::Result<Tensor> {
        let id = self.id(name)?;
        let info = self.store.info(id).map_err(|e| strata_err(name, e))?;
        if candle_dtype(info.dtype).is_none() {
            return Err(unsupported_dtype(name, info.dtype));
        }
        if let Some(want) = want {
            if want.dims() != info.shape.as_slice() {
                return Err(super::shape_mismatch(name, want.dims(), &info.shape));
            }
        }
        // Without promotion: the bytes go to candle, a copy in a faster tier would be waste.
        read_tensor(&self.store, name, id, &info, dev, false)
    }
}

impl SimpleBackend for StoreBackend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: CDType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.fetch(name, Some(&s), dev)?.to_dtype(dtype)
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: CDType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.fetch(name, None, dev)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }
}
