//! `kvroute-bench`: trace replay and policy comparison, the engines and picker it starts,
//! and the one-command demo. See `kvroute_bench`.

fn main() -> std::process::ExitCode {
    match kvroute_bench::cli::main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
