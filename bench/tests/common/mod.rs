//! Fixtures shared by the offline replay tests.

use kvroute_bench::workload::generated::{GeneratorConfig, generate};
use kvroute_bench::{BenchOptions, ClusterConfig};

/// Four engines of 20,000 blocks, decisions untimed, seed 3.
pub fn small_options() -> BenchOptions {
    let mut cluster = ClusterConfig {
        engines: 4,
        ..ClusterConfig::default()
    };
    cluster.engine.num_blocks = 20_000;
    BenchOptions {
        cluster,
        time_decisions: false,
        seed: 3,
        ..BenchOptions::default()
    }
}

pub fn small_workload() -> kvroute_bench::workload::Workload {
    generate(
        &GeneratorConfig {
            groups: 4,
            system_tokens: 1_500,
            session_rate: 6.0,
            duration_s: 20.0,
            turns: 4.0,
            user_tokens: 400,
            output_tokens: 24,
            think_ms: 1_000.0,
            ..GeneratorConfig::default()
        },
        11,
    )
}
