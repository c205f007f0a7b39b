//! `claimd health` and `GET /healthz`: the agent answers only once its
//! restore is done, so an answer means ready; each problem below makes it
//! degraded, with one line saying what and why.

use crate::lifecycle::ReleaseState;
use crate::plugins::Health;

use super::Observer;

/// A release still failing after this many attempts makes the agent
/// degraded (fewer is a transient error being retried).
pub const RELEASE_DEGRADED_ATTEMPTS: u32 = 3;

/// One line per problem; empty when healthy.
pub fn problems(o: &Observer) -> Vec<String> {
    let mut out = Vec::new();
    for p in o.registry.list() {
        if p.health == Health::Unhealthy {
            out.push(format!(
                "plugin {} ({}) is unhealthy: {}",
                p.id,
                p.plugin_type.name(),
                p.reason
            ));
        }
    }
    if let Some(c) = &o.cluster {
        if let Some(p) = c.problem() {
            out.push(format!("cluster: {p}"));
        }
        for h in c.unreachable.list() {
            out.push(format!(
                "cluster: volume {} stays claimed by unreachable node {} (gone since {}): {}; once that node is known to be down for good, free it with `claimd volume detach {} --node {} --reason ...`",
                h.volume_id,
                h.node,
                crate::clock::utc(h.gone_since_ms / 1000),
                h.why,
                h.volume_id,
                h.node
            ));
        }
    }
    if let Some(p) = o.docker.as_ref().and_then(|d| d.problem()) {
        out.push(p);
    }
    for (alloc, alias, st) in o.lifecycle.release_reports() {
        match st {
            ReleaseState::Retrying { error, attempts } if attempts >= RELEASE_DEGRADED_ATTEMPTS => {
                out.push(format!(
                    "release of allocation {alloc} volume {alias} is failing ({attempts} attempts): {error}"
                ))
            }
            ReleaseState::Stopped { error } => out.push(format!(
                "release of allocation {alloc} volume {alias} stopped: {error}"
            )),
            _ => {}
        }
    }
    for ((alloc, alias), e) in o.stats.all() {
        if let Some((_, s)) = &e.stats {
            if let Some(c) = s.condition.as_ref().filter(|c| c.abnormal) {
                out.push(format!(
                    "volume {} of allocation {alloc} ({alias}) is abnormal: {}",
                    e.volume_id, c.message
                ));
            }
        }
    }
    out
}
