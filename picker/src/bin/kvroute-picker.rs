use clap::Parser;

/// jemalloc with background threads: freed memory goes back to the system a few seconds after
/// a burst (dirty pages decay in 10 s), where glibc malloc kept a burst's peak for good in
/// its per-thread arenas (issue 12, finding 7; figures in docs/RELIABILITY.md).
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvroute_picker::cli::run(kvroute_picker::cli::Args::parse()).await
}

#[cfg(all(test, not(target_env = "msvc")))]
mod tests {
    /// What gives memory back after a burst: without background threads, jemalloc purges
    /// only when the process allocates again, and an idle picker does not.
    #[test]
    fn the_binary_runs_on_jemalloc_with_background_purging() {
        assert_eq!(
            tikv_jemalloc_ctl::opt::background_thread::read().ok(),
            Some(true)
        );
    }
}
