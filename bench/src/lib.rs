//! `kvroute-bench`: replay workloads through routing policies and compare them.
//!
//! Two modes share the workloads ([`workload`]), the session player ([`driver::Driver`]), the
//! engine model ([`kvroute_sim::engine::Rank`]), the routing core (`kvroute_picker::router`) and
//! the report ([`report`]):
//! * [`offline`]: a deterministic discrete-event simulation in virtual time, for sweeps;
//! * [`live`]: simulator processes, the picker (or any OpenAI-compatible router) and streaming
//!   HTTP clients on loopback, in (scaled) real time.
//!
//! The binary `kvroute-bench` is a thin wrapper over [`cli`].

pub mod ceiling;
pub mod classes;
pub mod cli;
pub mod driver;
pub mod live;
pub mod offline;
pub mod real_vllm;
pub mod report;
pub mod scale;
pub mod scenario;
pub mod stats;
pub mod workload;

use kvroute_picker::config::{RoutingConfig, Strategy};
use kvroute_sim::engine::EngineConfig;

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
    /// Offline: the first this many engines have role `prefill` (prefill/decode
    /// disaggregation), the rest `decode`; 0: every engine `both` (aggregated).
    pub prefill_engines: usize,
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
            prefill_engines: 0,
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
/// Where a live run's restarted picker gets a copy of the index from (`--warm-start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum WarmStartSource {
    /// Nowhere: it learns from the engines' events alone.
    #[default]
    None,
    /// Its own snapshot file, written every 10 s (the picker is killed, so the last periodic
    /// one is what it finds).
    Snapshot,
    /// A peer picker (needs `--pickers` 2 or more).
    Peer,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BenchOptions {
    pub cluster: ClusterConfig,
    /// Routing settings; the strategy is replaced by each policy compared.
    pub routing: RoutingConfig,
    /// How often engine metrics are sampled into the router's load view (ms of simulated
    /// time in offline mode; the picker's scrape interval in live mode).
    pub scrape_ms: f64,
    /// Several pickers: how often each publishes its in-flight counts to the others (ms of
    /// simulated time offline, the pickers' `peers.intervalMs` live); 0: they do not.
    pub peer_sync_ms: f64,
    /// Live, own pickers: where a restarted picker gets its index from (issue 52).
    pub warm_start: WarmStartSource,
    pub slo: Slo,
    pub max_requests: Option<usize>,
    /// Release no request after this many simulated ms.
    pub max_duration_ms: Option<f64>,
    /// Send each request's session id in the routing config's session header.
    pub session_header: bool,
    pub seed: u64,
    /// Measure decision latency with the wall clock (offline). Off, `decision_us_p99` is
    /// `null` and the JSON is byte-for-byte reproducible.
    pub time_decisions: bool,
    /// Live mode: what serves the requests.
    pub backend: Backend,
    /// Fold the prompts' token ids into a vocabulary of this size (a small real model's);
    /// `None` sends them as generated (`1000..121000`, inside a 128k vocabulary).
    pub token_vocab: Option<u32>,
    /// Live mode: replay sessions as chat conversations ([`live::chat`]) through
    /// `/v1/chat/completions`, the engines' replies carried into later turns as text.
    pub chat: bool,
    /// Chat mode: the model folder whose `tokenizer.json` and `tokenizer_config.json` the
    /// picker tokenizes with (set from the real engines' model).
    pub chat_tokenizer: Option<std::path::PathBuf>,
    /// Times the policy list runs, interleaved.
    pub repeat: usize,
    /// The picker's `index.provisionalTtl` in ms (`None`: its default; 0: off).
    pub provisional_ttl_ms: Option<u64>,
    /// Offline: drop the engines' lower-tier KV events before the picker sees them.
    pub tier_blind: bool,
    /// Offline: each session uses one of this many LoRA adapters (0: none).
    pub lora_adapters: u32,
    /// Offline: the picker's adapter terms off (`loraLoadMs`, `loraSlotWaitMs` 0).
    pub lora_blind: bool,
    /// Flow control on (`routing.flowControl` with these bands and tenants).
    pub flow_control: bool,
    /// This percentage of sessions is in the critical band (priority 1), the rest
    /// sheddable (priority -1); 0: one band.
    pub critical_percent: u8,
    /// Two tenants (fairness flows), the heavy one sending ten sessions for each of
    /// the light one's.
    pub two_tenants: bool,
    /// What happens to the cluster and the picker during the run ([`scenario::Scenario`]);
    /// the report then gives figures per phase. Live mode plays some kinds
    /// ([`live::events`]).
    pub scenario: scenario::Scenario,
    /// Pickers side by side, each routing every `pickers`-th request (by request id, as a
    /// client spreading requests over replicas), all fed every engine's events and scrapes
    /// (live: each its own process).
    pub pickers: usize,
}

impl BenchOptions {
    /// The picker's index settings for this run.
    pub fn index_settings(&self) -> kvroute_picker::service::settings::IndexSettings {
        let mut s = kvroute_picker::service::settings::IndexSettings::default();
        if let Some(ms) = self.provisional_ttl_ms {
            s.provisional_ttl = std::time::Duration::from_millis(ms);
        }
        s
    }
}

/// The engines of live mode.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Backend {
    /// kvroute-sim engines in a child process, a fresh set per policy.
    #[default]
    Sim,
    /// Real vLLM CPU engines ([`crate::real_vllm`]), started once and shared by the policies
    /// (their prefix caches are reset between policies).
    Vllm(VllmOptions),
}

/// The real-engine cluster of [`Backend::Vllm`] (the engine count, block size, running-batch
/// size and batched-token budget come from the [`ClusterConfig`]).
#[derive(Debug, Clone, PartialEq)]
pub struct VllmOptions {
    /// The model folder; default: the tiny model of `make_tiny_model.py` in the cache.
    pub model: Option<std::path::PathBuf>,
    /// `--kv-cache-memory-bytes` per engine.
    pub kv_cache_bytes: u64,
    pub max_model_len: u32,
    /// Cores to pin engines to (engine i on core i mod cores); default: the CPUs available.
    pub cores: Option<usize>,
}

impl Default for VllmOptions {
    fn default() -> Self {
        Self {
            model: None,
            kv_cache_bytes: 16 << 20,
            max_model_len: 8192,
            cores: None,
        }
    }
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            cluster: ClusterConfig::default(),
            routing: RoutingConfig::default(),
            scrape_ms: 100.0,
            peer_sync_ms: kvroute_picker::inflight::DEFAULT_PEER_INTERVAL_MS,
            warm_start: WarmStartSource::None,
            slo: Slo {
                ttft_ms: 2_000.0,
                tpot_ms: 100.0,
            },
            max_requests: None,
            max_duration_ms: None,
            session_header: false,
            seed: 0,
            time_decisions: true,
            backend: Backend::Sim,
            token_vocab: None,
            chat: false,
            chat_tokenizer: None,
            provisional_ttl_ms: None,
            tier_blind: false,
            lora_adapters: 0,
            lora_blind: false,
            flow_control: false,
            critical_percent: 0,
            two_tenants: false,
            repeat: 1,
            scenario: scenario::Scenario::default(),
            pickers: 1,
        }
    }
}

/// One policy's results.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyRun {
    pub summary: Summary,
    pub detail: RunDetail,
}

/// A policy to compare: one of the picker's strategies, optionally with the cost model's
/// `recomputeWeight` overridden (`cost-model:W`), so that weights can be swept on the same
/// trace. Every spec is a routing configuration the picker itself runs, offline and live.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicySpec {
    pub strategy: Strategy,
    /// `routing.costModel.recomputeWeight` for this run; `None` keeps the configured one.
    pub recompute_weight: Option<f64>,
    /// `routing.costModel.calibrate` for this run (`cost-model-static`: off); `None` keeps
    /// the configured one.
    pub calibrate: Option<bool>,
    /// `routing.costModel.displacementWeight` for this run (`cost-model@W`); `None` keeps the
    /// configured one. Cache balance counts sessions, so such a run sends the session header.
    pub displacement_weight: Option<f64>,
    /// Session admission on, with this `maxWait` in seconds (`cost-model+admit=S`); `None`
    /// keeps the configured setting. Admission counts sessions: such a run sends the session
    /// header.
    pub admit_wait_s: Option<f64>,
    /// `routing.admission.overcommit` for this run (`...+admit=S+over=F`).
    pub overcommit: Option<f64>,
    /// Send the session header with this policy's requests whatever `--session-header` says:
    /// `sticky-least-load` and `sticky-round-robin` (the load-only baselines keep a session
    /// where it was served), and `session-hash` (which hashes it).
    pub sessions: bool,
}

impl From<Strategy> for PolicySpec {
    fn from(strategy: Strategy) -> Self {
        Self {
            strategy,
            recompute_weight: None,
            calibrate: None,
            displacement_weight: None,
            admit_wait_s: None,
            overcommit: None,
            sessions: strategy == Strategy::SessionHash,
        }
    }
}

impl PolicySpec {
    /// The name in reports (`cost-model`, `cost-model:0`, `least-load`...).
    pub fn name(&self) -> String {
        let base = match self.calibrate {
            Some(false) => format!("{}-static", self.strategy.as_str()),
            // the load-only baselines with the session header are sticky; the cost model is
            // called so when the header is all that is added
            _ if self.sessions
                && (matches!(self.strategy, Strategy::LeastLoad | Strategy::RoundRobin)
                    || (self.strategy == Strategy::CostModel
                        && self.displacement_weight.is_none()
                        && self.admit_wait_s.is_none())) =>
            {
                format!("sticky-{}", self.strategy.as_str())
            }
            _ => self.strategy.as_str().into(),
        };
        let base = match self.recompute_weight {
            Some(w) => format!("{base}:{w}"),
            None => base,
        };
        let base = match self.displacement_weight {
            Some(w) => format!("{base}@{w}"),
            None => base,
        };
        let base = match self.admit_wait_s {
            Some(w) => format!("{base}+admit={w}"),
            None => base,
        };
        match self.overcommit {
            Some(o) => format!("{base}+over={o}"),
            None => base,
        }
    }

    /// The run's options: `opts`, with the session header on when this policy sends it.
    pub fn options<'o>(&self, opts: &'o BenchOptions) -> std::borrow::Cow<'o, BenchOptions> {
        if self.sessions && !opts.session_header {
            std::borrow::Cow::Owned(BenchOptions {
                session_header: true,
                ..opts.clone()
            })
        } else {
            std::borrow::Cow::Borrowed(opts)
        }
    }

    /// `base` with this spec's strategy and overrides applied.
    pub fn routing(
        &self,
        base: &kvroute_picker::config::RoutingConfig,
    ) -> kvroute_picker::config::RoutingConfig {
        let mut r = kvroute_picker::config::RoutingConfig {
            strategy: self.strategy,
            ..base.clone()
        };
        if let Some(w) = self.recompute_weight {
            r.cost_model.recompute_weight = w;
        }
        if let Some(c) = self.calibrate {
            r.cost_model.calibrate = c;
        }
        if let Some(w) = self.displacement_weight {
            r.cost_model.displacement_weight = w;
        }
        if let Some(w) = self.admit_wait_s {
            r.admission.enabled = true;
            r.admission.max_wait = std::time::Duration::from_secs_f64(w);
        }
        if let Some(o) = self.overcommit {
            r.admission.overcommit = o;
        }
        r
    }

    /// The policy object for the routing core.
    pub fn build(
        &self,
        base: &kvroute_picker::config::RoutingConfig,
        seed: u64,
    ) -> Box<dyn kvroute_picker::policy::Policy> {
        kvroute_picker::policy::build(&self.routing(base), seed)
    }
}

/// `name` split at `sep` into its head and the finite number at least `min` that follows.
fn number_suffix<'a>(
    name: &'a str,
    sep: &str,
    min: f64,
    what: &str,
) -> Result<(&'a str, Option<f64>), String> {
    let Some((head, v)) = name.split_once(sep) else {
        return Ok((name, None));
    };
    let v = v
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= min)
        .ok_or_else(|| format!("{what} in {name:?}"))?;
    Ok((head, Some(v)))
}

/// Parse a comma-separated policy list (`cost-model,least-load,...`).
pub fn parse_policies(list: &str) -> Result<Vec<PolicySpec>, String> {
    let mut out = Vec::new();
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        // `...+over=F`: session admission's overcommit
        let (name, overcommit) = number_suffix(name, "+over=", 0.1, "bad overcommit")?;
        // `...+admit=S`: with session admission, waiting at most S seconds
        let (name, admit_wait_s) = number_suffix(name, "+admit=", 0.001, "bad admission wait")?;
        // `cost-model@W`: with cache balance weighted W (and the session header)
        let (head, displacement_weight) = number_suffix(name, "@", 0.0, "bad displacement weight")?;
        let (strategy, weight) = match head.split_once(':') {
            Some((s, w)) => (s, Some(w)),
            None => (head, None),
        };
        // `sticky-least-load`, `sticky-round-robin`: the baseline with the session header
        let (strategy, sticky) = match strategy.strip_prefix("sticky-") {
            Some(s)
                if matches!(
                    Strategy::from_cli(s),
                    Some(Strategy::LeastLoad | Strategy::RoundRobin | Strategy::CostModel)
                ) =>
            {
                (s, true)
            }
            _ => (strategy, false),
        };
        // `cost-model-static`: the cost model with the configured constants only
        let (strategy, calibrate) = match strategy.strip_suffix("-static") {
            Some(s) if Strategy::from_cli(s) == Some(Strategy::CostModel) => (s, Some(false)),
            _ => (strategy, None),
        };
        let strategy = Strategy::from_cli(strategy).ok_or_else(|| {
            format!(
                "unknown policy {name:?}: expected cost-model[:RECOMPUTE_WEIGHT], \
                 cost-model-static[:RECOMPUTE_WEIGHT] (not calibrated), weighted, cache-aware, \
                 kv-cost, least-load, round-robin, random, session-hash, sticky-least-load, \
                 sticky-round-robin"
            )
        })?;
        let recompute_weight = match weight {
            None => None,
            Some(_) if strategy != Strategy::CostModel => {
                return Err(format!(
                    "{name:?}: only cost-model takes a weight (its recomputeWeight)"
                ));
            }
            Some(w) => Some(
                w.parse::<f64>()
                    .ok()
                    .filter(|w| w.is_finite() && *w >= 0.0)
                    .ok_or_else(|| format!("bad recompute weight in {name:?}"))?,
            ),
        };
        if displacement_weight.is_some() && strategy != Strategy::CostModel {
            return Err(format!(
                "{name:?}: only cost-model takes a displacement weight"
            ));
        }
        let spec = PolicySpec {
            strategy,
            recompute_weight,
            calibrate,
            displacement_weight,
            admit_wait_s,
            overcommit,
            sessions: sticky
                || strategy == Strategy::SessionHash
                || displacement_weight.is_some()
                || admit_wait_s.is_some(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_lists_parse_weights_and_the_static_cost_model() {
        let p = parse_policies("cost-model, cost-model-static:0,least-load,cost-model")
            .expect("valid list");
        assert_eq!(p.len(), 3, "duplicates dropped: {p:?}");
        assert_eq!(p[0].name(), "cost-model");
        assert_eq!(p[1].name(), "cost-model-static:0");
        let base = kvroute_picker::config::RoutingConfig::default();
        assert!(p[0].routing(&base).cost_model.calibrate);
        let r = p[1].routing(&base);
        assert!(!r.cost_model.calibrate);
        assert_eq!(r.cost_model.recompute_weight, 0.0);
        assert_eq!(p[2].strategy, Strategy::LeastLoad);
        assert!(parse_policies("least-load-static").is_err());
        assert!(parse_policies("least-load:3").is_err());
        assert!(parse_policies("cost-model:-1").is_err());
        assert!(parse_policies(" , ").is_err());
    }

    #[test]
    fn sticky_baselines_and_session_hash_send_the_session_header() {
        let p = parse_policies("sticky-least-load,sticky-round-robin,session-hash,least-load")
            .expect("valid");
        let names: Vec<String> = p.iter().map(PolicySpec::name).collect();
        assert_eq!(
            names,
            [
                "sticky-least-load",
                "sticky-round-robin",
                "session-hash",
                "least-load"
            ]
        );
        let sessions: Vec<bool> = p.iter().map(|s| s.sessions).collect();
        assert_eq!(sessions, [true, true, true, false]);
        let opts = BenchOptions::default();
        assert!(p[0].options(&opts).session_header);
        assert!(!p[3].options(&opts).session_header);
        assert!(
            parse_policies("sticky-weighted").is_err(),
            "only the load-only baselines and the cost model"
        );
        // the cost model with the session header, and with cache balance (which needs it)
        let p = parse_policies("sticky-cost-model,cost-model@4,cost-model:2@0.5").expect("valid");
        let names: Vec<String> = p.iter().map(PolicySpec::name).collect();
        assert_eq!(
            names,
            ["sticky-cost-model", "cost-model@4", "cost-model:2@0.5"]
        );
        assert!(p.iter().all(|s| s.sessions));
        let base = kvroute_picker::config::RoutingConfig::default();
        assert_eq!(p[1].routing(&base).cost_model.displacement_weight, 4.0);
        assert_eq!(p[0].routing(&base).cost_model.displacement_weight, 0.0);
        assert!(parse_policies("least-load@1").is_err());
        assert!(parse_policies("cost-model@-1").is_err());
        // session admission: any policy, with the session header
        let p = parse_policies(
            "cost-model@4+admit=120,least-load+admit=30,cost-model+admit=60+over=1.5",
        )
        .expect("valid");
        let names: Vec<String> = p.iter().map(PolicySpec::name).collect();
        assert_eq!(
            names,
            [
                "cost-model@4+admit=120",
                "sticky-least-load+admit=30",
                "cost-model+admit=60+over=1.5"
            ]
        );
        assert!(p.iter().all(|s| s.sessions));
        let r = p[0].routing(&base);
        assert!(r.admission.enabled);
        assert_eq!(r.admission.max_wait, std::time::Duration::from_secs(120));
        assert_eq!(r.admission.overcommit, 1.0);
        assert_eq!(p[2].routing(&base).admission.overcommit, 1.5);
        assert!(!base.admission.enabled, "off by default");
        assert!(parse_policies("cost-model+admit=0").is_err());
        assert!(parse_policies("cost-model+admit=1+over=0").is_err());
    }
}
