//! The fault schedule. Each round draws its fault (kind, target, times)
//! from the seed; with a seed-chosen chance a second fault overlaps it (a
//! link cut of one agent while another is SIGSTOPped, a leader kill during
//! a member isolation, a member isolated while an agent restarts, ...).
//! A fault is a list of timed steps (inject, later undo); the steps of a
//! round's faults run merged in time order, and every fault of a round is
//! undone before the next round and before `run` returns, so everything is
//! healed before the settle phase.
//!
//! Repeatable: every round draws the same number of values whatever it
//! turns out to be, from two streams: the first draws what the rounds drew
//! before overlaps existed (so a seed keeps its primary faults), the
//! second whether an agent kill also loses its unsynced state writes
//! (`power_cut.rs`) and the overlapping fault. Outcomes still depend on
//! timing: a step runs late when the one before it took long (an etcd
//! member's restart waits until it serves, a power cut waits for a state
//! write to catch), and restarted agents are waited for at the round's end.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::etcd_cluster::EtcdCluster;
use super::nodes::{all_threads_stopped, Node, Start};
use super::power_cut::{self, LossPlan};
use super::proxy::Cut;
use super::rng::Rng;
use super::workload::Shared;
use crate::agent_support::send_signal;
use crate::common::wait_until;

mod steps;
use steps::step;

/// How long a SIGSTOPped agent may take to show every thread stopped.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// The chance (percent) that a round has a second, overlapping fault.
const OVERLAP_PERCENT: u64 = 40;
/// The chance (percent) that an agent kill is a power cut that loses the
/// state writes the design allows to lose.
const LOSS_PERCENT: u64 = 50;
/// The chance (percent) that a round is followed by one of the faults
/// added with issue 37 (`NEWER_KINDS`), drawn from a third stream so that
/// a seed keeps the rounds it drew before they existed.
const NEWER_PERCENT: u64 = 30;
const NEWER_KINDS: [Kind; 3] = [Kind::LinkFlap, Kind::LivenessDeleted, Kind::LongCut];
/// The chance (percent) that a round is followed by one of the faults
/// added with issue 37's second part (`LATEST_KINDS`), from a fourth
/// stream (seeds keep their earlier rounds).
const LATEST_PERCENT: u64 = 30;
const LATEST_KINDS: [Kind; 3] = [Kind::StepCrash, Kind::StepPause, Kind::NodeLost];
/// The chance (percent) that a round is followed by a `FlapDuringReap`,
/// from a fifth stream (seeds keep their earlier draws);
/// `NEMESIS_FLAP_DURING_REAP=on` follows every round with one.
const REAP_FLAP_PERCENT: u64 = 15;
/// Failpoints between two writes of a multi-step change (etcd then the
/// local record, the intent then the calls, a call then its record, the
/// release's mark, the free, the closing write): a `StepCrash` kills the
/// agent at one of them.
const CRASH_POINTS: [&str; 13] = [
    "etcd-before-round-trip",
    "etcd-after-round-trip",
    "mount-after-record",
    "mount-after-intent",
    "after-controller-publish",
    "after-node-stage",
    "after-node-publish",
    "release-after-mark",
    "after-node-unpublish",
    "after-node-unstage",
    "after-controller-unpublish",
    "release-after-claim-freed",
    "answer-before-closing-write",
];
/// Failpoints between a call up's lease check and its send: a `StepPause`
/// holds the thread there.
const PAUSE_POINTS: [&str; 3] = [
    "before-controller-publish",
    "before-node-stage",
    "before-node-publish",
];
/// How long a `StepPause` waits for its thread to be held before it cuts
/// the link anyway (mounts on the node come every few seconds).
const PAUSE_WAIT_MS: u64 = 20_000;
/// The variable the agents' failpoints are chosen by.
const FAILPOINT_ENV: &str = "CLAIMD_FAILPOINT";
/// How often the executor looks at due steps and restarting agents.
const TICK: Duration = Duration::from_millis(10);

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
    /// A link cut long enough to be counted gone, healed for about a TTL
    /// (the node registers again), cut again: an absence interrupted
    /// while a reaper may be busy.
    LinkFlap,
    /// The node's liveness key deleted by hand while its lease lives.
    LivenessDeleted,
    /// A link cut longer than TTL + W: the other nodes' reapers act on
    /// the node's volumes (the faults above heal before that).
    LongCut,
    /// The agent restarted to kill itself at a step between two writes
    /// (its N-th time there), then started again without it.
    StepCrash,
    /// The agent restarted to hold one call up between its lease check
    /// and its send (up to TTL + W), while its link is cut.
    StepPause,
    /// The node lost for good, as an operator sees it: its agent killed,
    /// its workload gone (writers and readers stop for good) and its
    /// mounts with it; once its liveness key is gone an operator frees its
    /// claims (`claim free`, or `volume detach --node` where it holds an
    /// attachment) through another node; then it comes back.
    NodeLost,
    /// A link flap during another node's reap (issue 37, item 1): node C
    /// cut past TTL + W, node A (after C by name, so a reaper's loop
    /// reaches it after C) cut 1 s later, healed once a reaper holds C's
    /// lock, cut again as soon as it registered again, healed 8 s after
    /// C. A reaper that counts A's first absence (interrupted by the
    /// registration) acts on A early: check (6).
    FlapDuringReap,
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
            Kind::LinkFlap => "link-flap",
            Kind::LivenessDeleted => "liveness-key-deleted",
            Kind::LongCut => "long-link-cut",
            Kind::StepCrash => "crash-between-writes",
            Kind::StepPause => "pause-after-lease-check",
            Kind::NodeLost => "node-lost-freed-by-hand",
            Kind::FlapDuringReap => "flap-during-reap",
        }
    }

    /// Whether it acts on one node (agent, plugin or link).
    fn on_node(self) -> bool {
        !matches!(self, Kind::MemberIsolate | Kind::LeaderKill)
    }
}

/// What the schedule is made of.
pub struct Plan {
    pub kinds: Vec<Kind>,
    /// The plugins get the claim's epoch: only then is a `StepPause`
    /// drawn (else it is a `StepCrash`).
    pub epochs: bool,
    pub lease_ttl_ms: u64,
    /// stop_after_disconnect, or the window a fault is sized for without it.
    pub window_ms: u64,
    /// TTL + W: how long a node must be cut off before another node's
    /// reaper acts on its volumes.
    pub reap_ms: u64,
}

/// The values one fault is made from (drawn every round, used or not).
#[derive(Clone, Copy, Debug)]
struct Draw {
    kind: Kind,
    node: usize,
    member: usize,
    d1: u64,
    d2: u64,
    /// An agent kill in it loses state writes (`loss`).
    lossy: bool,
    loss: u64,
}

/// One step of a fault.
#[derive(Clone, Debug)]
enum Action {
    /// Keeps a copy of the node's lease clock (what a power cut may set
    /// it back to).
    CopyLeaseClock(usize),
    KillAgent(usize),
    /// SIGKILL at a moment a state write is in flight if one comes, and
    /// lose what the design allows to lose (`power_cut.rs`).
    PowerCut(usize, LossPlan),
    StartAgent(usize),
    Freeze(usize, bool),
    Thaw(usize, bool),
    CutLink(usize, Cut),
    HealLink(usize),
    Isolate(usize),
    HealEtcd,
    KillLeader,
    RestartLeader,
    KillPlugin(usize),
    StartPlugin(usize),
    SetSlow(usize, Value),
    ClearSlow(usize),
    DeleteLiveness(usize),
    /// Restarts the agent with this failpoint.
    Arm(usize, String),
    /// Drops the failpoint from the agent's next starts; restarts it now
    /// when it died of it, or (true) when it may still.
    Disarm(usize, bool),
    /// Waits (up to the first ms) for the agent to say its thread is held
    /// at the failpoint, then cuts its link for the second ms (a cut
    /// anyway when it was not held in time).
    CutWhenHeld(usize, &'static str, u64, u64),
    /// The node lost: loss count moved, agent killed, mounts gone.
    NodeDown(usize),
    /// Waits (up to the ms) for the node's liveness key to be gone, then
    /// frees its claims by hand through another node.
    OperatorFree(usize, u64),
    /// The lost node back: its agent started.
    NodeUp(usize),
    /// Waits (up to the ms) for `reaper-locks/<second>` to exist, then
    /// heals the first node's link.
    HealWhenReaped(usize, usize, u64),
    /// Waits (up to the ms) for the node's liveness key to exist, then
    /// cuts its link (both ways).
    CutWhenBack(usize, u64),
}

impl Action {
    fn name(&self) -> &'static str {
        match self {
            Action::CopyLeaseClock(_) => "copy-lease-clock",
            Action::KillAgent(_) => "kill-agent",
            Action::PowerCut(..) => "power-cut",
            Action::StartAgent(_) => "start-agent",
            Action::Freeze(..) => "sigstop",
            Action::Thaw(..) => "sigcont",
            Action::CutLink(..) => "cut-link",
            Action::HealLink(_) => "heal-link",
            Action::Isolate(_) => "isolate-member",
            Action::HealEtcd => "heal-members",
            Action::KillLeader => "kill-leader",
            Action::RestartLeader => "restart-member",
            Action::KillPlugin(_) => "kill-plugin",
            Action::StartPlugin(_) => "start-plugin",
            Action::SetSlow(..) => "slow-controller-on",
            Action::ClearSlow(_) => "slow-controller-off",
            Action::DeleteLiveness(_) => "delete-liveness-key",
            Action::Arm(..) => "restart-with-failpoint",
            Action::Disarm(..) => "drop-failpoint",
            Action::CutWhenHeld(..) => "cut-when-held",
            Action::NodeDown(_) => "node-down",
            Action::OperatorFree(..) => "operator-free",
            Action::NodeUp(_) => "node-up",
            Action::HealWhenReaped(..) => "heal-when-reaped",
            Action::CutWhenBack(..) => "cut-when-back",
        }
    }
}

/// A fault as timed steps (ms from its own start), and its event.
struct Fault {
    steps: Vec<(u64, Action)>,
    ev: Value,
    name: String,
    node: Option<usize>,
    /// The leader it killed, to restart.
    killed: Option<usize>,
    lease_clock: Option<Vec<u8>>,
}

impl Fault {
    fn span(&self) -> u64 {
        self.steps.iter().map(|(t, _)| *t).max().unwrap_or(0)
    }
}

fn hold(ms: u64) {
    // A pause that is part of the schedule (its length is the seed's).
    thread::sleep(Duration::from_millis(ms));
}

/// Starts a killed etcd member again: up to three tries (on a loaded
/// machine a member can stay in elections past one try's bound).
pub fn restart_member(etcd: &mut EtcdCluster, i: usize) -> Result<(), String> {
    let mut result = etcd.restart(i);
    for _ in 0..2 {
        if result.is_ok() {
            break;
        }
        result = etcd.restart(i);
    }
    result
}

/// A fault of the harness's infrastructure the cluster must survive: in
/// the events and the summary, not a violation.
pub fn infrastructure_fault(shared: &Shared, text: String) {
    eprintln!("nemesis: infrastructure: {text}");
    shared.event(json!({"kind": "infrastructure", "text": text}));
    shared
        .infrastructure
        .lock()
        .expect("infrastructure lock")
        .push(text);
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

fn draw(
    rng: &mut Rng,
    plan: &Plan,
    nodes: usize,
    members: usize,
) -> (Kind, usize, usize, u64, u64) {
    let kind = *rng.pick(&plan.kinds);
    let ni = rng.index(nodes);
    let mi = rng.index(members);
    (kind, ni, mi, rng.next_u64(), rng.next_u64())
}

/// Builds the steps of one fault; None when it cannot run (no host).
fn build(d: Draw, plan: &Plan, nodes: &[Node], start_ms: u64) -> Option<Fault> {
    let (ttl, w) = (plan.lease_ttl_ms, plan.window_ms);
    let pick = |lo: u64, hi: u64, r: u64| lo + r % (hi - lo + 1);
    let node = nodes[d.node].name.clone();
    let mut ev = json!({"kind": "fault", "start_ms": start_ms});
    let mut target = Some(d.node);
    // A pause between a call's lease check and its send is covered only
    // with epochs (README Safety rule 11): without, a crash instead.
    let kind = match d.kind {
        Kind::StepPause if !plan.epochs => Kind::StepCrash,
        k => k,
    };
    let mut name = kind.name().to_string();
    let steps = match kind {
        Kind::AgentKill => {
            let down = pick(0, ttl + w + 3000, d.d1);
            ev["node"] = json!(node);
            ev["down_ms"] = json!(down);
            if d.lossy {
                let loss = LossPlan::from_draw(d.loss);
                name = "agent-power-cut".into();
                let at = loss.clock_age_ms;
                let up = at + loss.catch_ms + down;
                vec![
                    (0, Action::CopyLeaseClock(d.node)),
                    (at, Action::PowerCut(d.node, loss)),
                    (up, Action::StartAgent(d.node)),
                ]
            } else {
                vec![
                    (0, Action::KillAgent(d.node)),
                    (down, Action::StartAgent(d.node)),
                ]
            }
        }
        Kind::AgentStop | Kind::AgentStopWithWorkload => {
            let with = d.kind == Kind::AgentStopWithWorkload;
            let held = ttl + w + pick(500, 3000, d.d1);
            ev["node"] = json!(node);
            ev["held_ms"] = json!(held);
            vec![
                (0, Action::Freeze(d.node, with)),
                (held, Action::Thaw(d.node, with)),
            ]
        }
        Kind::LinkCut => {
            let how = *[Cut::Both, Cut::Up, Cut::Down]
                .get(usize::try_from(d.d2 % 3).expect("fits"))
                .expect("one of three");
            let held = pick(500, ttl + w + 3000, d.d1);
            ev["node"] = json!(node);
            ev["cut"] = json!(how.name());
            ev["held_ms"] = json!(held);
            vec![
                (0, Action::CutLink(d.node, how)),
                (held, Action::HealLink(d.node)),
            ]
        }
        Kind::CutAndRestart => {
            let before = pick(300, ttl + w, d.d1);
            let after = pick(300, ttl + w + 2000, d.d2);
            ev["node"] = json!(node);
            ev["before_restart_ms"] = json!(before);
            ev["after_restart_ms"] = json!(after);
            if d.lossy {
                let loss = LossPlan::from_draw(d.loss);
                name = "link-cut-and-power-cut".into();
                let at = loss.clock_age_ms;
                let cut_at = at + before;
                let up = cut_at + loss.catch_ms;
                vec![
                    (0, Action::CopyLeaseClock(d.node)),
                    (at, Action::CutLink(d.node, Cut::Both)),
                    (cut_at, Action::PowerCut(d.node, loss)),
                    (up, Action::StartAgent(d.node)),
                    (up + after, Action::HealLink(d.node)),
                ]
            } else {
                vec![
                    (0, Action::CutLink(d.node, Cut::Both)),
                    (before, Action::KillAgent(d.node)),
                    (before, Action::StartAgent(d.node)),
                    (before + after, Action::HealLink(d.node)),
                ]
            }
        }
        Kind::MemberIsolate => {
            let held = pick(1000, 8000, d.d1);
            target = None;
            ev["held_ms"] = json!(held);
            vec![(0, Action::Isolate(d.member)), (held, Action::HealEtcd)]
        }
        Kind::LeaderKill => {
            let down = pick(200, 4000, d.d1);
            target = None;
            ev["down_ms"] = json!(down);
            vec![(0, Action::KillLeader), (down, Action::RestartLeader)]
        }
        Kind::LinkFlap => {
            // Cuts long enough for a reap (half of them), healed for about
            // a TTL in between.
            let reap = plan.reap_ms;
            let first = pick(ttl + 500, reap + 5000, d.d1);
            let healed = pick(ttl / 2, ttl * 2, d.d2);
            let second = pick(500, reap + 5000, d.d1 ^ d.d2);
            ev["node"] = json!(node);
            ev["first_ms"] = json!(first);
            ev["healed_ms"] = json!(healed);
            ev["second_ms"] = json!(second);
            vec![
                (0, Action::CutLink(d.node, Cut::Both)),
                (first, Action::HealLink(d.node)),
                (first + healed, Action::CutLink(d.node, Cut::Both)),
                (first + healed + second, Action::HealLink(d.node)),
            ]
        }
        Kind::LivenessDeleted => {
            ev["node"] = json!(node);
            vec![(0, Action::DeleteLiveness(d.node))]
        }
        Kind::LongCut => {
            let held = pick(plan.reap_ms, plan.reap_ms + 6000, d.d1);
            ev["node"] = json!(node);
            ev["held_ms"] = json!(held);
            vec![
                (0, Action::CutLink(d.node, Cut::Both)),
                (held, Action::HealLink(d.node)),
            ]
        }
        Kind::StepCrash => {
            let point =
                CRASH_POINTS[usize::try_from(d.d1 % CRASH_POINTS.len() as u64).expect("fits")];
            let spec = format!("{point}:kill:{}", 1 + d.d2 % 3);
            let held = pick(1500, 8000, d.d1 >> 8);
            ev["node"] = json!(node);
            ev["failpoint"] = json!(spec);
            ev["held_ms"] = json!(held);
            vec![
                (0, Action::Arm(d.node, spec)),
                (held, Action::Disarm(d.node, true)),
            ]
        }
        Kind::StepPause => {
            let point =
                PAUSE_POINTS[usize::try_from(d.d1 % PAUSE_POINTS.len() as u64).expect("fits")];
            // The link is cut once the thread is held (a call up checked,
            // not sent), long enough for the other nodes to act on the
            // node's claims; the call goes out before or after the heal.
            let cut = pick(ttl + 500, plan.reap_ms + 5000, d.d1 ^ d.d2);
            let pause = pick(ttl, cut + 3000, d.d1 >> 8);
            let spec = format!("{point}:pause={pause}:{}", 1 + d.d2 % 2);
            ev["node"] = json!(node);
            ev["failpoint"] = json!(spec);
            ev["cut_ms"] = json!(cut);
            vec![
                (0, Action::Arm(d.node, spec)),
                (1, Action::CutWhenHeld(d.node, point, PAUSE_WAIT_MS, cut)),
                (2, Action::Disarm(d.node, false)),
            ]
        }
        Kind::NodeLost => {
            let back = pick(300, 3000, d.d1);
            ev["node"] = json!(node);
            ev["back_after_ms"] = json!(back);
            // The free waits for the key, then takes its time: the node
            // comes back after it (the steps run in order).
            vec![
                (0, Action::NodeDown(d.node)),
                (1, Action::OperatorFree(d.node, ttl * 3 + 30_000)),
                (2 + back, Action::NodeUp(d.node)),
            ]
        }
        Kind::FlapDuringReap => {
            // C before A by name: a reaper's loop reaches A after C's reap.
            let (c, a) = [(0, 1), (0, 2), (1, 2)][d.node % 3];
            let held = plan.reap_ms + 15_000;
            ev["node"] = json!(nodes[c].name);
            ev["flapped"] = json!(nodes[a].name);
            ev["held_ms"] = json!(held);
            vec![
                (0, Action::CutLink(c, Cut::Both)),
                (1000, Action::CutLink(a, Cut::Both)),
                (1001, Action::HealWhenReaped(a, c, plan.reap_ms + 10_000)),
                (1002, Action::CutWhenBack(a, 10_000)),
                (held, Action::HealLink(c)),
                // A stays cut past C's heal (a reap of C that waits for C
                // as controller host ends only then).
                (held + 8000, Action::HealLink(a)),
            ]
        }
        Kind::PluginRestart => {
            let down = pick(0, 1500, d.d1);
            ev["node"] = json!(node);
            ev["down_ms"] = json!(down);
            vec![
                (0, Action::KillPlugin(d.node)),
                (down, Action::StartPlugin(d.node)),
            ]
        }
        Kind::SlowController => {
            let hosts: Vec<usize> = (0..nodes.len()).filter(|&i| nodes[i].is_host).collect();
            if hosts.is_empty() {
                return None;
            }
            // One host: the one; two: chosen by the draw.
            let h = hosts[usize::try_from((d.d1 >> 32) % hosts.len() as u64).expect("fits")];
            target = Some(h);
            let late = d.d2 % 2 == 0;
            let ms = if late {
                pick(0, 1500, d.d1)
            } else {
                pick(300, 2500, d.d1)
            };
            let held = pick(2000, 8000, d.d1 ^ d.d2);
            let action = if late { "late" } else { "delay" };
            let rules: Vec<_> = ["ControllerPublishVolume", "ControllerUnpublishVolume"]
                .iter()
                .map(|m| json!({"method": m, "action": action, "ms": ms}))
                .collect();
            ev["node"] = json!(nodes[h].name);
            ev["action"] = json!(action);
            ev["ms"] = json!(ms);
            ev["held_ms"] = json!(held);
            vec![
                (0, Action::SetSlow(h, json!(rules))),
                (held, Action::ClearSlow(h)),
            ]
        }
    };
    ev["fault"] = json!(name);
    Some(Fault {
        steps,
        ev,
        name,
        node: target,
        killed: None,
        lease_clock: None,
    })
}

/// Whether `second` may run next to `first`: never two faults on one node,
/// nor two of one etcd kind (one member isolated at a time; a second
/// leader kill would only repeat the first).
fn compatible(first: &Fault, second: &Fault, k1: Kind, k2: Kind) -> bool {
    match (first.node, second.node) {
        (Some(a), Some(b)) => a != b,
        _ => k1.on_node() || k2.on_node() || k1 != k2,
    }
}

/// The random streams of the schedule (see the module's doc).
pub struct Streams {
    pub first: Rng,
    pub extra: Rng,
    pub newer: Rng,
    pub latest: Rng,
    pub reaps: Rng,
}

/// Injects faults until `deadline`; every fault is undone before the next
/// round and before this returns.
pub fn run(
    shared: &Arc<Shared>,
    nodes: &mut [Node],
    etcd: &mut EtcdCluster,
    streams: Streams,
    plan: &Plan,
    deadline: Instant,
) {
    let Streams {
        first: mut rng,
        mut extra,
        mut newer,
        mut latest,
        mut reaps,
    } = streams;
    let mut round = 0u64;
    let every_reap_flap = std::env::var("NEMESIS_FLAP_DURING_REAP").is_ok_and(|v| v == "on");
    loop {
        // The first stream, as it was drawn before overlaps existed.
        let gap = rng.range(300, 2500);
        let (kind, ni, mi, d1, d2) = draw(&mut rng, plan, nodes.len(), etcd.members.len());
        // The second stream: losses and the overlapping fault.
        let lossy = extra.chance(LOSS_PERCENT);
        let loss = extra.next_u64();
        let overlap = extra.chance(OVERLAP_PERCENT);
        let (k2, n2, m2, e1, e2) = draw(&mut extra, plan, nodes.len(), etcd.members.len());
        let lossy2 = extra.chance(LOSS_PERCENT);
        let loss2 = extra.next_u64();
        let offset = extra.next_u64();
        // The third stream: a round of a newer fault after this one.
        let then_newer = newer.chance(NEWER_PERCENT);
        let newer_kind = *newer.pick(&NEWER_KINDS);
        let (newer_node, newer_gap) = (newer.index(nodes.len()), newer.range(300, 2500));
        let (g1, g2) = (newer.next_u64(), newer.next_u64());
        // The fourth stream: a round of a latest fault after those.
        let then_latest = latest.chance(LATEST_PERCENT);
        let latest_kind = *latest.pick(&LATEST_KINDS);
        let (latest_node, latest_gap) = (latest.index(nodes.len()), latest.range(300, 2500));
        let (h1, h2) = (latest.next_u64(), latest.next_u64());
        // The fifth stream: a flap during another node's reap.
        let then_reap_flap = reaps.chance(REAP_FLAP_PERCENT) || every_reap_flap;
        let (reap_node, reap_gap) = (reaps.index(nodes.len()), reaps.range(300, 2500));
        hold(gap);
        revive_crashed(shared, nodes);
        if Instant::now() >= deadline {
            return;
        }
        round += 1;
        let start = shared.since_ms();
        let first = Draw {
            kind,
            node: ni,
            member: mi,
            d1,
            d2,
            lossy,
            loss,
        };
        let Some(mut f1) = build(first, plan, nodes, start) else {
            continue;
        };
        let mut faults = Vec::new();
        if overlap {
            let mut second = Draw {
                kind: k2,
                node: n2,
                member: m2,
                d1: e1,
                d2: e2,
                lossy: lossy2,
                loss: loss2,
            };
            if f1.node == Some(n2) {
                second.node = (n2 + 1) % nodes.len();
            }
            if let Some(mut f2) = build(second, plan, nodes, start) {
                if compatible(&f1, &f2, kind, k2) {
                    // Starts while the first is still in force.
                    let at = offset % f1.span().max(1);
                    for s in &mut f2.steps {
                        s.0 += at;
                    }
                    f1.ev["overlapped_by"] = json!(f2.name);
                    f2.ev["overlaps"] = json!(f1.name);
                    f2.ev["offset_ms"] = json!(at);
                    faults.push(f1);
                    faults.push(f2);
                }
            }
            if faults.is_empty() {
                faults.push(build(first, plan, nodes, start).expect("built once"));
            }
        } else {
            faults.push(f1);
        }
        for f in &mut faults {
            f.ev["round"] = json!(round);
        }
        execute(shared, nodes, etcd, &mut faults);
        for mut f in faults {
            f.ev["end_ms"] = json!(shared.since_ms());
            shared.event(std::mem::take(&mut f.ev));
        }
        let later = [
            (then_newer, newer_kind, newer_node, newer_gap, g1, g2),
            (then_latest, latest_kind, latest_node, latest_gap, h1, h2),
            (
                then_reap_flap,
                Kind::FlapDuringReap,
                reap_node,
                reap_gap,
                0,
                0,
            ),
        ];
        for (then, kind, node, gap, d1, d2) in later {
            if !then {
                continue;
            }
            hold(gap);
            revive_crashed(shared, nodes);
            if Instant::now() >= deadline {
                return;
            }
            round += 1;
            let d = Draw {
                kind,
                node,
                member: 0,
                d1,
                d2,
                lossy: false,
                loss: 0,
            };
            run_alone(shared, nodes, etcd, plan, d, round);
        }
    }
}

/// One fault in a round of its own.
fn run_alone(
    shared: &Shared,
    nodes: &mut [Node],
    etcd: &mut EtcdCluster,
    plan: &Plan,
    d: Draw,
    round: u64,
) {
    let start = shared.since_ms();
    if let Some(mut f) = build(d, plan, nodes, start) {
        f.ev["round"] = json!(round);
        let mut one = vec![f];
        execute(shared, nodes, etcd, &mut one);
        for mut f in one {
            f.ev["end_ms"] = json!(shared.since_ms());
            eprintln!("nemesis: fault {}", f.ev);
            shared.event(std::mem::take(&mut f.ev));
        }
    }
}

/// Runs the merged steps of a round's faults at their times, then waits
/// for every agent restarted in it.
fn execute(shared: &Shared, nodes: &mut [Node], etcd: &mut EtcdCluster, faults: &mut [Fault]) {
    let mut steps: Vec<(u64, usize, Action)> = faults
        .iter()
        .enumerate()
        .flat_map(|(i, f)| f.steps.iter().map(move |(t, a)| (*t, i, a.clone())))
        .collect();
    steps.sort_by_key(|s| s.0);
    let t0 = Instant::now();
    // (fault, node, spawned at) of agents started and not yet listening.
    let mut starting: Vec<(usize, usize, Instant)> = Vec::new();
    for k in 0..steps.len() {
        let (at, fi, action) = steps[k].clone();
        let due = t0 + Duration::from_millis(at);
        while Instant::now() < due {
            poll_starting(shared, nodes, faults, &mut starting, false);
            thread::sleep(TICK.min(due.saturating_duration_since(Instant::now())));
        }
        // A step never waits past the next one's time (a power cut's
        // catch), unless that is its own restart.
        let next_due = steps[k + 1..]
            .iter()
            .find(|s| s.1 != fi)
            .map(|s| t0 + Duration::from_millis(s.0));
        let f = &mut faults[fi];
        step(shared, nodes, etcd, f, fi, action, next_due, &mut starting);
    }
    poll_starting(shared, nodes, faults, &mut starting, true);
}

/// Records the agents that listen now; with `wait`, waits for all of them
/// (each bounded by `nodes::RESTART_TIMEOUT`).
fn poll_starting(
    shared: &Shared,
    nodes: &[Node],
    faults: &mut [Fault],
    starting: &mut Vec<(usize, usize, Instant)>,
    wait: bool,
) {
    starting.retain(|&(fi, ni, since)| {
        let n = &nodes[ni];
        let res = match n.start_state() {
            Start::Listening => Ok(()),
            // Killed by its failpoint before it listened: the fault's own
            // step starts it again.
            Start::Exited if n.armed.is_some() => {
                faults[fi].ev["died_before_listening"] = json!(true);
                return false;
            }
            Start::Exited => Err(n.exited_before_listening()),
            Start::Starting if wait => n.wait_listening().map(|_| ()),
            Start::Starting => return true,
        };
        match res {
            Ok(()) => faults[fi].ev["listening_after_ms"] = json!(since.elapsed().as_millis()),
            Err(e) => {
                faults[fi].ev["error"] = json!(e);
                shared.crashes.lock().expect("crashes lock").push(e);
            }
        }
        false
    });
}
