//! The margin arithmetic of the disconnect rule, in one place. With ρ the
//! clock drift rate (`DRIFT`), τ a node's self-release check period plus
//! scheduling delay, U its longest unmount (`unmount_bound`) and M a margin
//! (`MARGIN`), the cluster acts on a node's claims no earlier than
//! `s + (TTL + W)(1−ρ)` after the send s of its last answered keep-alive,
//! and the node is done by `s + D(1+ρ) + τ + U`; observers wait
//! `W = D + U + τ + 2ρD + M` (`observer_wait`), a config that cannot meet
//! `(TTL + W)(1−ρ) > D(1+ρ) + τ + U + M` is refused (`check_margins`), and
//! a node that has not yet published its settings goes by the largest D
//! that meets it against what it published (`bounded_window`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// ρ: the drift rate assumed between two nodes' clocks (0.1 %: twenty
/// times what NTP-less quartz drifts, about 50 ppm). Only monotonic clocks
/// are compared with it, never two machines' wall clocks.
pub const DRIFT: f64 = 0.001;
/// M: slack on top of every bound (scheduling, a slow disk).
pub const MARGIN: Duration = Duration::from_secs(1);
/// Scheduling delay counted into τ on top of the check period.
pub const SCHEDULING_DELAY: Duration = Duration::from_millis(500);

/// How often a node checks its own lease for the self-release.
pub fn self_release_period(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_millis(250), Duration::from_secs(2))
}

/// τ for a node whose self-release check runs every `check_period`.
pub fn tau(check_period: Duration) -> Duration {
    check_period + SCHEDULING_DELAY
}

/// U for a node whose CSI calls have `csi_call` as deadline, each term at
/// its deadline: a call up sent just before the window ran out (allowed
/// without etcd until s + D) still running; the release's wait for a call
/// whose outcome is unknown before it tears down; then NodeUnpublish and
/// NodeUnstage. It assumes the node plugin answers: one that does not
/// (not ready at the release) can keep the volume mounted past it, and
/// only a fence protects then (the manual's safety.md).
pub fn unmount_bound(csi_call: Duration) -> Duration {
    csi_call * 4
}

/// W: how long an observer waits, after it first saw a node's liveness
/// gone, before the cluster acts on the node's claims.
pub fn observer_wait(window: Duration, unmount: Duration, tau: Duration) -> Duration {
    window + unmount + tau + window.mul_f64(2.0 * DRIFT) + MARGIN
}

/// Refuses settings under which the node might still be using a volume
/// when the cluster acts on its claims.
pub fn check_margins(
    ttl: Duration,
    window: Duration,
    unmount: Duration,
    tau: Duration,
) -> Result<(), String> {
    let w = observer_wait(window, unmount, tau);
    let cluster_acts = (ttl + w).mul_f64(1.0 - DRIFT);
    let node_done = window.mul_f64(1.0 + DRIFT) + tau + unmount + MARGIN;
    if cluster_acts > node_done {
        Ok(())
    } else {
        Err(format!(
            "the cluster could act on this node's claims {cluster_acts:?} after its last renewal, before it is done with its volumes ({node_done:?}): (lease_ttl + W)(1-{DRIFT}) must exceed stop_after_disconnect(1+{DRIFT}) + tau + U + M"
        ))
    }
}

/// The self-release settings of one registration, as the cluster reads
/// them: D (none: the cluster never acts on the node's claims), U, τ, and
/// the TTL of the lease the registration was made on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseBounds {
    pub window_ms: Option<u64>,
    pub unmount_bound_ms: u64,
    pub check_period_ms: u64,
    pub lease_ttl_ms: u64,
}

impl ReleaseBounds {
    /// The settings this agent publishes with `window`
    /// (`stop_after_disconnect`), `lease_ttl` and `csi_call`
    /// (`csi_call_timeout`).
    pub fn new(window: Option<Duration>, lease_ttl: Duration, csi_call: Duration) -> ReleaseBounds {
        let ms = |d: Duration| d.as_millis() as u64;
        ReleaseBounds {
            window_ms: window.map(ms),
            unmount_bound_ms: ms(unmount_bound(csi_call)),
            check_period_ms: ms(tau(self_release_period(lease_ttl))),
            lease_ttl_ms: ms(lease_ttl),
        }
    }

    pub fn window(&self) -> Option<Duration> {
        self.window_ms.map(Duration::from_millis)
    }

    pub fn lease_ttl(&self) -> Duration {
        Duration::from_millis(self.lease_ttl_ms)
    }

    fn unmount(&self) -> Duration {
        Duration::from_millis(self.unmount_bound_ms)
    }

    fn tau(&self) -> Duration {
        Duration::from_millis(self.check_period_ms)
    }
}

/// The window a node with settings `current` may use while the cluster may
/// still act by any of `published`: the largest D ≤ its own for which
/// `(TTL_p + W_p)(1−ρ) > D(1+ρ) + τ + U + M` holds against each published
/// set p (W_p from p's D, U and τ; τ and U the node's current ones). None
/// when neither the node nor anything published has a window.
pub fn bounded_window(current: &ReleaseBounds, published: &[ReleaseBounds]) -> Option<Duration> {
    let mut window = current.window();
    for p in published {
        let Some(d_p) = p.window() else {
            // The cluster never acts on the node by these.
            continue;
        };
        let cluster_acts =
            (p.lease_ttl() + observer_wait(d_p, p.unmount(), p.tau())).mul_f64(1.0 - DRIFT);
        let budget = cluster_acts
            .saturating_sub(current.tau() + current.unmount() + MARGIN)
            .div_f64(1.0 + DRIFT)
            // Strictly below: the inequality is strict.
            .saturating_sub(Duration::from_millis(1));
        window = Some(window.map_or(budget, |w| w.min(budget)));
    }
    window
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observers_wait_long_enough_for_the_defaults() {
        let ttl = Duration::from_secs(15);
        let d = Duration::from_secs(60);
        let u = unmount_bound(Duration::from_secs(60));
        let t = tau(Duration::from_secs(2));
        assert!(check_margins(ttl, d, u, t).is_ok());
        let w = observer_wait(d, u, t);
        assert!(w > d + u + t);
    }

    /// U covers what the release does after the window ran out, each at
    /// the CSI deadline: a call up still running, the wait for a call of
    /// unknown outcome, NodeUnpublish, NodeUnstage (until 2026-12-05 only
    /// the last two: issue 37, item 6).
    #[test]
    fn the_unmount_bound_covers_a_call_up_in_flight_and_the_uncertain_wait() {
        let c = Duration::from_secs(7);
        let (call_up, uncertain, unpublish, unstage) = (c, c, c, c);
        assert!(unmount_bound(c) >= call_up + uncertain + unpublish + unstage);
    }

    #[test]
    fn a_huge_window_with_a_tiny_ttl_is_refused() {
        // 2ρ²D grows past TTL(1−ρ) for a window of weeks on a 2 s lease.
        let r = check_margins(
            Duration::from_secs(2),
            Duration::from_secs(3_000_000),
            Duration::from_secs(10),
            Duration::from_secs(1),
        );
        assert!(r.is_err(), "{r:?}");
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn the_published_window_is_kept_when_nothing_changed() {
        let b = ReleaseBounds::new(Some(secs(60)), secs(15), secs(60));
        assert_eq!(bounded_window(&b, &[b]), Some(secs(60)));
        assert_eq!(bounded_window(&b, &[]), Some(secs(60)));
    }

    #[test]
    fn a_larger_window_than_published_is_cut_to_what_the_cluster_allows() {
        let old = ReleaseBounds::new(Some(secs(5)), secs(15), secs(1));
        let new = ReleaseBounds::new(Some(secs(600)), secs(15), secs(1));
        let w = bounded_window(&new, &[old]).expect("a window");
        // Somewhat more than 5 s (the published one has a TTL of slack)...
        assert!(w >= secs(5) && w < secs(5 + 15), "{w:?}");
        // ...and it meets rule 4 against what was published.
        let cluster_acts = (old.lease_ttl() + observer_wait(secs(5), old.unmount(), old.tau()))
            .mul_f64(1.0 - DRIFT);
        let node_done = w.mul_f64(1.0 + DRIFT) + new.tau() + new.unmount() + MARGIN;
        assert!(cluster_acts > node_done, "{cluster_acts:?} {node_done:?}");
    }

    #[test]
    fn a_longer_csi_deadline_than_published_shortens_the_window() {
        let old = ReleaseBounds::new(Some(secs(30)), secs(15), secs(5));
        let new = ReleaseBounds::new(Some(secs(30)), secs(15), secs(20));
        let w = bounded_window(&new, &[old]).expect("a window");
        // U grew by 4 × 15 s = 60 s; the TTL's slack is 15 s.
        assert_eq!(w, Duration::ZERO);
        // U grew by 20 s: 5 s more than the slack.
        let new = ReleaseBounds::new(Some(secs(30)), secs(15), secs(10));
        let w = bounded_window(&new, &[old]).expect("a window");
        assert!(w < secs(30) && w > secs(24), "{w:?}");
    }

    #[test]
    fn a_window_turned_off_while_the_cluster_knows_one_still_releases() {
        let old = ReleaseBounds::new(Some(secs(5)), secs(15), secs(1));
        let new = ReleaseBounds::new(None, secs(15), secs(1));
        assert!(bounded_window(&new, &[old]).is_some());
        // Published without a window: the cluster never acts.
        let off = ReleaseBounds::new(None, secs(15), secs(1));
        assert_eq!(bounded_window(&new, &[off]), None);
        // Of two that etcd may hold, the stricter counts.
        let on = ReleaseBounds::new(Some(secs(60)), secs(15), secs(1));
        assert_eq!(
            bounded_window(&on, &[off, old]),
            bounded_window(&on, &[old])
        );
    }
}
