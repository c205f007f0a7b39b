//! The CSI v1 wire contract (generated from `proto/csi.proto`) and the
//! blocking client claimd uses to talk to plugins.

pub use crate::generated::csi::*;

/// grpcio method descriptors, blocking clients and server traits.
#[allow(clippy::all, clippy::unwrap_used)]
pub mod grpc {
    include!(concat!(env!("OUT_DIR"), "/csi_grpc.rs"));
}

mod client;
pub use client::*;

mod operations;
pub use operations::*;
