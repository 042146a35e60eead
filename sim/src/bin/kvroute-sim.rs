//! `kvroute-sim`: vLLM-compatible engine simulator. Prints one JSON line with the bound
//! addresses on stdout once every engine listens; logs go to stderr. See `kvroute_sim::cli`.

fn main() -> anyhow::Result<()> {
    kvroute_sim::cli::main()
}
