//! One step of a fault (inject or undo), and the operator's actions a
//! step takes: unmounting a lost node's mounts, freeing its claims by hand.

use super::*;

#[allow(clippy::too_many_arguments)]
pub(super) fn step(
    shared: &Shared,
    nodes: &mut [Node],
    etcd: &mut EtcdCluster,
    f: &mut Fault,
    fi: usize,
    action: Action,
    next_due: Option<Instant>,
    starting: &mut Vec<(usize, usize, Instant)>,
) {
    let log = json!({"step": action.name(), "t_ms": shared.since_ms()});
    match f.ev["steps"].as_array_mut() {
        Some(l) => l.push(log),
        None => f.ev["steps"] = json!([log]),
    }
    match action {
        Action::CopyLeaseClock(ni) => {
            f.lease_clock = power_cut::read_lease_clock(&nodes[ni]);
        }
        Action::KillAgent(ni) => nodes[ni].agent.kill(),
        Action::PowerCut(ni, loss) => {
            let older = f.lease_clock.take();
            let report = power_cut::cut(shared, &mut nodes[ni], &loss, older, next_due);
            f.ev["power_cut"] = report;
        }
        Action::StartAgent(ni) => {
            nodes[ni].agent.spawn();
            starting.push((fi, ni, Instant::now()));
        }
        Action::Freeze(ni, with) => {
            let pid = nodes[ni].pid().expect("the agent runs");
            if with {
                shared.writers_paused[ni].store(true, Ordering::SeqCst);
            }
            send_signal(pid, libc::SIGSTOP);
            wait_until(STOP_TIMEOUT, "every thread of the agent to stop", || {
                all_threads_stopped(pid)
            });
            f.ev["stopped_ms"] = json!(shared.since_ms());
        }
        Action::Thaw(ni, _) => {
            if let Some(pid) = nodes[ni].pid() {
                send_signal(pid, libc::SIGCONT);
            }
            shared.writers_paused[ni].store(false, Ordering::SeqCst);
        }
        Action::CutLink(ni, how) => nodes[ni].link.cut(how),
        Action::HealLink(ni) => nodes[ni].link.heal(),
        Action::Isolate(mi) => {
            f.ev["member"] = json!(etcd.members[mi].name);
            f.ev["was_leader"] = json!(etcd.leader() == Some(mi));
            etcd.isolate(mi);
        }
        Action::HealEtcd => {
            let names: Vec<String> = etcd
                .leaders()
                .into_iter()
                .map(|i| etcd.members[i].name.clone())
                .collect();
            f.ev["leaders_before_heal"] = json!(names);
            etcd.heal();
        }
        // With a member that did not come back, a leader kill would leave
        // one of three: the cluster is not meant to survive that.
        Action::KillLeader if !etcd.not_back.is_empty() => {
            f.ev["skipped"] = json!("a member did not come back from an earlier restart");
        }
        Action::KillLeader => match etcd.leader() {
            None => f.ev["member"] = json!(null),
            Some(l) => {
                f.ev["member"] = json!(etcd.members[l].name);
                etcd.kill(l);
                f.killed = Some(l);
            }
        },
        Action::RestartLeader => {
            if let Some(l) = f.killed.take() {
                if let Err(e) = restart_member(etcd, l) {
                    // Two of three members still serve: the run goes on
                    // (the heal starts it again: `not_back`), and the
                    // summary says so.
                    f.ev["error"] = json!(e);
                    infrastructure_fault(shared, e);
                }
            }
        }
        Action::KillPlugin(ni) => nodes[ni].plugin.kill(),
        Action::StartPlugin(ni) => nodes[ni].plugin.restart(),
        Action::SetSlow(h, rules) => nodes[h].plugin.faults().set(rules),
        Action::ClearSlow(h) => nodes[h].plugin.faults().clear(),
        Action::Arm(ni, spec) => {
            let n = &mut nodes[ni];
            if let Some(point) = spec.split(':').next() {
                let said = format!("failpoint {point}: paused for");
                f.ev["held_seen_before"] = json!(n.agent.log().matches(&said).count());
            }
            n.agent.kill();
            n.agent.envs.retain(|(k, _)| k != FAILPOINT_ENV);
            n.agent.envs.push((FAILPOINT_ENV.to_string(), spec.clone()));
            n.armed = Some(spec);
            n.agent.spawn();
            starting.push((fi, ni, Instant::now()));
        }
        Action::Disarm(ni, restart) => {
            // A pause that never held the thread would hold it later,
            // outside this fault: restarted without it.
            let restart = restart || f.ev["held"] == false;
            let n = &mut nodes[ni];
            let died = n.agent_exited();
            f.ev["died_at_failpoint"] = json!(died);
            n.agent.envs.retain(|(k, _)| k != FAILPOINT_ENV);
            n.armed = None;
            if died || restart {
                n.agent.kill();
                n.agent.spawn();
                starting.push((fi, ni, Instant::now()));
            }
        }
        Action::CutWhenHeld(ni, point, wait_ms, cut_ms) => {
            let said = format!("failpoint {point}: paused for");
            let before = f.ev["held_seen_before"].as_u64().unwrap_or(0) as usize;
            let until = Instant::now() + Duration::from_millis(wait_ms);
            let held = loop {
                if nodes[ni].agent.log().matches(&said).count() > before {
                    break true;
                }
                if Instant::now() > until {
                    break false;
                }
                thread::sleep(Duration::from_millis(50));
            };
            f.ev["held"] = json!(held);
            f.ev["cut_t_ms"] = json!(shared.since_ms());
            nodes[ni].link.cut(Cut::Both);
            hold(cut_ms);
            nodes[ni].link.heal();
        }
        Action::NodeDown(ni) => {
            *shared.node_losses[ni].write().expect("node_losses lock") += 1;
            let n = &mut nodes[ni];
            n.agent.kill_now();
            // The plugin goes with the node (no call of it lands after
            // the sweep).
            n.plugin.kill();
            f.ev["down_t_ms"] = json!(shared.since_ms());
            f.ev["down_wall_ms"] = json!(crate::harness::workload::wall_ms());
            f.ev["unmounted"] = json!(unmount_under(&n.mount_root()));
        }
        Action::OperatorFree(ni, wait_ms) => operator_free(nodes, etcd, f, ni, wait_ms),
        Action::NodeUp(ni) => {
            f.ev["up_t_ms"] = json!(shared.since_ms());
            nodes[ni].plugin.restart();
            nodes[ni].agent.spawn();
            starting.push((fi, ni, Instant::now()));
        }
        Action::HealWhenReaped(ni, reaped, wait_ms) => {
            let key = format!(
                "{}/reaper-locks/{}",
                crate::harness::nodes::PREFIX,
                nodes[reaped].name
            );
            let client = etcd.client();
            let until = Instant::now() + Duration::from_millis(wait_ms);
            let locked = loop {
                if matches!(client.get(&key), Ok(Some(_))) {
                    break true;
                }
                if Instant::now() > until {
                    break false;
                }
                thread::sleep(Duration::from_millis(20));
            };
            f.ev["reaper_lock_seen"] = json!(locked);
            f.ev["healed_t_ms"] = json!(shared.since_ms());
            nodes[ni].link.heal();
        }
        Action::CutWhenBack(ni, wait_ms) => {
            let key = format!("{}/nodes/{}", crate::harness::nodes::PREFIX, nodes[ni].name);
            let client = etcd.client();
            let until = Instant::now() + Duration::from_millis(wait_ms);
            let back = loop {
                if matches!(client.get(&key), Ok(Some(_))) {
                    break true;
                }
                if Instant::now() > until {
                    break false;
                }
                thread::sleep(Duration::from_millis(20));
            };
            f.ev["registered_again"] = json!(back);
            f.ev["cut_again_t_ms"] = json!(shared.since_ms());
            nodes[ni].link.cut(Cut::Both);
        }
        Action::DeleteLiveness(ni) => {
            let key = format!("{}/nodes/{}", crate::harness::nodes::PREFIX, nodes[ni].name);
            match etcd.client().delete_range(key.as_bytes(), b"") {
                Ok(r) => f.ev["deleted"] = json!(r.deleted),
                Err(e) => f.ev["error"] = json!(e.to_string()),
            }
        }
    }
}

/// Unmounts (lazily, deepest first) every mount under `root`, as the
/// node's power loss would: how many.
fn unmount_under(root: &std::path::Path) -> usize {
    let root = root.to_string_lossy().into_owned();
    let mut count = 0;
    // Stacked mounts show again once the top one is gone.
    for _ in 0..4 {
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut points: Vec<String> = table
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(unescape_mount_point)
            .filter(|p| p.starts_with(&root))
            .collect();
        if points.is_empty() {
            break;
        }
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let Ok(c) = std::ffi::CString::new(p) else {
                continue;
            };
            // SAFETY: a valid NUL-terminated path.
            if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
                count += 1;
            }
        }
    }
    count
}

/// A mountinfo field with its octal escapes (`\040` for a space) undone.
fn unescape_mount_point(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let n = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(n);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The operator's hand on a lost node: once its liveness key is gone
/// (waited for up to `wait_ms`), every claim it holds is freed through
/// another node's agent: `volume detach --node` for a volume it holds an
/// attachment of, else `claim free`. What each answered goes into the
/// fault's event.
fn operator_free(nodes: &[Node], etcd: &EtcdCluster, f: &mut Fault, ni: usize, wait_ms: u64) {
    let name = nodes[ni].name.clone();
    let prefix = crate::harness::nodes::PREFIX;
    let client = etcd.client();
    let key = format!("{prefix}/nodes/{name}");
    let until = Instant::now() + Duration::from_millis(wait_ms);
    loop {
        if matches!(client.get(&key), Ok(None)) {
            break;
        }
        if Instant::now() > until {
            f.ev["error"] = json!(format!("{key} still there after {wait_ms} ms"));
            return;
        }
        thread::sleep(Duration::from_millis(100));
    }
    let Some(via) = nodes
        .iter()
        .position(|n| n.name != name && n.pid().is_some() && !n.agent_exited())
    else {
        f.ev["error"] = json!("no other agent runs");
        return;
    };
    let held: Vec<(String, String)> = match client.range_prefix(format!("{prefix}/claims/")) {
        Ok(r) => r
            .kvs
            .iter()
            .filter(|kv| {
                serde_json::from_slice::<Value>(&kv.value)
                    .is_ok_and(|v| v["claim"]["node"] == name.as_str())
            })
            .filter_map(|kv| {
                let k = kv.key_str().into_owned();
                let mut parts = k.rsplit('/');
                let alloc = parts.next()?.to_string();
                let volume = parts.next()?.to_string();
                Some((volume, alloc))
            })
            .collect(),
        Err(e) => {
            f.ev["error"] = json!(format!("read the claims: {e}"));
            return;
        }
    };
    let socket = nodes[via].socket();
    let reason = "nemesis: node lost";
    let mut done = Vec::new();
    let mut detached = std::collections::BTreeSet::new();
    for (volume, alloc) in held {
        let attached = client
            .get(format!("{prefix}/attachments/{volume}/{name}"))
            .is_ok_and(|kv| kv.is_some());
        let out = if attached {
            if !detached.insert(volume.clone()) {
                continue;
            }
            let args = [
                "volume", "detach", &volume, "--node", &name, "--reason", reason,
            ];
            crate::harness::nodes::cli(socket, &args, crate::harness::nodes::CLI_DEADLINE)
        } else {
            let args = ["claim", "free", &volume, &alloc, "--reason", reason];
            crate::harness::nodes::cli(socket, &args, crate::harness::nodes::CLI_DEADLINE)
        };
        done.push(json!({"volume": volume, "alloc": alloc, "detach": attached,
            "via": nodes[via].name, "outcome": out.brief(), "code": out.code}));
    }
    f.ev["freed_ok"] = json!(done.iter().all(|d| d["code"] == 0));
    f.ev["freed"] = json!(done);
}
