//! [`Layers`]: one layer's weights at a time, handed to candle through the store's device views,
//! the next layer prefetched meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType as CDType, Device, Tensor};
use candle_nn::VarBuilder;
use parking_lot::Mutex;

use super::{
    candle_dtype, read_tensor, strata_err, stream_for, tensor_from_bytes, unsupported_dtype,
};
use crate::base::types::{TensorId, Tier};
use crate::{Loaded, Store, Stream};

/// What [`Layers`] handed to candle, and what it cost beside the store's own moves (which
/// [`Store::stats`] counts).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Transfers {
    /// Tensors handed to candle.
    pub tensors: u64,
    /// Bytes copied out of the store's device views into candle-owned memory: device to device
    /// on CUDA, a host memcpy on the CPU.
    pub view_copy_bytes: u64,
    /// Seconds those copies took: measured with CUDA events on candle's stream, or on the wall
    /// clock on the CPU.
    pub view_copy_seconds: f64,
    /// Bytes copied to candle from a host replica (read in place, not through the Device
    /// tier): tensors the Device tier cannot hold (too large for it, or no room beside what is
    /// held there), and on CUDA the `u16` and `f8e4m3` tensors.
    pub host_copy_bytes: u64,
    /// Bytes of rows gathered on the host for [`Layers::gather_rows`] and copied to candle.
    pub gathered_bytes: u64,
}

/// Hands candle the weights of one layer at a time, fetched through the store: the out-of-core
/// loop of a candle model.
///
/// [`Layers::fetch`] takes the names of this layer's tensors and of the next layer's. It
/// prefetches the next layer (as far as the prefetch budget allows; the rest starts as this
/// layer's tensors are used), takes a device view of each of this layer's tensors (waiting, in
/// stream order, only for its own copy), copies it into a candle tensor on the candle device,
/// and releases the store's copy at once, so that while candle computes this layer the store
/// brings in the next one. The candle tensors are candle's own (see the module docs for why);
/// they live as long as the [`LayerWeights`] (and any clone of them candle keeps).
///
/// - **CPU** ([`Device::Cpu`], a store on the host backend): the views are the host memory of
///   the store's Device tier; one memcpy per tensor into candle's buffer.
/// - **CUDA** (feature `candle-cuda`, a store in the candle device's context): the views are
///   on candle's own stream, and the copy into candle's buffer is device to device on that
///   stream, issued without a host wait: no host round trip.
///
/// A tensor too large for the Device tier is read from a host replica (or its file) instead;
/// [`Transfers::host_copy_bytes`] counts those bytes.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{DType, Device, Module};
/// use strata as st;
/// use st::candle::Layers;
///
/// let device = Device::Cpu;
/// // A Device tier of 64 KiB for eight 16 KiB layers.
/// let store = st::candle::store_for(
///     &device,
///     st::Store::builder().capacity(st::Tier::Device, 64 << 10).prefetch_budget(64 << 10),
/// )?;
/// let mut names = Vec::new();
/// for l in 0..8 {
///     let name = format!("layer.{l}.weight");
///     let id = store.put_group(&name, st::Group::Param, st::DType::F32, &[64, 64],
///         &vec![0u8; 64 * 64 * 4])?;
///     names.push((name, id));
/// }
/// let layers = Layers::new(store.clone(), names.clone(), &device)?;
/// let mut x = candle_core::Tensor::ones((1, 64), DType::F32, &device)?;
/// for l in 0..8 {
///     let next: Vec<&str> = names.get(l + 1).map(|(n, _)| n.as_str()).into_iter().collect();
///     let w = layers.fetch(&[names[l].0.as_str()], &next)?;
///     let lin = candle_nn::linear_no_bias(64, 64, w.var_builder(DType::F32).pp(format!("layer.{l}")))?;
///     x = lin.forward(&x)?;
/// } // each layer's weights are dropped here, after the layer
/// assert_eq!(layers.transfers()?.tensors, 8);
/// # Ok(()) }
/// ```
pub struct Layers {
    store: Arc<Store>,
    device: Device,
    stream: Stream,
    names: BTreeMap<String, TensorId>,
    /// The Device tier's budget: larger tensors are served from host memory.
    device_capacity: u64,
    transfers: Mutex<Counted>,
}

#[derive(Default)]
struct Counted {
    t: Transfers,
    #[cfg(feature = "candle-cuda")]
    timers: Vec<super::cuda::CopyTimer>,
}

impl std::fmt::Debug for Layers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layers")
            .field("device", &self.device)
            .field("tensors", &self.names.len())
            .finish()
    }
}

impl Layers {
    /// Serves these tensors of `store` to candle on `device`, under these names. The store must
    /// go with the device ([`store_for`](super::store_for) builds one that does): a host-backend
    /// store for [`Device::Cpu`], a CUDA store in the device's context for a CUDA device;
    /// otherwise [`Error::BackendMismatch`](crate::Error::BackendMismatch).
    pub fn new(
        store: Arc<Store>,
        names: impl IntoIterator<Item = (String, TensorId)>,
        device: &Device,
    ) -> candle_core::Result<Layers> {
        let stream = stream_for(&store, device)?;
        let device_capacity = store.stats().capacity(Tier::Device);
        Ok(Layers {
            store,
            device: device.clone(),
            stream,
            names: names.into_iter().collect(),
            device_capacity,
            transfers: Mutex::new(Counted::default()),
        })
    }

    /// [`Layers::new`] over a loaded checkpoint, under the tensors' names in their files.
    pub fn from_loaded(
        store: Arc<Store>,
        loaded: &Loaded,
        device: &Device,
    ) -> candle_core::Result<Layers> {
        Self::new(store, loaded.iter().map(|t| (t.name.clone(), t.id)), device)
    }

    /// Serves one more tensor of the store under `name` (one made after the [`Layers`], such as
    /// an optimizer's gradient that needs the [`Layers`]' stream to be made).
    pub(crate) fn serve(&mut self, name: String, id: TensorId) {
        self.names.insert(name, id);
    }

    /// The store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The store stream the views are taken on (candle's own stream on CUDA).
    pub(crate) fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The candle device the tensors are handed to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The id of the tensor served under `name`.
    pub fn id(&self, name: &str) -> Option<TensorId> {
        self.names.get(name).copied()
    }

    /// The names served that start with `prefix`, in order: `names_under("encoder.layer.3.")`
    /// is layer 3's tensors.
    pub fn names_under(&self, prefix: &str) -> Vec<&str> {
        self.names
            .range(prefix.to_string()..)
            .take_while(|(n, _)| n.starts_with(prefix))
            .map(|(n, _)| n.as_str())
            .collect()
    }

    /// What was handed to candle so far. On CUDA, reading the copy times waits for the copies
    /// issued so far to complete.
    pub fn transfers(&self) -> candle_core::Result<Transfers> {
        #[allow(unused_mut)]
        let mut c = self.transfers.lock();
        #[cfg(feature = "candle-cuda")]
        while let Some(timer) = c.timers.pop() {
            let seconds = timer.seconds()?;
            c.t.view_copy_seconds += seconds;
        }
        Ok(c.t)
    }

    fn resolve(&self, names: &[&str]) -> candle_core::Result<Vec<TensorId>> {
        names
            .iter()
            .map(|&n| {
                self.id(n).ok_or_else(|| {
                    candle_core::Error::CannotFindTensor { path: n.to_string() }.bt()
                })
            })
            .collect()
    }

    /// Starts bringing these tensors to the Device tier (those that fit it) and returns at once.
    pub fn prefetch(&self, names: &[&str]) -> candle_core::Result<()> {
        let ids = self.resolve(names)?;
        let mut fit = Vec::with_capacity(ids.len());
        for (&id, name) in ids.iter().zip(names) {
            let info = self.store.info(id).map_err(|e| strata_err(name, e))?;
            if info.bytes <= self.device_capacity {
                fit.push(id);
            }
        }
        self.store.prefetch(&fit).map_err(|e| strata_err(names.join(", ").as_str(), e))
    }

    /// [`Layers::prefetch`] of store tensors by id (not necessarily served by name: a KV
    /// cache's), those the Device tier can hold.
    pub(crate) fn prefetch_ids(&self, ids: &[TensorId]) -> candle_core::Result<()> {
        let mut fit = Vec::with_capacity(ids.len());
        for &id in ids {
            let info = self.store.info(id)?;
            if info.bytes <= self.device_capacity {
                fit.push(id);
            }
        }
        Ok(self.store.prefetch(&fit)?)
    }

    /// This layer's weights, as candle tensors on the candle device, under their names; `next`
    /// names the next layer's tensors, prefetched meanwhile (empty for none). The store's
    /// copies are released as soon as candle has its own, so that the next layer can take
    /// their place while candle computes this one.
    ///
    /// The tensors keep their stored dtype (converted as candle's safetensors loader converts
    /// it: `u16` to `u32`); [`LayerWeights::var_builder`] converts to the model's dtype. A name
    /// not served is `CannotFindTensor`; a dtype candle lacks is `UnsupportedSafeTensorDtype`
    /// naming the tensor.
    pub fn fetch(&self, uses: &[&str], next: &[&str]) -> candle_core::Result<LayerWeights> {
        self.fetch_joined(uses, next, &[])
    }

    /// [`Layers::fetch`], with each group of `joined` (names among `uses`: 2-D weights of one
    /// dtype and one column count, in the order their rows stack) copied into one tensor of
    /// their rows stacked, [`LayerWeights::joined`], whose row ranges are the group's tensors
    /// (views, no copy of their own): the weights a joined GEMM reads
    /// ([`Weights::join_stacked`](super::block::Weights::join_stacked)) without concatenating
    /// them again. On the CPU, where the copy into candle is on the step's cores; elsewhere, and
    /// for a group that does not qualify (a name not in `uses` or given twice, a quantized or
    /// 1-D tensor, mixed dtypes or widths), the group's tensors are fetched one by one as
    /// `fetch` does.
    pub fn fetch_joined(
        &self,
        uses: &[&str],
        next: &[&str],
        joined: &[Vec<String>],
    ) -> candle_core::Result<LayerWeights> {
        self.fetch_inner(uses, next, joined, &[])
    }

    /// [`Layers::fetch`], with the tensors named in `vars` made candle variables as they are
    /// copied into candle: `Var::from_tensor` then takes each without a copy of its own (it
    /// copies a plain tensor). For the weights a step trains through candle's autograd (a tied
    /// embedding table read as the head, say), one copy of each instead of two.
    ///
    /// ```
    /// # fn main() -> candle_core::Result<()> {
    /// use candle_core::{Device, Var};
    /// use strata as st;
    /// let store = st::candle::store_for(&Device::Cpu, st::Store::builder())?;
    /// let id = store.put("head", st::DType::F32, &[2], &[0u8; 8])?;
    /// let layers = st::candle::Layers::new(store, [("head".to_string(), id)], &Device::Cpu)?;
    /// let w = layers.fetch_vars(&["head"], &[], &["head"])?;
    /// assert!(w.get("head").unwrap().is_variable());
    /// let v = Var::from_tensor(w.get("head").unwrap())?; // the same storage, no copy
    /// # Ok(()) }
    /// ```
    pub fn fetch_vars(
        &self,
        uses: &[&str],
        next: &[&str],
        vars: &[&str],
    ) -> candle_core::Result<LayerWeights> {
        self.fetch_inner(uses, next, &[], vars)
    }

    fn fetch_inner(
        &self,
        uses: &[&str],
        next: &[&str],
        joined: &[Vec<String>],
        vars: &[&str],
    ) -> candle_core::Result<LayerWeights> {
        // Every name and dtype checked before anything moves: a fetch refused for a bad input
        // leaves the store as it was.
        let ids = self.resolve(uses)?;
        let mut infos = Vec::with_capacity(ids.len());
        for (&id, &name) in ids.iter().zip(uses) {
            let info = self.store.info(id).map_err(|e| strata_err(name, e))?;
            if candle_dtype(info.dtype).is_none() {
                return Err(unsupported_dtype(name, info.dtype));
            }
            infos.push(info);
        }
        self.prefetch(next)?;
        let mut tensors = HashMap::with_capacity(uses.len());
        let mut on_device = Vec::with_capacity(ids.len());
        let mut stacks = Vec::new();
        let res = (|| -> candle_core::Result<()> {
            for group in joined {
                if group.iter().any(|n| tensors.contains_key(n) || vars.contains(&n.as_str())) {
                    // In a group stacked already (handed over once), or a variable (whose rows
                    // cannot be a view of another tensor).
                    continue;
                }
                let Some(parts) = self.stackable(group, uses, &ids, &infos) else { continue };
                let stacked = self.stack(&parts, &mut on_device)?;
                let mut row = 0;
                for (name, _, info) in &parts {
                    tensors.insert(name.to_string(), stacked.narrow(0, row, info.shape[0])?);
                    row += info.shape[0];
                }
                self.transfers.lock().t.tensors += parts.len() as u64;
                stacks.push((group.clone(), stacked));
            }
            for ((&id, &name), info) in ids.iter().zip(uses).zip(&infos) {
                if tensors.contains_key(name) {
                    continue; // named twice, or stacked: handed over once
                }
                let var = vars.contains(&name);
                let t = match self.through_view(name, id, info, var)? {
                    Some(t) => {
                        on_device.push(id);
                        t
                    }
                    None => {
                        let t = read_tensor(&self.store, name, id, info, &self.device, var)?;
                        self.transfers.lock().t.host_copy_bytes += info.bytes;
                        t
                    }
                };
                self.transfers.lock().t.tensors += 1;
                tensors.insert(name.to_string(), t);
            }
            Ok(())
        })();
        // Done with the store's copies (also when a copy failed): they are the first to make
        // room for the next layer.
        let released = self.store.release(&on_device);
        res?;
        released.map_err(|e| strata_err(uses.join(", ").as_str(), e))?;
        Ok(LayerWeights { tensors, joined: stacks, device: self.device.clone() })
    }

    /// The members of `group` with their ids and infos when they can be stacked
    /// ([`Layers::fetch_joined`]): on the CPU, each named once in `group` and present in `uses`,
    /// 2-D, of one float dtype and one column count.
    fn stackable<'a>(
        &self,
        group: &'a [String],
        uses: &[&str],
        ids: &[TensorId],
        infos: &'a [crate::TensorInfo],
    ) -> Option<Vec<(&'a str, TensorId, &'a crate::TensorInfo)>> {
        if !self.device.is_cpu() || group.len() < 2 {
            return None;
        }
        let mut parts = Vec::with_capacity(group.len());
        for (i, name) in group.iter().enumerate() {
            if group[..i].contains(name) {
                return None;
            }
            let at = uses.iter().position(|u| u == name)?;
            parts.push((name.as_str(), ids[at], &infos[at]));
        }
        let (_, _, first) = parts[0];
        let same = |info: &crate::TensorInfo| {
            info.dtype == first.dtype && info.shape.len() == 2 && info.shape[1] == first.shape[1]
        };
        (matches!(first.dtype, crate::DType::F32 | crate::DType::BF16 | crate::DType::F16)
            && parts.iter().all(|(_, _, info)| same(info)))
        .then_some(parts)
    }

    /// `parts`' values, rows stacked, in one candle tensor: each copied once, from its Device
    /// tier copy through a view where the tier holds it (its id then in `on_device`, to be
    /// released), else from host memory.
    fn stack(
        &self,
        parts: &[(&str, TensorId, &crate::TensorInfo)],
        on_device: &mut Vec<TensorId>,
    ) -> candle_core::Result<Tensor> {
        let rows: usize = parts.iter().map(|(_, _, i)| i.shape[0]).sum();
        let cols = parts[0].2.shape[1];
        fn stacked<T: bytemuck::Pod + candle_core::WithDType>(
            layers: &Layers,
            parts: &[(&str, TensorId, &crate::TensorInfo)],
            on_device: &mut Vec<TensorId>,
            shape: (usize, usize),
        ) -> candle_core::Result<Tensor> {
            let mut v: Vec<T> = Vec::with_capacity(shape.0 * shape.1);
            let extend = super::extend_from_bytes::<T>;
            for &(name, id, info) in parts {
                if layers.with_view_bytes(name, id, info, |b| extend(&mut v, b))?.is_some() {
                    on_device.push(id);
                } else {
                    let b = super::wait_for_writer(|| layers.store.read_in_place(id))
                        .map_err(|e| strata_err(name, e))?;
                    extend(&mut v, &b);
                    layers.transfers.lock().t.host_copy_bytes += info.bytes;
                }
            }
            Tensor::from_vec(v, shape, &layers.device)
        }
        match parts[0].2.dtype {
            crate::DType::F32 => stacked::<f32>(self, parts, on_device, (rows, cols)),
            crate::DType::BF16 => stacked::<half::bf16>(self, parts, on_device, (rows, cols)),
            crate::DType::F16 => stacked::<half::f16>(self, parts, on_device, (rows, cols)),
            other => Err(unsupported_dtype(parts[0].0, other)),
        }
    }

    /// `f` over tensor `id`'s bytes in the Device tier, through a view (a host backend's: the
    /// candle device is the CPU), the copy counted in [`Layers::transfers`]; `None` when the
    /// tier cannot hold it ([`Layers::view_of`]).
    fn with_view_bytes<R>(
        &self,
        name: &str,
        id: TensorId,
        info: &crate::TensorInfo,
        f: impl FnOnce(&[u8]) -> R,
    ) -> candle_core::Result<Option<R>> {
        let Some(view) = self.view_of(name, id, info)? else { return Ok(None) };
        let t0 = Instant::now();
        let r = view.with_host_bytes(f).map_err(|e| strata_err(name, e))?;
        let mut c = self.transfers.lock();
        c.t.view_copy_bytes += info.bytes;
        c.t.view_copy_seconds += t0.elapsed().as_secs_f64();
        Ok(Some(r))
    }

    /// One tensor through a device view, copied into a candle tensor; `None` when it is to be
    /// read on the host instead: a tensor the Device tier cannot hold (too large for it, or no
    /// room beside what is held there now), and on CUDA the dtypes without a device-to-device
    /// copy into candle (`u16`, widened to `u32` on the host as candle's loader does, and
    /// `f8e4m3`). A block-quantized tensor crosses as its blocks and is dequantized on the
    /// device, to f32.
    fn through_view(
        &self,
        name: &str,
        id: TensorId,
        info: &crate::TensorInfo,
        var: bool,
    ) -> candle_core::Result<Option<Tensor>> {
        #[cfg(feature = "candle-cuda")]
        if let Device::Cuda(dev) = &self.device {
            return self.through_cuda_view(name, id, info, dev, var);
        }
        self.with_view_bytes(name, id, info, |b| {
            tensor_from_bytes(name, b, info.dtype, &info.shape, &self.device, var)
        })?
        .transpose()
    }

    /// [`Layers::through_view`] on CUDA: the view copied device to device into candle's memory
    /// on candle's stream (a quantized tensor dequantized there), timed by events.
    #[cfg(feature = "candle-cuda")]
    fn through_cuda_view(
        &self,
        name: &str,
        id: TensorId,
        info: &crate::TensorInfo,
        dev: &candle_core::CudaDevice,
        var: bool,
    ) -> candle_core::Result<Option<Tensor>> {
        use super::cuda::{dequantize_view, view_to_candle, CopyTimer};
        if matches!(info.dtype, crate::DType::U16 | crate::DType::F8E4M3) {
            return Ok(None);
        }
        let Some(view) = self.view_of(name, id, info)? else { return Ok(None) };
        let in_context =
            |e: candle_core::Error| e.context(format!("copying tensor {name} to candle"));
        let stream = dev.cuda_stream();
        let mut timer = CopyTimer::start(&stream).map_err(in_context)?;
        let t = if info.dtype.is_quantized() {
            dequantize_view(&view, dev, info.dtype, &info.shape, var).map_err(in_context)?
        } else {
            let cd = candle_dtype(info.dtype).unwrap_or(CDType::U8);
            view_to_candle(&view, dev, cd, &info.shape, var).map_err(in_context)?
        };
        timer.stop(&stream).map_err(in_context)?;
        let mut c = self.transfers.lock();
        c.t.view_copy_bytes += info.bytes;
        // Fold the timers whose copies are done, so that they do not pile up.
        let mut done = 0.0;
        c.timers.retain(|t| match t.seconds_if_done() {
            Some(s) => {
                done += s;
                false
            }
            None => true,
        });
        c.t.view_copy_seconds += done;
        c.timers.push(timer);
        Ok(Some(t))
    }

    /// A device view of tensor `id`; `None` when the Device tier cannot hold it (too large for
    /// it, or no room beside what it holds now).
    fn view_of(
        &self,
        name: &str,
        id: TensorId,
        info: &crate::TensorInfo,
    ) -> candle_core::Result<Option<crate::DeviceView>> {
        if info.bytes > self.device_capacity {
            return Ok(None);
        }
        match super::wait_for_writer(|| self.store.device_view(id, &self.stream)) {
            Ok(view) => Ok(Some(view)),
            Err(crate::Error::TooLarge { .. } | crate::Error::OutOfMemory { .. }) => Ok(None),
            Err(e) => Err(strata_err(name, e)),
        }
    }

    /// Writes the values of candle tensor `t` into the store tensor served under `name` (same
    /// dtype, f32 or bf16, and element count; any shape): the path the trainer writes its
    /// activation checkpoints and gradients by, for a step of your own. On the CPU through the
    /// host (`Store::write`); on CUDA device to device on candle's stream into a view taken for
    /// overwrite, then released (the store writes it back to host memory when the Device tier
    /// needs the room): no host round trip, no host wait.
    ///
    /// ```
    /// # fn main() -> candle_core::Result<()> {
    /// use candle_core::{Device, Tensor};
    /// use strata as st;
    /// let store = st::candle::store_for(&Device::Cpu, st::Store::builder())?;
    /// let id = store.put_group("grad", st::Group::Grad, st::DType::F32, &[2, 2], &[0u8; 16])?;
    /// let layers = st::candle::Layers::new(store.clone(), [("grad".to_string(), id)], &Device::Cpu)?;
    /// layers.write("grad", &Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?)?;
    /// assert_eq!(store.read_vec::<f32>(id)?, [1., 2., 3., 4.]);
    /// # Ok(()) }
    /// ```
    pub fn write(&self, name: &str, t: &Tensor) -> candle_core::Result<()> {
        let id = self.resolve(&[name])?[0];
        let info = self.store.info(id).map_err(|e| strata_err(name, e))?;
        if info.shape.iter().product::<usize>() != t.elem_count()
            || candle_dtype(info.dtype) != Some(t.dtype())
        {
            candle_core::bail!(
                "{name} is {} {:?}: a candle tensor of {:?} {:?} cannot be written into it",
                info.dtype,
                info.shape,
                t.dtype(),
                t.dims()
            );
        }
        super::train::candle_to_store(&self.store, &self.stream, name, id, t)
    }

    /// Rows `rows` of the 2-D tensor `name` (an embedding table), as a `[rows.len(), columns]`
    /// candle tensor on the candle device, in its stored dtype: only those rows cross to the
    /// device. They are gathered on the host from the tensor's copy in host memory, through a
    /// shared view ([`Store::host_view_shared`]: any number of threads gather at once); a table
    /// with no such copy gets one in Pinned on first use (kept there for later calls while
    /// there is room), or, without room in host memory, is read whole.
    pub fn gather_rows(&self, name: &str, rows: &[usize]) -> candle_core::Result<Tensor> {
        let id = self.resolve(&[name])?[0];
        let info = self.store.info(id).map_err(|e| strata_err(name, e))?;
        let &[n_rows, cols] = info.shape.as_slice() else {
            return Err(candle_core::Error::Msg(format!(
                "gather_rows of {name}: a 2-D tensor is needed, it has shape {:?}",
                info.shape
            ))
            .bt());
        };
        if let Some(&bad) = rows.iter().find(|&&r| r >= n_rows) {
            return Err(candle_core::Error::Msg(format!(
                "gather_rows of {name}: row {bad} of a table of {n_rows} rows"
            ))
            .bt());
        }
        if candle_dtype(info.dtype).is_none() {
            return Err(unsupported_dtype(name, info.dtype));
        }
        // A quantized table's rows are whole blocks (checked when it was put or loaded).
        let row_bytes = info.dtype.bytes_for(&[cols]).map_err(|e| strata_err(name, e))? as usize;
        let gather = |table: &[u8]| -> Vec<u8> {
            let mut out = Vec::with_capacity(rows.len() * row_bytes);
            for &r in rows {
                out.extend_from_slice(&table[r * row_bytes..(r + 1) * row_bytes]);
            }
            out
        };
        // A shared read: any number of threads gather from the table at once.
        let gathered = match super::wait_for_writer(|| self.store.host_view_shared(id)) {
            Ok(view) => gather(view.bytes()),
            Err(
                crate::Error::OutOfMemory { .. }
                | crate::Error::TooLarge { .. }
                | crate::Error::TierDisabled { .. },
            ) => gather(
                &super::wait_for_writer(|| self.store.read_in_place(id))
                    .map_err(|e| strata_err(name, e))?,
            ),
            Err(e) => return Err(strata_err(name, e)),
        };
        self.transfers.lock().t.gathered_bytes += gathered.len() as u64;
        tensor_from_bytes(name, &gathered, info.dtype, &[rows.len(), cols], &self.device, false)
    }
}

/// One layer's weights handed to candle by [`Layers::fetch`]: candle tensors on the candle
/// device, candle's own memory, freed when the last of them (or of their clones) drops.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    tensors: HashMap<String, Tensor>,
    joined: Vec<(Vec<String>, Tensor)>,
    device: Device,
}

impl LayerWeights {
    /// The tensor of this name.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// The tensor [`Layers::fetch_joined`] stacked the rows of the tensors `names` into (in
    /// that order), if it did.
    pub fn joined(&self, names: &[impl AsRef<str>]) -> Option<&Tensor> {
        let same = |g: &[String]| g.iter().map(String::as_str).eq(names.iter().map(|n| n.as_ref()));
        self.joined.iter().find(|(g, _)| same(g)).map(|(_, t)| t)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Adds or replaces a tensor (a gathered embedding table, say) before building a
    /// `VarBuilder`.
    pub fn insert(&mut self, name: impl Into<String>, tensor: Tensor) {
        self.tensors.insert(name.into(), tensor);
    }

    /// A candle-nn `VarBuilder` over these tensors, under the same names, converting them to
    /// `dtype` as a model loads them (candle-nn's `VarBuilder::from_tensors`: shape checked,
    /// `CannotFindTensor` for a name not in this layer).
    pub fn var_builder(&self, dtype: CDType) -> VarBuilder<'static> {
        VarBuilder::from_tensors(self.tensors.clone(), dtype, &self.device)
    }

    /// The tensors, by name.
    pub fn into_tensors(self) -> HashMap<String, Tensor> {
        self.tensors
    }

    /// Takes the stacked groups out ([`LayerWeights::joined`]): each group's names and its
    /// tensor (the group's tensors stay, views of it).
    pub fn take_joined(&mut self) -> Vec<(Vec<String>, Tensor)> {
        std::mem::take(&mut self.joined)
    }
}
