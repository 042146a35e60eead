//! Request classes of the overload scenario: a session's band (`--critical-percent`) and
//! tenant (`--two-tenants`), the headers that carry them to the picker in live mode, and the
//! per-class figures of a run. Offline and live runs classify sessions with the same function,
//! so the same sessions are critical in both.

use super::BenchOptions;
use super::stats::{self, RequestRecord};
use super::workload::tokens::mix64;

/// Classes are `band * 3 + tenant`; band 0 and tenant 0 mean "not split".
pub const COUNT: usize = 9;

/// The class of `session` under `opts`.
pub fn of(opts: &BenchOptions, session: u64) -> usize {
    let u = mix64(session ^ 0xf10e) % 100;
    let band = usize::from(opts.critical_percent > 0 && u < u64::from(opts.critical_percent))
        + usize::from(opts.critical_percent > 0);
    let tenant = if opts.two_tenants {
        1 + usize::from(session.is_multiple_of(11))
    } else {
        0
    };
    band * 3 + tenant
}

/// The priority of `class`: sheddable -1, critical 1, otherwise 0.
pub fn priority(class: usize) -> i32 {
    match class / 3 {
        1 => -1,
        2 => 1,
        _ => 0,
    }
}

/// The fairness flow of `class` (0 when tenants are not split).
pub fn flow(class: usize) -> u64 {
    (class % 3) as u64
}

/// The headers that carry `class` to the picker (its default flow-control header names).
pub fn headers(opts: &BenchOptions, class: usize) -> Vec<(&'static str, String)> {
    let mut h = Vec::new();
    if opts.critical_percent > 0 {
        h.push(("x-kvroute-priority", priority(class).to_string()));
    }
    if opts.two_tenants {
        let tenant = if flow(class) == 2 { "light" } else { "heavy" };
        h.push(("x-llm-d-inference-fairness-id", tenant.to_owned()));
    }
    h
}

/// Per class, when the run has more than one: name, requests, answered without service, TTFT
/// p50 and p90 of the served ones. `classes[i]` is the class of `records[i]`.
pub fn figures(
    opts: &BenchOptions,
    records: &[RequestRecord],
    classes: &[usize],
) -> Vec<(String, usize, usize, f64, f64)> {
    if opts.critical_percent == 0 && !opts.two_tenants {
        return Vec::new();
    }
    let mut out = Vec::new();
    for class in 0..COUNT {
        let of_class: Vec<&RequestRecord> = records
            .iter()
            .zip(classes)
            .filter(|(_, c)| **c == class)
            .map(|(r, _)| r)
            .collect();
        if of_class.is_empty() {
            continue;
        }
        let mut ttfts: Vec<f64> = of_class.iter().filter_map(|r| r.ttft_ms).collect();
        ttfts.sort_by(f64::total_cmp);
        let band = ["", "sheddable", "critical"][class / 3];
        let tenant = ["", "heavy tenant", "light tenant"][class % 3];
        let name = [band, tenant]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(", ");
        out.push((
            name,
            of_class.len(),
            of_class.iter().filter(|r| r.error.is_some()).count(),
            stats::percentile(&ttfts, 50.0),
            stats::percentile(&ttfts, 90.0),
        ));
    }
    out
}
