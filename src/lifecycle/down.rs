//! The calls down of one volume, from `releasing` to its record dropped:
//! NodeUnpublish, NodeUnstage when no other record on this node holds the
//! staging path, ControllerUnpublish (with the external node ID recorded at
//! attach time) only after the node side succeeded in this run and when no
//! other record holds the attachment, then the claim freed and the record
//! dropped in one transaction. Which of them answered lives here, in
//! memory: a crash redoes them all (NotFound counts as done).

use std::path::Path;
use std::time::Instant;

use super::core::{Core, Step, StepResult};
use super::error::StepError;
use super::progress::SentUp;
use crate::claims::ClaimChange;
use crate::failpoints;
use crate::plugins::PluginKind;
use crate::state::{AllocVolume, Phase};
use crate::volumes::mounted::{ensure_unmounted, StillMounted};
use crate::volumes::requests;

/// A call of the way down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    NodeUnpublish,
    NodeUnstage,
    ControllerUnpublish,
    FreeClaim,
}

/// Where one volume's way down stands in this run.
#[derive(Debug)]
pub struct Down {
    left: Vec<Call>,
    /// The calls up this record sent, when its intent is from this run
    /// (None: unknown, after a restart).
    sent: Option<SentUp>,
    /// The claim was marked node-detached (once, when the detach failed).
    node_detached_marked: bool,
}

impl Default for Down {
    fn default() -> Self {
        Down::new()
    }
}

impl Down {
    /// The way down of a volume whose calls up are known (its intent was
    /// recorded in this run): its own NodePublish is undone only when it
    /// was sent. The staging and the attachment are shared: the last
    /// holder tears them down when any record may have set them up
    /// (`Progress::stage_live`, `attachment_live`), whoever sent the call.
    /// Unknown (an intent from before a restart): the whole way.
    pub fn after(sent: Option<SentUp>) -> Down {
        let mut down = Down::new();
        if let Some(s) = sent {
            down.left.retain(|c| match c {
                Call::NodeUnpublish => s.node_publish,
                Call::NodeUnstage | Call::ControllerUnpublish | Call::FreeClaim => true,
            });
        }
        down.sent = sent;
        down
    }

    /// Whether this record's way down unstages `staging` when it is its
    /// last holder: its history is unknown, or a NodeStage of it (by this
    /// record or another) may have reached it and was not undone.
    fn unstages(&self, core: &Core, staging: &Path) -> bool {
        self.sent.map_or(true, |s| s.node_stage) || core.progress.stage_live(staging)
    }

    /// The same for the attachment of `volume_id` to `node_id`.
    fn detaches(&self, core: &Core, volume_id: &str, node_id: &str) -> bool {
        self.sent.map_or(true, |s| s.controller_publish)
            || core.progress.attachment_live(volume_id, node_id)
    }

    pub fn new() -> Down {
        Down {
            sent: None,
            node_detached_marked: false,
            left: vec![
                Call::NodeUnpublish,
                Call::NodeUnstage,
                Call::ControllerUnpublish,
                Call::FreeClaim,
            ],
        }
    }

    /// What `alloc status` shows while the next call is pending.
    pub fn step_name(&self) -> &'static str {
        match self.left.first() {
            Some(Call::NodeUnpublish) | None => "unpublishing",
            Some(Call::NodeUnstage) => "unstaging",
            Some(Call::ControllerUnpublish) => "controller-unpublishing",
            Some(Call::FreeClaim) => "releasing-claim",
        }
    }

    fn done(&mut self) {
        if !self.left.is_empty() {
            self.left.remove(0);
        }
    }

    /// Start over from `call` (a late mount appeared after a timeout).
    fn redo_from(&mut self, call: Call) {
        let all = Down::new().left;
        let i = all.iter().position(|c| *c == call).unwrap_or(0);
        self.left = all[i..].to_vec();
    }
}

/// The next call down, under the volume's operation lock.
pub fn step(
    core: &Core,
    alloc_id: &str,
    alias: &str,
    down: &mut Down,
    deadline: Instant,
) -> StepResult {
    let Some(rec) = core.record(alloc_id, alias) else {
        return Ok(Step::Done);
    };
    let _lock = core.lock_volume(&rec.volume_id)?;
    let Some(rec) = core.record(alloc_id, alias) else {
        return Ok(Step::Done);
    };
    match rec.phase {
        // No call was sent; the claim may or may not be held.
        Phase::Claiming => return core.free_and_drop(alloc_id, alias, &rec.volume_id),
        // Not marked by the release's first write (a mount step held the
        // lock): mark it now. The node side does not wait for the claim
        // store: a claim it cannot mark now stays held until it is freed.
        Phase::Mounting | Phase::Published => {
            let mark = ClaimChange::MarkReleasing {
                volume_id: rec.volume_id.clone(),
                alloc_id: alloc_id.to_string(),
            };
            let releasing = |v: &mut AllocVolume| v.phase = Phase::Releasing;
            match core.advance_with_claim(alloc_id, alias, mark, releasing) {
                Ok(()) => {}
                Err(StepError::Claim(e)) => {
                    log::warn!(
                        "release of {alloc_id}/{alias}: the claim cannot be marked releasing ({e}); unmounting anyway"
                    );
                    core.advance(alloc_id, alias, releasing)?;
                }
                Err(e) => return Err(e),
            }
            failpoints::hit("release-after-mark");
            return Ok(Step::Next);
        }
        Phase::Releasing => {}
    }
    let me = (alloc_id, alias);
    let Some(call) = down.left.first().copied() else {
        return Ok(Step::Done);
    };
    match call {
        Call::NodeUnpublish => {
            // A timed-out call up may still be running in the plugin: its
            // negation goes only once it had time to finish (else the
            // plugin finishes the publish after the unpublish).
            wait_out_uncertain(core, alloc_id, alias)?;
            let node = core
                .plugin_for_release(&rec.plugin_id, PluginKind::Node, deadline)
                .map_err(StepError::Plugin)?;
            failpoints::hit("before-node-unpublish");
            match node
                .client
                .node_unpublish_volume(&requests::node_unpublish(rec.volume_ref()))
            {
                Err(e) if !e.is_ignorable() => return Err(e.into()),
                _ => {}
            }
            failpoints::hit("after-node-unpublish");
            ensure_unmounted(&rec.target_path, "NodeUnpublishVolume")?;
            // The plugin removes the target; the agent removes the parents
            // it created, when empty.
            let _ = std::fs::remove_dir(&rec.target_path);
            core.paths.remove_empty_parents(&rec.target_path);
        }
        Call::NodeUnstage => {
            let staging = rec.staging_path.clone().unwrap_or_default();
            let (past, _) = core.progress.past_teardown();
            let others = core
                .store
                .read(|s| s.staging_users_but(&staging, me, &past));
            if rec.holds_staging && others == 0 && down.unstages(core, &staging) {
                wait_out_uncertain(core, alloc_id, alias)?;
                let node = core
                    .plugin_for_release(&rec.plugin_id, PluginKind::Node, deadline)
                    .map_err(StepError::Plugin)?;
                core.progress.set_staged(&staging, false);
                failpoints::hit("before-node-unstage");
                match node
                    .client
                    .node_unstage_volume(&requests::node_unstage(rec.volume_ref(), &staging))
                {
                    Err(e) if !e.is_ignorable() => return Err(e.into()),
                    _ => {}
                }
                failpoints::hit("after-node-unstage");
                ensure_unmounted(&staging, "NodeUnstageVolume")?;
                core.progress.stage_torn_down(&staging);
                let _ = std::fs::remove_dir(&staging);
                core.paths.remove_empty_parents(&staging);
            }
            // Unstaged, or left to the users still there: this record no
            // longer counts as one.
            core.progress.passed_staging(alloc_id, alias);
        }
        Call::ControllerUnpublish => {
            if let Some(redo) = settle(core, alloc_id, alias, &rec)? {
                down.redo_from(redo);
                return Ok(Step::Next);
            }
            // Past the unstage step (also when it was left out: nothing
            // was staged for this record in this run).
            core.progress.passed_staging(alloc_id, alias);
            let (_, past) = core.progress.past_teardown();
            let others = core
                .store
                .read(|s| s.attachment_users_but(&rec.volume_id, me, &past));
            let node_id = rec.external_node_id.as_deref().unwrap_or_default();
            if rec.holds_attachment && others == 0 && down.detaches(core, &rec.volume_id, node_id) {
                core.progress.set_attachment(&rec.volume_id, node_id, None);
                if let Err(e) = detach(core, &rec, deadline) {
                    // Shown in `claim list` while the detach is retried.
                    if !down.node_detached_marked {
                        down.node_detached_marked = true;
                        let mark = ClaimChange::MarkNodeDetached {
                            volume_id: rec.volume_id.clone(),
                            alloc_id: alloc_id.to_string(),
                            error: crate::error_chain(&e),
                        };
                        match core.transact(vec![mark], &|_| true, &mut |_, _| {}) {
                            Ok(_) => core.progress.marked_node_detached(alloc_id, alias),
                            Err(m) => log::info!(
                                "release of {alloc_id}/{alias}: claim not marked node-detached: {m}"
                            ),
                        }
                    }
                    return Err(e);
                }
                failpoints::hit("after-controller-unpublish");
                core.progress.attachment_torn_down(&rec.volume_id, node_id);
            }
            core.progress.passed_attachment(alloc_id, alias);
        }
        Call::FreeClaim => {
            if let Some(redo) = settle(core, alloc_id, alias, &rec)? {
                down.redo_from(redo);
                return Ok(Step::Next);
            }
            core.progress.passed_staging(alloc_id, alias);
            core.progress.passed_attachment(alloc_id, alias);
            let done = core.free_and_drop(alloc_id, alias, &rec.volume_id);
            if done.is_ok() {
                core.progress.forget_teardown(alloc_id, alias);
            }
            return done;
        }
    }
    down.done();
    Ok(Step::Next)
}

/// ControllerUnpublish of the record's attachment: through this node's
/// controller plugin, or, when the plugin has no controller side here, a
/// controller host on another node (the way it was attached).
fn detach(core: &Core, rec: &AllocVolume, deadline: Instant) -> Result<(), StepError> {
    let remote = core
        .claims
        .remote_controllers()
        .filter(|_| core.registry.serves(&rec.plugin_id, PluginKind::Controller) == Some(false));
    if let Some(remote) = remote {
        let req = super::up::attach_request(core, "", rec);
        failpoints::hit("before-controller-unpublish");
        remote.detach(&req, core.opts.attach_timeout, &core.shutdown)?;
        return Ok(());
    }
    let c = core
        .plugin_for_release(&rec.plugin_id, PluginKind::Controller, deadline)
        .map_err(StepError::Plugin)?;
    let spec = core.spec(&rec.volume_id);
    let req = requests::controller_unpublish(rec.volume_ref(), spec.as_deref());
    failpoints::hit("before-controller-unpublish");
    match c.client.controller_unpublish_volume(&req) {
        Err(e) if !e.is_ignorable() => Err(e.into()),
        _ => Ok(()),
    }
}

/// Before the detach and the freeing of the claim: when a call of this
/// volume timed out (the plugin may still be carrying it out), wait until
/// it had time to finish, then make sure none of the volume's paths became
/// a mount point meanwhile. One that did is undone again: Some(the call to
/// redo from); None: go on.
fn settle(
    core: &Core,
    alloc_id: &str,
    alias: &str,
    rec: &AllocVolume,
) -> Result<Option<Call>, StepError> {
    if core.progress.uncertain_since(alloc_id, alias).is_none() {
        return Ok(None);
    }
    wait_out_uncertain(core, alloc_id, alias)?;
    let mounted = |p: &Path| {
        crate::mounts::is_mount_point(p).map_err(|source| {
            StepError::StillMounted(StillMounted::Unknown {
                path: p.to_path_buf(),
                source,
            })
        })
    };
    if mounted(&rec.target_path)? {
        log::warn!(
            "release of {alloc_id}/{alias}: {} became a mount point after a timed-out call; unpublishing again",
            rec.target_path.display()
        );
        return Ok(Some(Call::NodeUnpublish));
    }
    if let Some(staging) = &rec.staging_path {
        let (past, _) = core.progress.past_teardown();
        let others = core
            .store
            .read(|s| s.staging_users_but(staging, (alloc_id, alias), &past));
        if others == 0 && mounted(staging)? {
            log::warn!(
                "release of {alloc_id}/{alias}: {} became a mount point after a timed-out call; unstaging again",
                staging.display()
            );
            return Ok(Some(Call::NodeUnstage));
        }
    }
    core.progress.clear_uncertain(alloc_id, alias);
    Ok(None)
}

/// When a call of this volume timed out (the plugin may still be carrying
/// it out), waits until it had time to finish: the plugin's bound, the CSI
/// call deadline, after the timeout. Under the volume's operation lock: no
/// other operation of this volume starts meanwhile. The mark stays, for
/// `settle`'s check before the detach and the free.
fn wait_out_uncertain(core: &Core, alloc_id: &str, alias: &str) -> Result<(), StepError> {
    let Some(since) = core.progress.uncertain_since(alloc_id, alias) else {
        return Ok(());
    };
    let until = since + core.opts.uncertain_settle;
    let now = Instant::now();
    if now < until {
        log::info!(
            "release of {alloc_id}/{alias}: a call timed out {:?} ago; waiting {:?} for the plugin to finish it before undoing it",
            now - since,
            until - now
        );
        if !core.shutdown.sleep(until - now) {
            return Err(StepError::Stopping);
        }
    }
    Ok(())
}
