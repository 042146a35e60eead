//! The few Prometheus series the live runner reads: engine counters per rank and the
//! picker's decision-latency histogram.

use std::collections::BTreeMap;

use kvroute_picker::engine_metrics::{self, ParseLimits, Sample};

/// Largest exposition read.
pub const MAX_BYTES: usize = 8 << 20;

/// The samples of an exposition, read by the picker's strict lexer (quoted and escaped label
/// values, timestamps, exemplars); lines it rejects are skipped, and a text over
/// [`MAX_BYTES`] reads as empty.
fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    const LIMITS: ParseLimits = ParseLimits {
        max_bytes: MAX_BYTES,
        max_lines: 1 << 20,
        max_labels_per_series: 128,
        max_label_value_len: 16 << 10,
        max_ranks: 1 << 16,
    };
    engine_metrics::samples(text, &LIMITS)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
}

/// Per-rank engine counters (vLLM names).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankCounters {
    pub prompt_tokens: f64,
    pub prefix_queries: f64,
    pub prefix_hits: f64,
    pub waiting: f64,
    pub running: f64,
}

/// Counters by the `engine` label (the DP rank).
pub fn engine_counters(text: &str) -> BTreeMap<u32, RankCounters> {
    let mut out: BTreeMap<u32, RankCounters> = BTreeMap::new();
    for s in samples(text) {
        let rank = s.label("engine").and_then(|e| e.parse().ok()).unwrap_or(0);
        let c = out.entry(rank).or_default();
        let v = s.value;
        match s.name {
            "vllm:prompt_tokens_total" => c.prompt_tokens += v,
            "vllm:prefix_cache_queries_total" => c.prefix_queries += v,
            "vllm:prefix_cache_hits_total" => c.prefix_hits += v,
            "vllm:num_requests_waiting" => c.waiting += v,
            "vllm:num_requests_running" => c.running += v,
            _ => {}
        }
    }
    out
}

/// The sum of `name`'s samples whose labels include every `(key, value)` of `with`.
pub fn counter_sum(text: &str, name: &str, with: &[(&str, &str)]) -> f64 {
    samples(text)
        .filter(|s| s.name == name && with.iter().all(|(k, v)| s.label(k) == Some(*v)))
        .map(|s| s.value)
        .sum()
}

/// The distinct values of label `label` on `name`'s samples, sorted.
pub fn label_values(text: &str, name: &str, label: &str) -> Vec<String> {
    let set: std::collections::BTreeSet<String> = samples(text)
        .filter(|s| s.name == name)
        .filter_map(|s| s.label(label).map(str::to_string))
        .collect();
    set.into_iter().collect()
}

/// Cumulative buckets `(le, count)` of a histogram, summed over label sets.
pub fn histogram(text: &str, name: &str) -> Vec<(f64, f64)> {
    let bucket = format!("{name}_bucket");
    let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for s in samples(text) {
        if s.name != bucket {
            continue;
        }
        let v = s.value;
        let le = match s.label("le") {
            Some("+Inf") => f64::INFINITY,
            Some(s) => match s.parse::<f64>() {
                Ok(x) => x,
                Err(_) => continue,
            },
            None => continue,
        };
        let e = by_le.entry(le.to_bits()).or_insert((le, 0.0));
        e.1 += v;
    }
    let mut v: Vec<(f64, f64)> = by_le.into_values().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// Quantile `q` of the difference of two cumulative histograms (`after - before`), linearly
/// interpolated inside the bucket (the first bucket from 0). `None` without observations.
pub fn histogram_quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|&(le, c)| {
            let b = before.iter().find(|(l, _)| *l == le).map_or(0.0, |x| x.1);
            (le, (c - b).max(0.0))
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let target = q * total;
    let mut prev_le = 0.0;
    let mut prev_c = 0.0;
    for &(le, c) in &delta {
        if c >= target {
            if !le.is_finite() {
                return Some(prev_le);
            }
            let frac = if c > prev_c {
                (target - prev_c) / (c - prev_c)
            } else {
                1.0
            };
            return Some(prev_le + (le - prev_le) * frac);
        }
        prev_le = le;
        prev_c = c;
    }
    Some(prev_le)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_over_matching_label_sets() {
        let text = "# TYPE d counter\n\
                    d{policy=\"a\",reason=\"session\"} 3\n\
                    d{policy=\"a\",reason=\"policy\"} 4\n\
                    d{policy=\"b\",reason=\"session\"} 5\n\
                    e 7\n";
        assert_eq!(counter_sum(text, "d", &[]), 12.0);
        assert_eq!(counter_sum(text, "d", &[("reason", "session")]), 8.0);
        assert_eq!(
            counter_sum(text, "d", &[("policy", "a"), ("reason", "session")]),
            3.0
        );
        assert_eq!(counter_sum(text, "e", &[]), 7.0);
        assert_eq!(counter_sum(text, "f", &[]), 0.0);
        assert_eq!(label_values(text, "d", "policy"), vec!["a", "b"]);
        assert!(label_values(text, "e", "policy").is_empty());
    }

    #[test]
    fn label_values_with_commas_escapes_and_timestamps_read_as_the_picker_reads_them() {
        // a splitter on ',' and '=' got every one of these wrong
        let text = "d{model=\"a,b=c\",reason=\"x\"} 2 1700000000000\n\
                    d{model=\"say \\\"hi\\\"\",reason=\"x\"} 3\n\
                    d{reason=\"x\"} 4 # {trace_id=\"t\"} 1.0\n\
                    d{reason=\"x\" 5\n";
        assert_eq!(counter_sum(text, "d", &[("model", "a,b=c")]), 2.0);
        assert_eq!(counter_sum(text, "d", &[("model", "say \"hi\"")]), 3.0);
        // the unterminated label set is skipped, the exemplar is not a value
        assert_eq!(counter_sum(text, "d", &[("reason", "x")]), 9.0);
        assert_eq!(
            label_values(text, "d", "model"),
            vec!["a,b=c".to_string(), "say \"hi\"".to_string()]
        );
    }

    #[test]
    fn counters_and_histograms_parse() {
        let text = "# HELP x\nvllm:prompt_tokens_total{engine=\"1\",model_name=\"m\"} 120.0\n\
                    vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 60\n\
                    h_bucket{le=\"0.001\"} 90\nh_bucket{le=\"0.002\"} 100\nh_bucket{le=\"+Inf\"} 100\n";
        let c = engine_counters(text);
        assert_eq!(c[&1].prompt_tokens, 120.0);
        assert_eq!(c[&1].prefix_hits, 60.0);
        let h = histogram(text, "h");
        assert_eq!(h.len(), 3);
        let p = histogram_quantile(&[], &h, 0.95).unwrap_or(0.0);
        assert!((p - 0.0015).abs() < 1e-9, "{p}");
    }
}
