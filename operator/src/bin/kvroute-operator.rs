use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvroute_operator::cli::run(kvroute_operator::cli::Args::parse()).await
}
