//! Named threads with an owner that joins them within a bound and names the
//! ones that did not finish.

use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

/// Owns a set of named threads.
pub struct Threads {
    handles: Vec<(String, JoinHandle<()>)>,
    done_tx: Sender<String>,
    done_rx: Receiver<String>,
}

impl Default for Threads {
    fn default() -> Self {
        Self::new()
    }
}

impl Threads {
    pub fn new() -> Threads {
        let (done_tx, done_rx) = crossbeam_channel::unbounded();
        Threads {
            handles: Vec::new(),
            done_tx,
            done_rx,
        }
    }

    /// Spawns a named thread. A panic inside it is logged with the name.
    pub fn spawn(
        &mut self,
        name: impl Into<String>,
        f: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<()> {
        let name = name.into();
        let handle = spawn_named(name.clone(), f, Some(self.done_tx.clone()))?;
        self.handles.push((name, handle));
        Ok(())
    }

    /// Joins every thread that finishes before `deadline`; returns the names
    /// of those still running (they are detached).
    pub fn join_until(self, deadline: Instant) -> Vec<String> {
        let Threads {
            mut handles,
            done_tx,
            done_rx,
        } = self;
        drop(done_tx);
        while !handles.is_empty() {
            let wait = deadline.saturating_duration_since(Instant::now());
            match done_rx.recv_timeout(wait) {
                Ok(name) => {
                    if let Some(i) = handles.iter().position(|(n, _)| *n == name) {
                        let (_, h) = handles.swap_remove(i);
                        let _ = h.join();
                    }
                }
                Err(_) => break,
            }
        }
        handles.into_iter().map(|(n, _)| n).collect()
    }
}

/// Spawns a named thread that reports its name on `done` when it ends,
/// even by panic.
pub fn spawn_named(
    name: String,
    f: impl FnOnce() + Send + 'static,
    done: Option<Sender<String>>,
) -> std::io::Result<JoinHandle<()>> {
    struct Report(Option<(String, Sender<String>)>);
    impl Drop for Report {
        fn drop(&mut self) {
            if let Some((name, tx)) = self.0.take() {
                if std::thread::panicking() {
                    log::error!("thread {name} panicked");
                }
                let _ = tx.send(name);
            }
        }
    }
    let report_name = name.clone();
    std::thread::Builder::new().name(name).spawn(move || {
        let _report = Report(done.map(|tx| (report_name, tx)));
        f();
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn join_until_names_the_stuck_thread() {
        let mut t = Threads::new();
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        t.spawn("quick", || {}).expect("spawn");
        t.spawn("stuck", move || {
            let _ = stop_rx.recv();
        })
        .expect("spawn");
        let left = t.join_until(Instant::now() + Duration::from_millis(200));
        assert_eq!(left, vec!["stuck".to_string()]);
        drop(stop_tx);
    }
}
