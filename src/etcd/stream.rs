//! One bidirectional grpcio stream, used one message at a time from a plain
//! thread: send one request, receive one response, each bounded by a
//! deadline and interruptible by the owner's stop.

use std::time::Instant;

use futures_util::{SinkExt, StreamExt};
use grpcio::{ClientDuplexReceiver, ClientDuplexSender, WriteFlags};

use super::worker::StopSignal;
use super::EtcdError;

pub(crate) struct DuplexStream<Req, Resp> {
    method: &'static str,
    pub(crate) endpoint: String,
    tx: ClientDuplexSender<Req>,
    rx: ClientDuplexReceiver<Resp>,
}

/// What a bounded receive gave.
pub(crate) enum Received<Resp> {
    Message(Resp),
    /// The deadline passed, the owner stopped the thread, or the interrupt
    /// turned true; the stream is intact.
    Nothing,
}

impl<Req, Resp> DuplexStream<Req, Resp> {
    pub(crate) fn new(
        method: &'static str,
        endpoint: &str,
        (tx, rx): (ClientDuplexSender<Req>, ClientDuplexReceiver<Resp>),
    ) -> Self {
        DuplexStream {
            method,
            endpoint: endpoint.to_string(),
            tx,
            rx,
        }
    }

    fn broken(&self, reason: &'static str) -> EtcdError {
        EtcdError::StreamBroken {
            method: self.method,
            endpoint: self.endpoint.clone(),
            reason,
        }
    }

    /// Sends one request; an error when it is not handed to gRPC by
    /// `deadline` or the owner stops first.
    pub(crate) fn send(
        &mut self,
        req: Req,
        deadline: Instant,
        stop: &StopSignal,
    ) -> Result<(), EtcdError> {
        let sent = stop.wait(self.tx.send((req, WriteFlags::default())), deadline, || {
            false
        });
        match sent {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(EtcdError::from_grpc(self.method, &self.endpoint, e)),
            None if stop.is_stopped() => Err(EtcdError::Stopped),
            None => Err(self.broken("the request was not taken within the call deadline")),
        }
    }

    /// Receives one response, waiting up to `deadline` or until the owner
    /// stops or `interrupt` turns true.
    pub(crate) fn recv(
        &mut self,
        deadline: Instant,
        stop: &StopSignal,
        interrupt: impl Fn() -> bool,
    ) -> Result<Received<Resp>, EtcdError> {
        match stop.wait(self.rx.next(), deadline, interrupt) {
            Some(Some(Ok(resp))) => Ok(Received::Message(resp)),
            Some(Some(Err(e))) => Err(EtcdError::from_grpc(self.method, &self.endpoint, e)),
            Some(None) => Err(self.broken("the server closed it")),
            None => Ok(Received::Nothing),
        }
    }

    /// Receives the answer to a request just sent: no answer by `deadline`
    /// breaks the stream.
    pub(crate) fn answer(
        &mut self,
        deadline: Instant,
        stop: &StopSignal,
    ) -> Result<Resp, EtcdError> {
        match self.recv(deadline, stop, || false)? {
            Received::Message(resp) => Ok(resp),
            Received::Nothing if stop.is_stopped() => Err(EtcdError::Stopped),
            Received::Nothing => Err(self.broken("no answer within the call deadline")),
        }
    }
}
