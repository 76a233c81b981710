//! Streams and the guards that lend a tensor's memory to device work.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};

use crate::backend::cuda::BorrowedSlice;
use crate::backend::RawStream;
use crate::base::element::Element;
use crate::base::error::{Error, Result};
use crate::base::types::{BackendKind, DType, TensorId, Tier};
use crate::migrate::ops;
use crate::migrate::Shared;
use crate::residency::Meta;
use crate::tiers::arena::WriteLease;

/// An ordered queue of device work: a cudarc [`CudaStream`] on the CUDA backend, a worker thread
/// that runs jobs in order on the host backend. Code written against `Stream` runs on both.
///
/// Make one with [`Store::stream`](crate::Store::stream), or wrap a trainer's own stream with
/// [`Stream::from_cuda`].
#[derive(Clone)]
pub struct Stream {
    pub(crate) raw: RawStream,
}

impl Stream {
    /// Wraps a cudarc stream (a trainer's own). It must belong to the store's context.
    ///
    /// CUDA's per-thread default stream (cudarc's `per_thread_stream`, candle's
    /// `Device::new_cuda`) is a different stream on each host thread behind one handle: the
    /// store tells the threads apart (each thread's views order its own stream's work), but
    /// the work and the view that orders it must then be issued and dropped on one thread.
    pub fn from_cuda(stream: Arc<CudaStream>) -> Stream {
        Stream { raw: RawStream::Cuda(stream) }
    }

    /// The cudarc stream, on the CUDA backend.
    pub fn cuda(&self) -> Option<&Arc<CudaStream>> {
        match &self.raw {
            RawStream::Cuda(s) => Some(s),
            RawStream::Host(_) => None,
        }
    }

    /// Which backend the stream belongs to.
    pub fn backend(&self) -> BackendKind {
        self.raw.kind()
    }

    /// Whether two handles name the same stream.
    pub fn same_as(&self, other: &Stream) -> bool {
        match (&self.raw, &other.raw) {
            (RawStream::Cuda(a), RawStream::Cuda(b)) => a.cu_stream() == b.cu_stream(),
            (RawStream::Host(a), RawStream::Host(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Makes work issued to this stream from now on wait for the work issued to `other` so far
    /// (an event recorded on `other`), without blocking the calling thread. How work on another
    /// stream is ordered after a view's stream before it uses the view's memory.
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        if self.raw.kind() != other.raw.kind() {
            return Err(Error::BackendMismatch("streams of two backends".into()));
        }
        let ev = other.raw.record()?;
        self.raw.wait(&ev)
    }

    /// Blocks until all work issued to the stream has run.
    pub fn synchronize(&self) -> Result<()> {
        self.raw.synchronize()
    }

    /// Host backend: runs `f` on the stream's thread after everything issued before it, the
    /// host stand-in for a kernel launch. On a [simulated](crate::StoreBuilder::simulate) store
    /// the stream has no thread: `f` runs at once, on the calling thread (so it must not wait for
    /// anything the caller does afterwards), and takes no simulated time. Fails on the CUDA
    /// backend.
    pub fn launch_host(&self, f: impl FnOnce() + Send + 'static) -> Result<()> {
        match &self.raw {
            RawStream::Host(s) => {
                s.launch(Box::new(f));
                Ok(())
            }
            RawStream::Cuda(_) => {
                Err(Error::BackendMismatch("launch_host on a CUDA stream: launch a kernel".into()))
            }
        }
    }
}

/// A tensor lent to work on a stream, resident in the Device tier (or, for a [`MappedView`], in
/// the Mapped tier) for as long as the view lives.
///
/// # Ordering
/// Work issued to the view's stream after the view was made sees the tensor's bytes: the stream
/// waits for the copy that brought them, and for the last work *every other stream* did on the
/// tensor (what earlier views on other streams issued before they dropped, and copies still
/// reading it), so a write on one stream is seen by a reader on another, and an overwrite
/// waits for the readers before it. Dropping the view records an event on its stream: moving,
/// reusing or overwriting the memory later waits for it, so kernels issued before the drop may
/// still run.
///
/// Work the caller issues on *another* stream with the view's memory is the caller's to order:
/// make that stream wait for the view's stream first (an event recorded on it), and tell the
/// store about it with [`DeviceView::record_use`] before the view drops, so the memory is not
/// reused or overwritten before that work is done. With cudarc's event tracking on (its
/// default), work launched through [`DeviceView::cuda_slice`] on other streams is covered
/// without it; a trainer that turned tracking off must call `record_use`, as must one whose
/// store `strata::candle::store_for` made for a candle device (it turns tracking off in
/// candle's context).
///
/// Two views of one tensor alive at once (on two streams) are not ordered against each other:
/// the store orders a view after the work of views that have *dropped*. A caller writing through
/// one live view while another is read on another stream orders the two streams itself
/// ([`Stream::wait_for`]).
///
/// While a view lives, [`Store::read`](crate::Store::read) (and so `save_safetensors`) reads
/// another copy of the tensor where there is one (the bytes from before the view); where the
/// view's memory is the only copy it reads that, and what it sees of writes the view's kernels
/// are making is the caller's to order. An overwrite view's memory is never read before the
/// view drops. A read already in progress when a view is asked for finishes first.
///
/// After writing through the view call [`DeviceView::mark_dirty`], so that the other copies,
/// now stale, are dropped and the tensor is written back when evicted.
#[must_use = "the tensor is held in place only while the view lives"]
pub struct DeviceView {
    shared: Arc<Shared>,
    id: TensorId,
    tier: Tier,
    stream: RawStream,
    /// The stream's key on the thread that made the view (see [`RawStream::record_as`]).
    key: u64,
    ptr: u64,
    meta: Arc<Meta>,
    dirty: bool,
    /// The cudarc slice over the memory, made on first use (it costs two CUDA events when
    /// cudarc tracks events).
    cuda: OnceLock<BorrowedSlice>,
    /// The bytes for the CPU where it can reach them (host backend, mapped memory).
    host: Option<WriteLease>,
}

impl std::fmt::Debug for DeviceView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceView")
            .field("id", &self.id)
            .field("tier", &self.tier)
            .field("device_ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.meta.bytes)
            .field("dtype", &self.meta.dtype)
            .field("shape", &self.meta.shape)
            .field("dirty", &self.dirty)
            .finish()
    }
}

impl std::fmt::Debug for MappedView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MappedView").field(&self.0).finish()
    }
}

impl DeviceView {
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: TensorId,
        tier: Tier,
        stream: RawStream,
        parts: ops::ViewParts,
    ) -> DeviceView {
        DeviceView {
            shared,
            id,
            tier,
            key: stream.key(),
            stream,
            ptr: parts.ptr,
            meta: parts.meta,
            dirty: false,
            cuda: OnceLock::new(),
            host: parts.host,
        }
    }

    /// The tensor viewed.
    pub fn id(&self) -> TensorId {
        self.id
    }

    /// The tier the viewed memory is in (`Device`, or `Mapped` for a mapped view).
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Device address of the first byte (`CUdeviceptr`). On the host backend, a host address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.meta.bytes as usize
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.meta.shape
    }

    /// The stream the view was made for.
    pub fn stream(&self) -> Stream {
        Stream { raw: self.stream.clone() }
    }

    /// Says the tensor was written through this view: when the view drops, the other copies are
    /// dropped and this one becomes the tensor's contents.
    pub fn mark_dirty(&mut self) {
        self.dirty = true;
    }

    /// Says work issued on `stream` (another stream than the view's) uses the view's memory:
    /// an event is recorded on `stream` now, and the memory is neither reused nor overwritten,
    /// nor read by a later view on another stream, before that event completes. Call it after
    /// issuing that work and before the view drops (see the type's docs on ordering).
    pub fn record_use(&mut self, stream: &Stream) -> Result<()> {
        if stream.raw.kind() != self.stream.kind() {
            return Err(Error::BackendMismatch(
                "record_use with a stream of another backend".into(),
            ));
        }
        if let (Some(a), RawStream::Cuda(b)) = (stream.cuda(), &self.stream) {
            if a.context().cu_ctx() != b.context().cu_ctx() {
                return Err(Error::BackendMismatch(
                    "record_use with a stream of another CUDA context than the store's".into(),
                ));
            }
        }
        ops::record_use(&self.shared, self.id, &stream.raw)
    }

    /// The cudarc slice, made on first use. `None` on the host backend, or when it cannot be
    /// made (the error goes to [`Store::check_err`](crate::Store::check_err)).
    fn borrowed(&self) -> Option<&BorrowedSlice> {
        let RawStream::Cuda(s) = &self.stream else { return None };
        if self.cuda.get().is_none() {
            match BorrowedSlice::new(s, self.ptr, self.meta.bytes as usize) {
                Ok(b) => {
                    let _ = self.cuda.set(b);
                }
                Err(e) => {
                    self.shared.defer_err(e);
                    return None;
                }
            }
        }
        self.cuda.get()
    }

    /// The memory as a cudarc slice of bytes (CUDA backend), for kernel launches and cuBLAS.
    /// Use it on the view's stream, which waited for the copy that brought the bytes; work on
    /// another stream must first wait for the view's stream (an event recorded on it). For
    /// writing, take [`DeviceView::cuda_view_mut`] (a `&mut CudaSlice` could be swapped out
    /// of the view and freed by cudarc).
    pub fn cuda_slice(&self) -> Option<&CudaSlice<u8>> {
        self.borrowed().map(BorrowedSlice::get)
    }

    /// The memory as a typed cudarc view of `T` (for example `half::bf16` or `f32`) for kernels
    /// and cuBLAS, on the CUDA backend; `None` on the host backend or when the tensor's length
    /// is not a whole number of `T`s.
    pub fn cuda_view<T: cudarc::driver::DeviceRepr>(&self) -> Option<CudaView<'_, T>> {
        self.borrowed().and_then(BorrowedSlice::typed)
    }

    /// A typed mutable cudarc view (see [`DeviceView::cuda_view`]); marks the view dirty.
    pub fn cuda_view_mut<T: cudarc::driver::DeviceRepr>(&mut self) -> Option<CudaViewMut<'_, T>> {
        self.dirty = true;
        self.borrowed()?;
        self.cuda.get_mut().and_then(BorrowedSlice::typed_mut)
    }

    /// The memory as a cudarc view of the tensor's values, `T` being its dtype's Rust type
    /// (CUDA backend). A `T` of another dtype is [`Error::DTypeMismatch`]; on the host backend it
    /// is [`Error::BackendMismatch`] (use [`DeviceView::with_host_values`]). [`cuda_view`]
    /// reinterprets the bytes as any type instead.
    ///
    /// [`cuda_view`]: DeviceView::cuda_view
    pub fn typed_cuda_view<T: Element>(&self) -> Result<CudaView<'_, T>> {
        self.check_dtype::<T>()?;
        self.cuda_view().ok_or_else(not_cuda)
    }

    /// [`DeviceView::typed_cuda_view`], for writing; marks the view dirty.
    pub fn typed_cuda_view_mut<T: Element>(&mut self) -> Result<CudaViewMut<'_, T>> {
        self.check_dtype::<T>()?;
        self.cuda_view_mut().ok_or_else(not_cuda)
    }

    /// [`DeviceView::with_host_bytes`] with the tensor's values, `T` being its dtype's Rust type
    /// (another `T` is [`Error::DTypeMismatch`]).
    pub fn with_host_values<T: Element, R>(&self, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        self.check_dtype::<T>()?;
        self.with_host_bytes(|b| T::from_bytes(b).map(f))?.ok_or_else(misaligned)
    }

    /// [`DeviceView::with_host_values`], for writing; marks the view dirty.
    pub fn with_host_values_mut<T: Element, R>(
        &mut self,
        f: impl FnOnce(&mut [T]) -> R,
    ) -> Result<R> {
        self.check_dtype::<T>()?;
        self.with_host_bytes_mut(|b| T::from_bytes_mut(b).map(f))?.ok_or_else(misaligned)
    }

    fn check_dtype<T: Element>(&self) -> Result<()> {
        dtype_is::<T>(self.id, self.meta.dtype)
    }

    /// The bytes on the CPU, after the view's stream has run what was issued to it: on the host
    /// backend for every tier, on the CUDA backend for mapped views. `f` runs without the
    /// store's lock (it may use the store, but not this tensor). On a
    /// [simulated](crate::StoreBuilder::simulate) store the work issued has run already, and
    /// `f` stands for a kernel issued on the stream: it does not wait for the stream in
    /// simulated time.
    pub fn with_host_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.stream.settle_for_cpu()?;
        let lease = self.host.as_ref().ok_or_else(not_host)?;
        // The slice is made inside the flight: no other CPU access of the tensor overlaps it.
        ops::with_flight(&self.shared, self.id, || lease.bytes().map(f))?.ok_or_else(not_host)
    }

    /// Like [`DeviceView::with_host_bytes`], for writing; marks the view dirty.
    pub fn with_host_bytes_mut<R>(&mut self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        self.stream.settle_for_cpu()?;
        self.dirty = true;
        let lease = self.host.as_mut().ok_or_else(not_host)?;
        ops::with_flight(&self.shared, self.id, || lease.bytes_mut().map(f))?.ok_or_else(not_host)
    }
}

fn not_host() -> Error {
    Error::BackendMismatch("the view's memory is not host memory here".into())
}

fn not_cuda() -> Error {
    Error::BackendMismatch(
        "a cudarc view needs the CUDA backend; on the host backend use with_host_values".into(),
    )
}

fn misaligned() -> Error {
    // Extents are aligned to at least 256 bytes and hold whole values of their dtype; a bool
    // tensor whose bytes are not all 0 or 1 is the one way to get here.
    Error::InvalidArgument(
        "the tensor's bytes are not valid values of its dtype (a bool that is not 0 or 1?): \
         use its bytes"
            .into(),
    )
}

/// `Ok` when `T` is the Rust type of `dtype`.
fn dtype_is<T: Element>(id: TensorId, dtype: DType) -> Result<()> {
    if dtype == T::DTYPE {
        Ok(())
    } else {
        Err(Error::DTypeMismatch { id, dtype, asked: std::any::type_name::<T>() })
    }
}

impl Drop for DeviceView {
    fn drop(&mut self) {
        // Leaking the borrowed cudarc slice makes our stream wait for work other streams did on
        // it (cudarc's events), so the event recorded below covers that work too.
        self.cuda.take();
        let stream = Some((&self.stream, self.key));
        ops::release_view(&self.shared, self.id, self.tier, stream, self.dirty);
    }
}

/// A tensor in the Mapped tier lent to kernels for zero-copy access: [`DeviceView::device_ptr`]
/// is a device address of host memory that kernels read in place over PCIe. Made by
/// [`Store::mapped_view`](crate::Store::mapped_view); everything a [`DeviceView`] offers applies.
#[must_use = "the tensor is held in place only while the view lives"]
pub struct MappedView(DeviceView);

impl MappedView {
    pub(crate) fn new(v: DeviceView) -> MappedView {
        MappedView(v)
    }

    /// The view as a plain [`DeviceView`] (its tier stays `Mapped`).
    pub fn into_inner(self) -> DeviceView {
        self.0
    }
}

impl std::ops::Deref for MappedView {
    type Target = DeviceView;
    fn deref(&self) -> &DeviceView {
        &self.0
    }
}

impl std::ops::DerefMut for MappedView {
    fn deref_mut(&mut self) -> &mut DeviceView {
        &mut self.0
    }
}

/// Exclusive CPU access, in place, to a tensor's copy in host memory (the Pinned or Mapped tier;
/// on the host backend any memory tier), made by [`Store::host_view`](crate::Store::host_view).
/// It works without the store's lock, so other threads keep using the store while the CPU
/// reads or updates the bytes (an optimizer step, for example). While it lives the tensor has no
/// other view and is neither moved nor evicted. After writing, the other copies (now stale) are
/// dropped when the view drops.
#[must_use = "the tensor is held in place only while the view lives"]
pub struct HostView {
    shared: Arc<Shared>,
    id: TensorId,
    tier: Tier,
    lease: WriteLease,
    dtype: DType,
    dirty: bool,
}

impl std::fmt::Debug for HostView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostView")
            .field("id", &self.id)
            .field("tier", &self.tier)
            .field("bytes", &self.lease.len())
            .field("dirty", &self.dirty)
            .finish()
    }
}

impl HostView {
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: TensorId,
        tier: Tier,
        lease: WriteLease,
        dtype: DType,
    ) -> HostView {
        HostView { shared, id, tier, lease, dtype, dirty: false }
    }

    /// The tensor viewed.
    pub fn id(&self) -> TensorId {
        self.id
    }

    /// The tier of the memory viewed.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        self.lease.bytes().unwrap_or_default()
    }

    /// The bytes, for writing; marks the view dirty.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.dirty = true;
        self.lease.bytes_mut().unwrap_or_default()
    }

    /// The tensor's values, `T` being its dtype's Rust type (another `T` is
    /// [`Error::DTypeMismatch`]).
    ///
    /// ```
    /// # fn main() -> strata::Result<()> {
    /// use strata::{Store, Tier};
    /// let store = Store::builder().host_backend().build()?;
    /// let m = store.put_slice("moments", &[4], &[0i32; 4])?;
    /// store.move_to(m, Tier::Pinned)?;
    /// let mut v = store.host_view(m)?;
    /// for (i, x) in v.values_mut::<i32>()?.iter_mut().enumerate() {
    ///     *x = i as i32;
    /// }
    /// drop(v);
    /// assert_eq!(store.read_vec::<i32>(m)?, [0, 1, 2, 3]);
    /// # Ok(()) }
    /// ```
    pub fn values<T: Element>(&self) -> Result<&[T]> {
        dtype_is::<T>(self.id, self.dtype)?;
        T::from_bytes(self.bytes()).ok_or_else(misaligned)
    }

    /// [`HostView::values`], for writing; marks the view dirty.
    pub fn values_mut<T: Element>(&mut self) -> Result<&mut [T]> {
        dtype_is::<T>(self.id, self.dtype)?;
        T::from_bytes_mut(self.bytes_mut()).ok_or_else(misaligned)
    }

    /// The values of an f32 tensor; `None` for other dtypes.
    pub fn f32s(&self) -> Option<&[f32]> {
        if self.dtype != DType::F32 {
            return None;
        }
        self.lease.f32s()
    }

    /// The values of an f32 tensor, for writing (marks the view dirty); `None` for other dtypes.
    pub fn f32s_mut(&mut self) -> Option<&mut [f32]> {
        if self.dtype != DType::F32 {
            return None;
        }
        self.dirty = true;
        self.lease.f32s_mut()
    }

    /// The values of a bf16 tensor; `None` for other dtypes.
    pub fn bf16s(&self) -> Option<&[half::bf16]> {
        if self.dtype != DType::BF16 {
            return None;
        }
        self.lease.bf16s()
    }

    /// The values of a bf16 tensor, for writing (marks the view dirty); `None` for other
    /// dtypes.
    pub fn bf16s_mut(&mut self) -> Option<&mut [half::bf16]> {
        if self.dtype != DType::BF16 {
            return None;
        }
        self.dirty = true;
        self.lease.bf16s_mut()
    }
}

impl Drop for HostView {
    fn drop(&mut self) {
        ops::release_view(&self.shared, self.id, self.tier, None, self.dirty);
    }
}

/// Shared CPU access for reading, in place, to a tensor's copy in host memory, made by
/// [`Store::host_view_shared`](crate::Store::host_view_shared): any number of threads may hold
/// one of the same tensor at once. While any lives, nothing writes, moves, evicts or removes the
/// tensor (those wait for the readers). Dropping it ends the read.
#[must_use = "the tensor is held for reading only while the view lives"]
pub struct HostRead {
    shared: Arc<Shared>,
    id: TensorId,
    tier: Tier,
    lease: WriteLease,
    dtype: DType,
}

impl std::fmt::Debug for HostRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRead")
            .field("id", &self.id)
            .field("tier", &self.tier)
            .field("bytes", &self.lease.len())
            .finish()
    }
}

impl HostRead {
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: TensorId,
        tier: Tier,
        lease: WriteLease,
        dtype: DType,
    ) -> HostRead {
        HostRead { shared, id, tier, lease, dtype }
    }

    /// The tensor viewed.
    pub fn id(&self) -> TensorId {
        self.id
    }

    /// The tier of the memory viewed.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        self.lease.bytes().unwrap_or_default()
    }

    /// The tensor's values, `T` being its dtype's Rust type (another `T` is
    /// [`Error::DTypeMismatch`]).
    pub fn values<T: Element>(&self) -> Result<&[T]> {
        dtype_is::<T>(self.id, self.dtype)?;
        T::from_bytes(self.bytes()).ok_or_else(misaligned)
    }
}

impl Drop for HostRead {
    fn drop(&mut self) {
        ops::release_shared(&self.shared, self.id);
    }
}
