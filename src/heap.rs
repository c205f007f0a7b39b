//! Giving freed heap back to the kernel. glibc keeps memory a program
//! freed for reuse unless asked; after the few moments that peak far above
//! what the agent keeps (reading the state at start, a large API answer
//! such as `alloc status` of 10,000 allocations), the agent asks.

/// Returns the free pages of every malloc arena to the kernel
/// (malloc_trim(3)); a no-op on other C libraries. It walks the arenas, so
/// it is called after rare large work, never on a request's hot path.
pub fn give_back() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim(3) only returns free heap pages to the kernel; it
    // takes no pointer and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}
