//! Giving freed heap back to the kernel. glibc keeps memory a program
//! freed for reuse unless asked; after the moments that peak far above
//! what the agent keeps (reading the state at start, a large API answer
//! such as `alloc status` of 10,000 allocations, a burst of requests) the
//! agent asks.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// At most one give-back when the agent goes idle per this long.
const IDLE_GIVE_BACK_GAP: Duration = Duration::from_secs(1);

/// API requests being served.
static BUSY: AtomicUsize = AtomicUsize::new(0);
/// Milliseconds since `epoch()` of the last give-back (0: none yet).
static LAST_MS: AtomicU64 = AtomicU64::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    // At least 1, so that 0 stays "never".
    epoch().elapsed().as_millis() as u64 + 1
}

/// Returns the free pages of every malloc arena to the kernel
/// (malloc_trim(3)); a no-op on other C libraries. It walks the arenas, so
/// it runs after rare large work or when the agent goes idle, never on a
/// request's way.
pub fn give_back() {
    LAST_MS.store(now_ms(), Ordering::Relaxed);
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim(3) only returns free heap pages to the kernel; it
    // takes no pointer and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Held while an API request is served; the last one to end (the agent
/// goes idle) gives the freed heap back, at most once per
/// `IDLE_GIVE_BACK_GAP`, after its answer was sent.
pub struct Busy(());

pub fn busy() -> Busy {
    BUSY.fetch_add(1, Ordering::SeqCst);
    Busy(())
}

impl Drop for Busy {
    fn drop(&mut self) {
        if BUSY.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        let last = LAST_MS.load(Ordering::Relaxed);
        let now = now_ms();
        let gap = IDLE_GIVE_BACK_GAP.as_millis() as u64;
        if (last == 0 || now.saturating_sub(last) >= gap)
            && LAST_MS
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            give_back();
        }
    }
}
