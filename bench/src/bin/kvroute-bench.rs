//! `kvroute-bench`: trace replay and policy comparison, the engines and picker it starts,
//! and the one-command demo. See `kvroute_bench`.

/// The kvroute-picker binary's allocator, so that the `picker` subcommand's CPU and memory
/// are the shipped picker's (glibc malloc cost the scale bench's picker a sixth of its time).
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    match kvroute_bench::cli::main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
