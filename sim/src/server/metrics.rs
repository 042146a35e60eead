//! `/metrics` in vLLM's (or SGLang's) names and labels, written by hand so that the exposition
//! looks like the engines' Python `prometheus_client` output: counters declared by their base
//! name with `_total` samples, `vllm:cache_config_info` as an info gauge carrying the cache
//! configuration in labels, every series labelled with `model_name` and the rank (`engine`
//! for vLLM, `dp_rank` for SGLang).

use std::fmt::Write as _;

use crate::engine::{EngineStats, LoraState};

/// Reads one number out of a rank's stats.
type Stat = fn(&EngineStats) -> f64;

/// Reads one number out of a rank's adapter state.
type LoraStat = fn(&LoraState) -> f64;

/// vLLM's TTFT buckets (seconds).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's request latency buckets (seconds).
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A cumulative histogram with fixed buckets.
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn ttft() -> Self {
        Self::new(TTFT_BUCKETS)
    }

    pub fn e2e() -> Self {
        Self::new(E2E_BUCKETS)
    }

    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(self.counts.iter_mut()) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

/// Which engine's names to export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flavor {
    #[default]
    Vllm,
    Sglang,
}

/// One rank's numbers for the exposition.
pub(crate) struct RankMetrics {
    pub rank: u32,
    pub stats: EngineStats,
    pub lora: LoraState,
    pub ttft: Histogram,
    pub e2e: Histogram,
}

/// Everything `/metrics` shows.
pub(crate) struct Exposition<'a> {
    pub flavor: Flavor,
    /// Wall-clock seconds, the value of vLLM's time-valued info gauges.
    pub now_unix_s: f64,
    pub model: &'a str,
    pub prefix_caching: bool,
    pub dp_size: u32,
    pub ranks: &'a [RankMetrics],
}

struct Family<'a> {
    out: &'a mut String,
}

impl Family<'_> {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &str, value: f64) {
        let _ = writeln!(self.out, "{name}{{{labels}}} {}", fmt_value(value));
    }
}

fn fmt_value(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

impl Exposition<'_> {
    pub fn render(&self) -> String {
        match self.flavor {
            Flavor::Vllm => self.render_vllm(),
            Flavor::Sglang => self.render_sglang(),
        }
    }

    fn render_vllm(&self) -> String {
        let mut out = String::new();
        let mut f = Family { out: &mut out };
        let labels =
            |r: &RankMetrics| format!("engine=\"{}\",model_name=\"{}\"", r.rank, esc(self.model));
        let gauges: [(&str, &str, Stat); 3] = [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                |s| s.running as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                |s| s.waiting as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                |s| s.kv_usage,
            ),
        ];
        for (name, help, get) in gauges {
            f.header(name, "gauge", help);
            for r in self.ranks {
                f.sample(name, &labels(r), get(&r.stats));
            }
        }
        f.header(
            "vllm:cache_config_info",
            "gauge",
            "Information of the LLMEngine CacheConfig",
        );
        for r in self.ranks {
            let l = format!(
                "block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}\",engine=\"{}\",model_name=\"{}\",num_gpu_blocks=\"{}\"",
                r.stats.block_size,
                if self.prefix_caching { "True" } else { "False" },
                r.rank,
                esc(self.model),
                r.stats.num_blocks
            );
            f.sample("vllm:cache_config_info", &l, 1.0);
        }
        let counters: [(&str, &str, Stat); 5] = [
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                |s| s.prefix_cache_queries as f64,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                |s| s.prefix_cache_hits as f64,
            ),
            (
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                |s| s.prompt_tokens as f64,
            ),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                |s| s.generation_tokens as f64,
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                |s| s.preemptions as f64,
            ),
        ];
        for (name, help, get) in counters {
            f.header(name, "counter", help);
            for r in self.ranks {
                f.sample(&format!("{name}_total"), &labels(r), get(&r.stats));
            }
        }
        f.header(
            "vllm:prompt_tokens_by_source",
            "counter",
            "Number of prompt tokens by source.",
        );
        for r in self.ranks {
            let s = &r.stats;
            let computed = s
                .prompt_tokens
                .saturating_sub(s.prefix_cache_hits)
                .saturating_sub(s.remote_kv_tokens);
            for (source, v) in [
                ("local_compute", computed),
                ("local_cache_hit", s.prefix_cache_hits),
                ("external_kv_transfer", s.remote_kv_tokens),
            ] {
                f.sample(
                    "vllm:prompt_tokens_by_source_total",
                    &format!("{},source=\"{source}\"", labels(r)),
                    v as f64,
                );
            }
        }
        f.header(
            "vllm:request_success",
            "counter",
            "Count of successfully processed requests.",
        );
        for r in self.ranks {
            f.sample(
                "vllm:request_success_total",
                &format!("{},finished_reason=\"length\"", labels(r)),
                r.stats.finished_requests as f64,
            );
        }
        self.histogram(
            &mut f,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            |r| &r.ttft,
            &labels,
        );
        self.histogram(
            &mut f,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            |r| &r.e2e,
            &labels,
        );
        // vLLM's is server-wide (no engine label) and valued with the time it was written
        if let Some(max) = self.ranks.iter().find_map(|r| r.lora.max_loras) {
            let join = |pick: fn(&LoraState) -> &Vec<std::sync::Arc<str>>| {
                let mut names: Vec<&str> = self
                    .ranks
                    .iter()
                    .flat_map(|r| pick(&r.lora).iter().map(|n| &**n))
                    .collect();
                names.sort_unstable();
                names.dedup();
                esc(&names.join(","))
            };
            f.header(
                "vllm:lora_requests_info",
                "gauge",
                "Running stats on lora requests.",
            );
            f.sample(
                "vllm:lora_requests_info",
                &format!(
                    "max_lora=\"{max}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"",
                    join(|l| &l.running),
                    join(|l| &l.waiting)
                ),
                self.now_unix_s,
            );
        }
        out
    }

    fn render_sglang(&self) -> String {
        let mut out = String::new();
        let mut f = Family { out: &mut out };
        let dp = self.dp_size > 1;
        let labels = |r: &RankMetrics| {
            if dp {
                format!(
                    "dp_rank=\"{}\",model_name=\"{}\",tp_rank=\"0\"",
                    r.rank,
                    esc(self.model)
                )
            } else {
                format!("model_name=\"{}\",tp_rank=\"0\"", esc(self.model))
            }
        };
        let gauges: [(&str, &str, Stat); 4] = [
            (
                "sglang:num_running_reqs",
                "The number of running requests.",
                |s| s.running as f64,
            ),
            (
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
                |s| s.waiting as f64,
            ),
            ("sglang:token_usage", "The token usage.", |s| s.kv_usage),
            (
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
                |s| f64::from(s.num_blocks) * f64::from(s.block_size),
            ),
        ];
        for (name, help, get) in gauges {
            f.header(name, "gauge", help);
            for r in self.ranks {
                f.sample(name, &labels(r), get(&r.stats));
            }
        }
        let counters: [(&str, &str, Stat); 3] = [
            (
                "sglang:prompt_tokens",
                "Number of prefill tokens processed.",
                |s| s.prefix_cache_queries as f64,
            ),
            (
                "sglang:generation_tokens",
                "Number of generation tokens processed.",
                |s| s.generation_tokens as f64,
            ),
            (
                "sglang:num_requests",
                "Number of requests processed.",
                |s| s.finished_requests as f64,
            ),
        ];
        for (name, help, get) in counters {
            f.header(name, "counter", help);
            for r in self.ranks {
                f.sample(&format!("{name}_total"), &labels(r), get(&r.stats));
            }
        }
        f.header(
            "sglang:cached_tokens",
            "counter",
            "Number of cached prompt tokens.",
        );
        for r in self.ranks {
            f.sample(
                "sglang:cached_tokens_total",
                &format!("cache_source=\"device\",{}", labels(r)),
                r.stats.prefix_cache_hits as f64,
            );
        }
        self.histogram(
            &mut f,
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            |r| &r.ttft,
            &labels,
        );
        self.histogram(
            &mut f,
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            |r| &r.e2e,
            &labels,
        );
        if self.ranks.iter().any(|r| r.lora.max_loras.is_some()) {
            let pool: [(&str, &str, LoraStat); 3] = [
                (
                    "sglang:lora_pool_slots_used",
                    "Number of LoRA adapter slots currently occupied in GPU memory.",
                    |l| f64::from(l.slots_used),
                ),
                (
                    "sglang:lora_pool_slots_total",
                    "Total number of LoRA adapter slots available (max_loras_per_batch).",
                    |l| f64::from(l.max_loras.unwrap_or(0)),
                ),
                (
                    "sglang:lora_pool_utilization",
                    "LoRA pool utilization ratio (used/total). 1.0 means pool is full.",
                    |l| f64::from(l.slots_used) / f64::from(l.max_loras.unwrap_or(1).max(1)),
                ),
            ];
            for (name, help, get) in pool {
                f.header(name, "gauge", help);
                for r in self.ranks {
                    f.sample(name, &labels(r), get(&r.lora));
                }
            }
        }
        out
    }

    fn histogram(
        &self,
        f: &mut Family<'_>,
        name: &str,
        help: &str,
        get: impl Fn(&RankMetrics) -> &Histogram,
        labels: &impl Fn(&RankMetrics) -> String,
    ) {
        f.header(name, "histogram", help);
        for r in self.ranks {
            let h = get(r);
            let l = labels(r);
            for (b, c) in h.bounds.iter().zip(&h.counts) {
                f.sample(
                    &format!("{name}_bucket"),
                    &format!("{l},le=\"{b:?}\""),
                    *c as f64,
                );
            }
            f.sample(
                &format!("{name}_bucket"),
                &format!("{l},le=\"+Inf\""),
                h.count as f64,
            );
            f.sample(&format!("{name}_count"), &l, h.count as f64);
            f.sample(&format!("{name}_sum"), &l, h.sum);
        }
    }
}

/// Escapes a label value.
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use kvroute_routing::endpoint::EngineKind;
    use kvroute_routing::engine_metrics::{ParseLimits, parse_engine_metrics};

    fn ranks() -> Vec<RankMetrics> {
        (0..2)
            .map(|rank| {
                let mut ttft = Histogram::ttft();
                ttft.observe(0.03);
                RankMetrics {
                    rank,
                    stats: EngineStats {
                        waiting: 3 + rank as usize,
                        running: 5,
                        kv_usage: 0.25,
                        num_blocks: 1000,
                        block_size: 16,
                        prefix_cache_queries: 100,
                        prefix_cache_hits: 40,
                        ..EngineStats::default()
                    },
                    lora: LoraState {
                        running: vec!["sql".into()],
                        waiting: if rank == 1 {
                            vec!["chat".into()]
                        } else {
                            vec![]
                        },
                        max_loras: Some(4),
                        slots_used: 1 + rank,
                    },
                    ttft,
                    e2e: Histogram::e2e(),
                }
            })
            .collect()
    }

    #[test]
    fn vllm_and_sglang_expositions_parse() {
        let r = ranks();
        for (flavor, kind) in [
            (Flavor::Vllm, EngineKind::Vllm),
            (Flavor::Sglang, EngineKind::Sglang),
        ] {
            let text = Exposition {
                flavor,
                now_unix_s: 1.7e9,
                model: "m\"x",
                prefix_caching: true,
                dp_size: 2,
                ranks: &r,
            }
            .render();
            let m = parse_engine_metrics(&text, kind, &ParseLimits::default()).unwrap();
            let s1 = m.for_rank(1).unwrap();
            assert_eq!(
                (s1.waiting, s1.running, s1.kv_usage),
                (4.0, 5.0, 0.25),
                "{text}"
            );
            assert_eq!(s1.kv_capacity_tokens(), Some(16_000));
            assert_eq!(s1.prefix_cache_queries, Some(100.0));
            assert_eq!(s1.prefix_cache_hits, Some(40.0));
            assert_eq!(m.aggregate().waiting, 7.0);
            if flavor == Flavor::Vllm {
                assert_eq!(
                    (s1.block_size, s1.kv_capacity_blocks),
                    (Some(16), Some(1000))
                );
                assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"1\",model_name=\"m\\\"x\",le=\"0.04\"} 1.0"), "{text}");
                // one server-wide series: the union of the ranks' adapters
                let lora = s1.lora.expect("lora_requests_info");
                assert!(lora.runs("sql") && !lora.runs("chat"), "{text}");
                assert_eq!((lora.waiting, lora.max_lora), (1, Some(4)));
            } else {
                let lora = s1.lora.expect("lora pool gauges");
                assert_eq!(
                    (lora.max_lora, lora.slots_used),
                    (Some(4), Some(2)),
                    "{text}"
                );
                assert!(!lora.names_known());
            }
        }
    }
}
