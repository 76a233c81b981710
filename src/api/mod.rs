//! The public API: [`Store`] and its builder, views and streams, hints and layer scopes, tensor
//! files, and [`Stats`].

mod builder;
mod files;
mod hints;
#[cfg(test)]
mod invariants;
mod stats;
mod store;
mod views;

pub use builder::{host_memory_available, StoreBuilder};
pub use files::{
    Gguf, GgufTensor, GgufValue, LoadOptions, Loaded, LoadedFile, LoadedTensor, MappedFile,
};
pub use hints::LayerScope;
pub use stats::{Stats, TierStats};
pub use store::{Store, TensorInfo};
pub use views::{DeviceView, HostRead, HostView, MappedView, Stream};
