//! The fault schedule: one fault at a time, each chosen, aimed and timed by
//! the seed, injected, held for its seed-chosen time, then undone.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::json;

use super::etcd_cluster::EtcdCluster;
use super::nodes::{all_threads_stopped, Node};
use super::proxy::Cut;
use super::rng::Rng;
use super::workload::Shared;
use crate::agent_support::send_signal;
use crate::common::wait_until;

/// How long a SIGSTOPped agent may take to show every thread stopped.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    AgentKill,
    AgentStop,
    AgentStopWithWorkload,
    LinkCut,
    CutAndRestart,
    MemberIsolate,
    LeaderKill,
    PluginRestart,
    SlowController,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::AgentKill => "agent-kill-restart",
            Kind::AgentStop => "agent-sigstop",
            Kind::AgentStopWithWorkload => "agent-sigstop-with-workload",
            Kind::LinkCut => "link-cut",
            Kind::CutAndRestart => "link-cut-and-agent-restart",
            Kind::MemberIsolate => "etcd-member-isolated",
            Kind::LeaderKill => "etcd-leader-kill",
            Kind::PluginRestart => "plugin-restart",
            Kind::SlowController => "slow-controller",
        }
    }
}

/// What the schedule is made of.
pub struct Plan {
    pub kinds: Vec<Kind>,
    pub lease_ttl_ms: u64,
    /// stop_after_disconnect, or the window a fault is sized for without it.
    pub window_ms: u64,
}

fn hold(ms: u64) {
    // A pause that is part of the schedule (its length is the seed's).
    thread::sleep(Duration::from_millis(ms));
}

/// Starts a killed agent again; records how long it took to listen, or
/// that it did not.
fn start_agent(shared: &Shared, n: &mut Node, ev: &mut serde_json::Value) {
    match n.start_again() {
        Ok(d) => ev["listening_after_ms"] = json!(d.as_millis()),
        Err(e) => {
            ev["error"] = json!(e);
            shared.crashes.lock().expect("crashes lock").push(e);
        }
    }
}

/// Restarts (and reports) every agent that exited on its own.
pub fn revive_crashed(shared: &Shared, nodes: &mut [Node]) {
    for n in nodes.iter_mut() {
        if n.agent_exited() {
            let tail = n.revive();
            let text = format!(
                "the agent of node {} exited on its own; its log ended: {tail}",
                n.name
            );
            shared.event(json!({"kind": "crash", "node": n.name, "text": text}));
            shared.crashes.lock().expect("crashes lock").push(text);
        }
    }
}

/// Injects faults until `deadline`; every fault is undone before the next
/// one and before this returns.
pub fn run(
    shared: &Arc<Shared>,
    nodes: &mut [Node],
    etcd: &mut EtcdCluster,
    mut rng: Rng,
    plan: &Plan,
    deadline: Instant,
) {
    let (ttl, w) = (plan.lease_ttl_ms, plan.window_ms);
    loop {
        let gap = rng.range(300, 2500);
        let kind = *rng.pick(&plan.kinds);
        let ni = rng.index(nodes.len());
        let mi = rng.index(etcd.members.len());
        let (d1, d2) = (rng.next_u64(), rng.next_u64());
        let pick = |lo: u64, hi: u64, r: u64| lo + r % (hi - lo + 1);
        hold(gap);
        revive_crashed(shared, nodes);
        if Instant::now() >= deadline {
            return;
        }
        let start = shared.since_ms();
        let node = nodes[ni].name.clone();
        let mut ev = json!({"kind": "fault", "fault": kind.name(), "start_ms": start});
        match kind {
            Kind::AgentKill => {
                let down = pick(0, ttl + w + 3000, d1);
                ev["node"] = json!(node);
                ev["down_ms"] = json!(down);
                nodes[ni].agent.kill();
                hold(down);
                start_agent(shared, &mut nodes[ni], &mut ev);
            }
            Kind::AgentStop | Kind::AgentStopWithWorkload => {
                let with = kind == Kind::AgentStopWithWorkload;
                let held = ttl + w + pick(500, 3000, d1);
                ev["node"] = json!(node);
                ev["held_ms"] = json!(held);
                let pid = nodes[ni].pid().expect("the agent runs");
                if with {
                    shared.writers_paused[ni].store(true, Ordering::SeqCst);
                }
                send_signal(pid, libc::SIGSTOP);
                wait_until(STOP_TIMEOUT, "every thread of the agent to stop", || {
                    all_threads_stopped(pid)
                });
                ev["stopped_ms"] = json!(shared.since_ms());
                hold(held);
                send_signal(pid, libc::SIGCONT);
                shared.writers_paused[ni].store(false, Ordering::SeqCst);
            }
            Kind::LinkCut => {
                let how = *[Cut::Both, Cut::Up, Cut::Down]
                    .get(usize::try_from(d2 % 3).expect("fits"))
                    .expect("one of three");
                let held = pick(500, ttl + w + 3000, d1);
                ev["node"] = json!(node);
                ev["cut"] = json!(how.name());
                ev["held_ms"] = json!(held);
                nodes[ni].link.cut(how);
                hold(held);
                nodes[ni].link.heal();
            }
            Kind::CutAndRestart => {
                let before = pick(300, ttl + w, d1);
                let after = pick(300, ttl + w + 2000, d2);
                ev["node"] = json!(node);
                ev["before_restart_ms"] = json!(before);
                ev["after_restart_ms"] = json!(after);
                nodes[ni].link.cut(Cut::Both);
                hold(before);
                nodes[ni].agent.kill();
                start_agent(shared, &mut nodes[ni], &mut ev);
                hold(after);
                nodes[ni].link.heal();
            }
            Kind::MemberIsolate => {
                let held = pick(1000, 8000, d1);
                ev["member"] = json!(etcd.members[mi].name);
                ev["was_leader"] = json!(etcd.leader() == Some(mi));
                ev["held_ms"] = json!(held);
                etcd.isolate(mi);
                hold(held);
                let names = |l: Vec<usize>| -> Vec<String> {
                    l.into_iter()
                        .map(|i| etcd.members[i].name.clone())
                        .collect()
                };
                ev["leaders_before_heal"] = json!(names(etcd.leaders()));
                etcd.heal();
            }
            Kind::LeaderKill => {
                let down = pick(200, 4000, d1);
                ev["down_ms"] = json!(down);
                match etcd.leader() {
                    None => ev["member"] = json!(null),
                    Some(l) => {
                        ev["member"] = json!(etcd.members[l].name);
                        etcd.kill(l);
                        hold(down);
                        let mut result = etcd.restart(l);
                        for _ in 0..2 {
                            if result.is_ok() {
                                break;
                            }
                            result = etcd.restart(l);
                        }
                        if let Err(e) = result {
                            panic!("{e}");
                        }
                    }
                }
            }
            Kind::PluginRestart => {
                let down = pick(0, 1500, d1);
                ev["node"] = json!(node);
                ev["down_ms"] = json!(down);
                nodes[ni].plugin.kill();
                hold(down);
                nodes[ni].plugin.restart();
            }
            Kind::SlowController => {
                let Some(h) = nodes.iter().position(|n| n.is_host) else {
                    continue;
                };
                let late = d2 % 2 == 0;
                let ms = if late {
                    pick(0, 1500, d1)
                } else {
                    pick(300, 2500, d1)
                };
                let held = pick(2000, 8000, d1 ^ d2);
                let action = if late { "late" } else { "delay" };
                let rules: Vec<_> = ["ControllerPublishVolume", "ControllerUnpublishVolume"]
                    .iter()
                    .map(|m| json!({"method": m, "action": action, "ms": ms}))
                    .collect();
                ev["node"] = json!(nodes[h].name);
                ev["action"] = json!(action);
                ev["ms"] = json!(ms);
                ev["held_ms"] = json!(held);
                nodes[h].plugin.faults().set(json!(rules));
                hold(held);
                nodes[h].plugin.faults().clear();
            }
        }
        ev["end_ms"] = json!(shared.since_ms());
        shared.event(ev);
    }
}
