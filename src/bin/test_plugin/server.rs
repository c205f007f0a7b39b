//! The gRPC side: services built by hand from the generated method
//! descriptors, so that every RPC goes through one dispatcher (fault
//! rules, call log, a thread per call) and so that a reply can be garbage.
//!
//! Replies are `Reply<Resp>` with a marshaller that writes either the
//! protobuf message or bytes that do not decode as it.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use claimd::csi::grpc::*;
use grpcio::{Deadline, GrpcSlice, Marshaller, MessageReader, Method, ServiceBuilder, UnarySink};

use crate::call_log::{boottime_ns, next_call_id, now_ms, CallRecord, Describe, END, START};
use crate::faults::Action;
use crate::plugin::{Call, Failure, Outcome, Plugin};

/// A length-delimited field 1 whose length varint never ends: no protobuf
/// message decodes from it.
const GARBAGE: &[u8] = &[0x0a, 0xff, 0xff, 0xff];

/// Exit status of an `exit` fault.
pub const FAULT_EXIT_STATUS: i32 = 17;

pub enum Reply<T> {
    Message(T),
    Garbage,
}

fn reply_ser<T: protobuf::Message>(reply: &Reply<T>, buf: &mut GrpcSlice) -> grpcio::Result<()> {
    match reply {
        Reply::Message(m) => grpcio::pb_ser(m, buf),
        Reply::Garbage => {
            *buf = GrpcSlice::from_static_slice(GARBAGE);
            Ok(())
        }
    }
}

fn reply_de<T>(_: MessageReader) -> grpcio::Result<Reply<T>> {
    Err(grpcio::Error::Codec(
        "the test plugin only serialises replies".into(),
    ))
}

type Handler<Req, Resp> = fn(&Plugin, Req, &Call) -> Outcome<Resp>;

/// The generated descriptor with the reply marshaller swapped in.
fn reply_method<Req, Resp: protobuf::Message>(
    generated: &Method<Req, Resp>,
) -> Method<Req, Reply<Resp>> {
    Method {
        ty: generated.ty,
        name: generated.name,
        req_mar: Marshaller {
            ser: generated.req_mar.ser,
            de: generated.req_mar.de,
        },
        resp_mar: Marshaller {
            ser: reply_ser::<Resp>,
            de: reply_de::<Resp>,
        },
    }
}

fn add<Req, Resp>(
    builder: ServiceBuilder,
    plugin: &Arc<Plugin>,
    generated: &Method<Req, Resp>,
    handler: Handler<Req, Resp>,
) -> ServiceBuilder
where
    Req: protobuf::Message + Describe,
    Resp: protobuf::Message,
{
    let method = reply_method(generated);
    // "/csi.v1.Node/NodeStageVolume" -> "NodeStageVolume"
    let name: &'static str = method.name.rsplit('/').next().unwrap_or(method.name);
    let plugin = Arc::clone(plugin);
    builder.add_unary_handler(&method, move |ctx, req: Req, sink| {
        let plugin = Arc::clone(&plugin);
        let deadline = ctx.deadline();
        // A thread per call: a delayed or hung call never blocks another.
        let spawned = thread::Builder::new()
            .name(format!("rpc-{name}"))
            .spawn(move || plugin.serve(name, req, deadline, sink, handler));
        if let Err(e) = spawned {
            // The sink went with the closure; dropping it cancels the call.
            log::error!("cannot start a thread for {name}: {e}");
        }
    })
}

/// The Identity, Node and Controller services.
pub fn services(plugin: &Arc<Plugin>) -> Vec<grpcio::Service> {
    let p = plugin;
    let identity = ServiceBuilder::new();
    let identity = add(
        identity,
        p,
        &METHOD_IDENTITY_GET_PLUGIN_INFO,
        Plugin::get_plugin_info,
    );
    let identity = add(
        identity,
        p,
        &METHOD_IDENTITY_GET_PLUGIN_CAPABILITIES,
        Plugin::get_plugin_capabilities,
    );
    let identity = add(identity, p, &METHOD_IDENTITY_PROBE, Plugin::probe);

    let node = ServiceBuilder::new();
    let node = add(
        node,
        p,
        &METHOD_NODE_NODE_STAGE_VOLUME,
        Plugin::node_stage_volume,
    );
    let node = add(
        node,
        p,
        &METHOD_NODE_NODE_UNSTAGE_VOLUME,
        Plugin::node_unstage_volume,
    );
    let node = add(
        node,
        p,
        &METHOD_NODE_NODE_PUBLISH_VOLUME,
        Plugin::node_publish_volume,
    );
    let node = add(
        node,
        p,
        &METHOD_NODE_NODE_UNPUBLISH_VOLUME,
        Plugin::node_unpublish_volume,
    );
    let node = add(
        node,
        p,
        &METHOD_NODE_NODE_GET_CAPABILITIES,
        Plugin::node_get_capabilities,
    );
    let node = add(node, p, &METHOD_NODE_NODE_GET_INFO, Plugin::node_get_info);
    let node = add(
        node,
        p,
        &METHOD_NODE_NODE_GET_VOLUME_STATS,
        Plugin::node_get_volume_stats,
    );
    let node = add(
        node,
        p,
        &METHOD_NODE_NODE_EXPAND_VOLUME,
        Plugin::node_expand_volume,
    );

    // Registered even with --no-controller: the handlers then answer
    // UNIMPLEMENTED, and the call log shows that an agent called anyway.
    let controller = ServiceBuilder::new();
    let controller = add(
        controller,
        p,
        &METHOD_CONTROLLER_CREATE_VOLUME,
        Plugin::create_volume,
    );
    let controller = add(
        controller,
        p,
        &METHOD_CONTROLLER_DELETE_VOLUME,
        Plugin::delete_volume,
    );
    let controller = add(
        controller,
        p,
        &METHOD_CONTROLLER_CONTROLLER_PUBLISH_VOLUME,
        Plugin::controller_publish_volume,
    );
    let controller = add(
        controller,
        p,
        &METHOD_CONTROLLER_CONTROLLER_UNPUBLISH_VOLUME,
        Plugin::controller_unpublish_volume,
    );
    let controller = add(
        controller,
        p,
        &METHOD_CONTROLLER_VALIDATE_VOLUME_CAPABILITIES,
        Plugin::validate_volume_capabilities,
    );
    let controller = add(
        controller,
        p,
        &METHOD_CONTROLLER_CONTROLLER_GET_CAPABILITIES,
        Plugin::controller_get_capabilities,
    );
    let controller = add(
        controller,
        p,
        &METHOD_CONTROLLER_CREATE_SNAPSHOT,
        Plugin::create_snapshot,
    );
    let controller = add(
        controller,
        p,
        &METHOD_CONTROLLER_DELETE_SNAPSHOT,
        Plugin::delete_snapshot,
    );
    let controller = add(
        controller,
        p,
        &METHOD_CONTROLLER_LIST_SNAPSHOTS,
        Plugin::list_snapshots,
    );
    let controller = add(
        controller,
        p,
        &METHOD_CONTROLLER_CONTROLLER_EXPAND_VOLUME,
        Plugin::controller_expand_volume,
    );

    vec![identity.build(), node.build(), controller.build()]
}

/// How long a call's thread waits for its reply to be delivered.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// Sleeps until the process ends.
fn hang() -> ! {
    loop {
        thread::sleep(Duration::from_secs(3600));
    }
}

/// How often a `late` call looks whether its caller's deadline has passed.
const LATE_POLL_INTERVAL: Duration = Duration::from_millis(5);
/// How long a `late` call waits for a deadline at most (a caller without
/// one would otherwise hold it forever).
const LATE_MAX_WAIT: Duration = Duration::from_secs(600);

/// Sleeps until `deadline` has passed (bounded by LATE_MAX_WAIT).
fn sleep_past(deadline: Deadline) {
    let start = Instant::now();
    while !deadline.exceeded() && start.elapsed() < LATE_MAX_WAIT {
        thread::sleep(LATE_POLL_INTERVAL);
    }
}

impl Plugin {
    /// Runs one call on its own thread: fault rule, work, call log, reply.
    fn serve<Req: Describe, Resp: protobuf::Message>(
        &self,
        method: &'static str,
        req: Req,
        deadline: Deadline,
        sink: UnarySink<Reply<Resp>>,
        handler: Handler<Req, Resp>,
    ) {
        let mut record = req.describe(method);
        record.call_id = next_call_id();
        record.pid = std::process::id();
        record.start_boottime_ns = boottime_ns();
        if self.config.log_starts {
            let mut start = record.clone();
            start.event = START;
            self.record(&mut start);
        }
        let outcome = self.answer(&mut record, req, deadline, handler);
        record.code = match &outcome {
            Ok(_) => "OK".to_string(),
            Err(f) => claimd::csi::code_name(f.code),
        };
        self.record(&mut record);
        match &outcome {
            Ok(_) => log::info!("{method} {} -> OK", volume(&record)),
            Err(f) => log::info!(
                "{method} {} -> {}: {}",
                volume(&record),
                record.code,
                f.message
            ),
        }
        // The reply's future must be driven to the end: dropping it early
        // unrefs the call, and gRPC core cancels a call whose close has not
        // completed yet, so the client would see CANCELLED instead of the
        // reply. This thread is the call's own, so it simply waits.
        let sent = match outcome {
            Ok(reply) => claimd::threads::block_on(sink.success(reply), REPLY_TIMEOUT),
            Err(f) => claimd::threads::block_on(sink.fail(f.status()), REPLY_TIMEOUT),
        };
        match sent {
            Some(Ok(())) => {}
            Some(Err(e)) => log::debug!("{method}: reply not delivered: {e}"),
            None => log::warn!("{method}: reply not delivered within {REPLY_TIMEOUT:?}"),
        }
    }

    fn answer<Req, Resp: protobuf::Message>(
        &self,
        record: &mut CallRecord,
        req: Req,
        deadline: Deadline,
        handler: Handler<Req, Resp>,
    ) -> Outcome<Reply<Resp>> {
        let action = match &self.faults {
            None => None,
            Some(f) => f
                .take(record.method, record.volume_id.as_deref())
                .map_err(|e| {
                    log::error!("{e}");
                    Failure::internal(e)
                })?,
        };
        let mut call = Call::default();
        match action {
            None => {}
            Some(Action::Fail { code, message }) => return Err(Failure::new(code, message)),
            Some(Action::Delay(d)) => {
                log::info!("{} {}: delaying {d:?}", record.method, volume(record));
                thread::sleep(d);
            }
            Some(Action::Late(extra)) => {
                log::info!(
                    "{} {}: doing the work {extra:?} after the caller's deadline",
                    record.method,
                    volume(record)
                );
                sleep_past(deadline);
                thread::sleep(extra);
                record.late = true;
            }
            Some(Action::Hang) => {
                log::info!("{} {}: hanging", record.method, volume(record));
                hang();
            }
            Some(Action::Exit) => {
                record.code = "EXIT".to_string();
                self.record(record);
                log::warn!(
                    "{} {}: exiting with status {FAULT_EXIT_STATUS}",
                    record.method,
                    volume(record)
                );
                std::process::exit(FAULT_EXIT_STATUS);
            }
            Some(Action::NotReady) => call.not_ready = true,
            Some(Action::Empty) => return Ok(Reply::Message(Resp::default())),
            Some(Action::Garbage) => return Ok(Reply::Garbage),
        }
        handler(self, req, &call).map(Reply::Message)
    }

    /// Appends the line: a start line as it is, any other as the call's
    /// end line (`event` "end", `end_boottime_ns` now).
    fn record(&self, record: &mut CallRecord) {
        if record.event != START {
            record.event = END;
            record.end_boottime_ns = Some(boottime_ns());
            record.fsyncs = Some(crate::files::fsyncs());
        }
        if let Some(log) = &self.call_log {
            record.ts_ms = now_ms();
            if let Err(e) = log.append(record) {
                log::error!("cannot append to the call log: {e}");
            }
        }
    }
}

fn volume(record: &CallRecord) -> String {
    match &record.volume_id {
        Some(v) => format!("volume={v}"),
        None => String::new(),
    }
}
