//! `kvroute-bench`: replay workloads through routing policies and compare them.
//!
//! Two modes share the workloads ([`workload`]), the session player ([`driver::Driver`]), the
//! engine model ([`crate::sim::engine::Rank`]), the routing core (`kvroute_picker::router`) and
//! the report ([`report`]):
//! * [`offline`]: a deterministic discrete-event simulation in virtual time, for sweeps;
//! * [`live`]: simulator processes, the picker (or any OpenAI-compatible router) and streaming
//!   HTTP clients on loopback, in (scaled) real time.
//!
//! The binary `kvroute-bench` is a thin wrapper over [`cli`].

pub mod ceiling;
pub mod cli;
pub mod driver;
pub mod experiment;
pub mod live;
pub mod offline;
pub mod report;
pub mod stats;
pub mod workload;

use kvroute_picker::config::{RoutingConfig, Strategy};

use crate::sim::engine::EngineConfig;
pub use stats::{RunDetail, Slo, Summary};

/// The served model name of the simulated cluster.
pub const MODEL: &str = "sim-model";

/// Default KV capacity per engine rank, in tokens: an 8B-class model on an 80 GB GPU.
pub const DEFAULT_KV_TOKENS: u32 = 500_000;

/// The simulated cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    pub engines: usize,
    pub dp_size: u32,
    /// The engine model of every rank (`hash_seed` is set per engine).
    pub engine: EngineConfig,
    /// Simulated time runs this many times faster than real time (live mode).
    pub speedup: f64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            engines: 8,
            dp_size: 1,
            engine: EngineConfig {
                block_size: 16,
                num_blocks: DEFAULT_KV_TOKENS / 16,
                ..EngineConfig::default()
            },
            speedup: 1.0,
        }
    }
}

impl ClusterConfig {
    /// Endpoints (engine ranks) in the cluster.
    pub fn endpoints(&self) -> usize {
        self.engines * self.dp_size as usize
    }

    /// KV capacity of the whole cluster in tokens.
    pub fn capacity_tokens(&self) -> u64 {
        self.endpoints() as u64
            * u64::from(self.engine.num_blocks)
            * u64::from(self.engine.block_size)
    }
}

/// Options of one comparison, shared by both modes.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchOptions {
    pub cluster: ClusterConfig,
    /// Routing settings; the strategy is replaced by each policy compared.
    pub routing: RoutingConfig,
    /// How often engine metrics are sampled into the router's load view (ms of simulated
    /// time in offline mode; the picker's scrape interval in live mode).
    pub scrape_ms: f64,
    pub slo: Slo,
    pub max_requests: Option<usize>,
    /// Send each request's session id in the routing config's session header.
    pub session_header: bool,
    pub seed: u64,
    /// Measure decision latency with the wall clock (offline). Off, `decision_us_p99` is
    /// `null` and the JSON is byte-for-byte reproducible.
    pub time_decisions: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            cluster: ClusterConfig::default(),
            routing: RoutingConfig::default(),
            scrape_ms: 100.0,
            slo: Slo {
                ttft_ms: 2_000.0,
                tpot_ms: 100.0,
            },
            max_requests: None,
            session_header: false,
            seed: 0,
            time_decisions: true,
        }
    }
}

/// One policy's results.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyRun {
    pub summary: Summary,
    pub detail: RunDetail,
}

/// A policy to compare: one of the picker's strategies, or an experimental variant that only
/// the offline mode can run (see [`experiment`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PolicySpec {
    Builtin(Strategy),
    /// `cost-model-future[:WEIGHT]`: the cost model charging recomputed prefill `WEIGHT`
    /// times more (default 1).
    FutureCost {
        weight: f64,
    },
}

impl From<Strategy> for PolicySpec {
    fn from(s: Strategy) -> Self {
        Self::Builtin(s)
    }
}

impl PolicySpec {
    /// The name in reports.
    pub fn name(&self) -> String {
        match self {
            Self::Builtin(s) => s.as_str().into(),
            Self::FutureCost { weight } => format!("cost-model-future:{weight}"),
        }
    }

    /// The picker strategy it runs as (its routing config's `strategy`).
    pub fn strategy(&self) -> Option<Strategy> {
        match self {
            Self::Builtin(s) => Some(*s),
            Self::FutureCost { .. } => None,
        }
    }

    /// The policy object for the routing core.
    pub fn build(
        &self,
        routing: &kvroute_picker::config::RoutingConfig,
        seed: u64,
    ) -> Box<dyn kvroute_picker::policy::Policy> {
        match self {
            Self::Builtin(s) => kvroute_picker::policy::build(
                &kvroute_picker::config::RoutingConfig {
                    strategy: *s,
                    ..routing.clone()
                },
                seed,
            ),
            Self::FutureCost { weight } => Box::new(experiment::FutureCost {
                cal: routing.cost_model,
                weight: *weight,
            }),
        }
    }
}

/// Parse a comma-separated policy list (`cost-model,least-load,...`).
pub fn parse_policies(list: &str) -> Result<Vec<PolicySpec>, String> {
    let mut out = Vec::new();
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let spec = if let Some(rest) = name.strip_prefix("cost-model-future") {
            let weight = match rest.strip_prefix(':') {
                Some(w) => w
                    .parse::<f64>()
                    .ok()
                    .filter(|w| w.is_finite() && *w >= 0.0)
                    .ok_or_else(|| format!("bad weight in {name:?}"))?,
                None if rest.is_empty() => 1.0,
                None => return Err(format!("unknown policy {name:?}")),
            };
            PolicySpec::FutureCost { weight }
        } else {
            PolicySpec::Builtin(Strategy::from_cli(name).ok_or_else(|| {
                format!(
                    "unknown policy {name:?}: expected cost-model, weighted, cache-aware, \
                     kv-cost, least-load, round-robin, random (or the offline-only \
                     cost-model-future[:WEIGHT])"
                )
            })?)
        };
        if !out.contains(&spec) {
            out.push(spec);
        }
    }
    if out.is_empty() {
        return Err("--policies names no policy".into());
    }
    Ok(out)
}
