//! Uses strata and cudarc side by side, as a trainer embedding strata would.

/// A store on the host backend, and whether cudarc sees a driver: both crates in one build.
pub fn both() -> strata::Result<usize> {
    let store = strata::Store::builder().host_backend().build()?;
    let _ctx_type: Option<std::sync::Arc<strata::cudarc::driver::CudaContext>> =
        store.cuda_context().cloned();
    Ok(strata::cuda_device_count().unwrap_or(0))
}
