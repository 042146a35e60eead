use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvroute_picker::cli::run(kvroute_picker::cli::Args::parse()).await
}
