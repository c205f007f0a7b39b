//! The CSI v1 wire contract (generated from `proto/csi.proto`) and the
//! blocking client claimd uses to talk to plugins.

#[allow(clippy::all, clippy::pedantic, clippy::unwrap_used)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/protos/mod.rs"));
}

pub use generated::csi::*;

/// grpcio method descriptors, blocking clients and server traits.
#[allow(clippy::all, clippy::unwrap_used)]
pub mod grpc {
    include!(concat!(env!("OUT_DIR"), "/csi_grpc.rs"));
}

mod client;
pub use client::*;
