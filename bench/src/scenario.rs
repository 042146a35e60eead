//! Scenario events: what happens to the cluster and the picker during a replay, on a timeline,
//! and the per-phase figures that show what each event cost.
//!
//! A timeline is a list of items `KIND@SECONDS[:KEY=VALUE,...]`, separated by `;` or new
//! lines (`--scenario`, `--scenario-file`); times are simulated seconds from the start:
//!
//! | item | what happens |
//! |---|---|
//! | `scale-out@T:n=N` | the last `N` engines are out of the pool until `T`, then join cold |
//! | `replace@T:engine=E,after=S` | engine `E` dies at `T` (its requests fail); an empty replacement (a new endpoint) joins `S` s later (default 5) |
//! | `restart@T:engine=E,down=S` | engine `E` restarts at `T` (its requests fail, its cache is lost); it is out of the pool for `S` s (default 5), then back, empty |
//! | `stale-metrics@T:for=S` | no scrape reaches the picker for `S` s (it keeps the last samples) |
//! | `event-delay@T:ms=M,for=S` | KV-event batches published during `S` s arrive `M` ms late |
//! | `event-loss@T:fraction=F,for=S` | each KV-event batch published during `S` s is lost with probability `F` |
//! | `picker-restart@T:replay=S` | the picker restarts at `T`: the requests it held fail, its index, loads, pins and calibration start empty; each engine replays the events of its last `S` s (default 0: the replay window has passed) |

use std::fmt::Write as _;

use serde::Serialize;

use super::stats::{self, RequestRecord, Slo};

/// One change on the timeline.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    ScaleOut { engines: usize },
    Replace { engine: usize, after_ms: f64 },
    Restart { engine: usize, down_ms: f64 },
    StaleMetrics { for_ms: f64 },
    EventDelay { delay_ms: f64, for_ms: f64 },
    EventLoss { fraction: f64, for_ms: f64 },
    PickerRestart { replay_ms: f64 },
}

impl Action {
    fn kind(&self) -> &'static str {
        match self {
            Action::ScaleOut { .. } => "scale-out",
            Action::Replace { .. } => "replace",
            Action::Restart { .. } => "restart",
            Action::StaleMetrics { .. } => "stale-metrics",
            Action::EventDelay { .. } => "event-delay",
            Action::EventLoss { .. } => "event-loss",
            Action::PickerRestart { .. } => "picker-restart",
        }
    }

    /// How long the event lasts after its start (0 for an instant).
    pub fn span_ms(&self) -> f64 {
        match *self {
            Action::Replace { after_ms, .. } => after_ms,
            Action::Restart { down_ms, .. } => down_ms,
            Action::StaleMetrics { for_ms }
            | Action::EventDelay { for_ms, .. }
            | Action::EventLoss { for_ms, .. } => for_ms,
            Action::ScaleOut { .. } | Action::PickerRestart { .. } => 0.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TimedAction {
    pub at_ms: f64,
    pub action: Action,
    /// The item as written, for the report.
    pub text: String,
}

/// The timeline of a run, in time order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Scenario {
    pub events: Vec<TimedAction>,
}

impl Scenario {
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Parse a timeline; errors name the item and what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut events = Vec::new();
        for item in text
            .split([';', '\n'])
            .map(str::trim)
            .filter(|s| !s.is_empty() && !s.starts_with('#'))
        {
            events.push(parse_item(item).map_err(|e| format!("scenario item {item:?}: {e}"))?);
        }
        events.sort_by(|a: &TimedAction, b| a.at_ms.total_cmp(&b.at_ms));
        Ok(Self { events })
    }

    /// Check the timeline against a cluster of `engines` engines.
    pub fn validate(&self, engines: usize) -> Result<(), String> {
        let mut out_at_start = 0;
        for e in &self.events {
            match e.action {
                Action::ScaleOut { engines: n } => out_at_start += n,
                Action::Replace { engine, .. } | Action::Restart { engine, .. }
                    if engine >= engines =>
                {
                    return Err(format!(
                        "scenario item {:?}: engine {engine} does not exist (engines are \
                         numbered 0..{engines})",
                        e.text
                    ));
                }
                _ => {}
            }
        }
        if out_at_start >= engines && out_at_start > 0 {
            return Err(format!(
                "the scale-out items keep {out_at_start} of {engines} engines out at the start: \
                 at least one must serve from the start"
            ));
        }
        Ok(())
    }

    /// Engines out of the pool at the start (the scale-out items' engines), each with the
    /// time it joins: the last engines of the cluster, in item order from the end.
    pub fn joining(&self, engines: usize) -> Vec<(usize, f64)> {
        let mut next = engines;
        let mut out = Vec::new();
        for e in &self.events {
            if let Action::ScaleOut { engines: n } = e.action {
                for _ in 0..n {
                    next = next.saturating_sub(1);
                    out.push((next, e.at_ms));
                }
            }
        }
        out
    }

    /// Whether `pred` holds for an event in force at `t_ms`.
    pub fn active(&self, t_ms: f64, pred: impl Fn(&Action) -> bool) -> Option<&Action> {
        self.events
            .iter()
            .find(|e| pred(&e.action) && e.at_ms <= t_ms && t_ms < e.at_ms + e.action.span_ms())
            .map(|e| &e.action)
    }
}

fn parse_item(item: &str) -> Result<TimedAction, String> {
    let (kind, rest) = item
        .split_once('@')
        .ok_or("expected KIND@SECONDS[:KEY=VALUE,...]")?;
    let (at, args) = rest.split_once(':').unwrap_or((rest, ""));
    let at_s: f64 = at
        .trim()
        .parse()
        .map_err(|_| format!("{at:?} is not a time in seconds"))?;
    if !(at_s.is_finite() && at_s >= 0.0) {
        return Err(format!(
            "the time must be a non-negative number, got {at_s}"
        ));
    }
    let mut kv: Vec<(&str, f64)> = Vec::new();
    for a in args.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        let (k, v) = a
            .split_once('=')
            .ok_or_else(|| format!("{a:?} is not KEY=VALUE"))?;
        let v: f64 = v
            .trim()
            .parse()
            .map_err(|_| format!("{k}: {v:?} is not a number"))?;
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("{k} must be a non-negative number, got {v}"));
        }
        kv.push((k.trim(), v));
    }
    let kind = kind.trim();
    let allowed: &[&str] = match kind {
        "scale-out" => &["n"],
        "replace" => &["engine", "after"],
        "restart" => &["engine", "down"],
        "stale-metrics" => &["for"],
        "event-delay" => &["ms", "for"],
        "event-loss" => &["fraction", "for"],
        "picker-restart" => &["replay"],
        other => {
            return Err(format!(
                "unknown kind {other:?} (scale-out, replace, restart, stale-metrics, \
                 event-delay, event-loss, picker-restart)"
            ));
        }
    };
    if let Some((k, _)) = kv.iter().find(|(k, _)| !allowed.contains(k)) {
        return Err(format!("{kind} takes {}, not {k:?}", allowed.join(", ")));
    }
    let get = |k: &str| kv.iter().find(|(n, _)| *n == k).map(|&(_, v)| v);
    let need = |k: &str| get(k).ok_or_else(|| format!("{kind} needs {k}=..."));
    let whole = |k: &str| -> Result<usize, String> {
        let v = need(k)?;
        if v.fract() != 0.0 || v > 1e6 {
            return Err(format!("{k} must be a whole number, got {v}"));
        }
        Ok(v as usize)
    };
    let action = match kind {
        "scale-out" => {
            let n = whole("n")?;
            if n == 0 {
                return Err("n must be at least 1".into());
            }
            Action::ScaleOut { engines: n }
        }
        "replace" => Action::Replace {
            engine: whole("engine")?,
            after_ms: get("after").unwrap_or(5.0) * 1000.0,
        },
        "restart" => Action::Restart {
            engine: whole("engine")?,
            down_ms: get("down").unwrap_or(5.0) * 1000.0,
        },
        "stale-metrics" => Action::StaleMetrics {
            for_ms: need("for")? * 1000.0,
        },
        "event-delay" => Action::EventDelay {
            delay_ms: need("ms")?,
            for_ms: need("for")? * 1000.0,
        },
        "event-loss" => {
            let fraction = need("fraction")?;
            if fraction > 1.0 {
                return Err(format!("fraction must be in [0, 1], got {fraction}"));
            }
            Action::EventLoss {
                fraction,
                for_ms: need("for")? * 1000.0,
            }
        }
        _ => Action::PickerRestart {
            replay_ms: get("replay").unwrap_or(0.0) * 1000.0,
        },
    };
    Ok(TimedAction {
        at_ms: at_s * 1000.0,
        action,
        text: item.to_string(),
    })
}

/// The figures of one phase: the requests released in `[from_s, to_s)`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Phase {
    /// What starts the phase (`start`, or the scenario item).
    pub label: String,
    pub from_s: f64,
    pub to_s: f64,
    pub requests: usize,
    pub errors: usize,
    pub hit_rate: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p90: f64,
    pub ttft_ms_p99: f64,
    pub e2e_ms_p50: f64,
    pub e2e_ms_p90: f64,
    pub slo_attainment: f64,
}

/// How long after an event the TTFT p90 came back.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recovery {
    pub event: String,
    /// p90 TTFT of the requests released in the [`STEADY_MS`] before the event and answered.
    pub steady_p90_ms: f64,
    /// Seconds from the event (or from its end, for an event that lasts) to the end of the
    /// first [`WINDOW_MS`] window whose p90 is within [`RECOVERED`] of the steady p90;
    /// `None` when none is before the end of the run.
    pub recovered_after_s: Option<f64>,
    /// Hit rate of the requests answered in the [`STEADY_MS`] before the event.
    pub steady_hit_rate: f64,
    /// Seconds from the event (or its end) to the end of the first [`WINDOW_MS`] window
    /// whose hit rate is at least [`RECOVERED_HIT`] of the steady one; `None` when none is.
    pub hit_recovered_after_s: Option<f64>,
}

/// The steady state an event is measured against: the requests released this long before it.
pub const STEADY_MS: f64 = 60_000.0;
/// The sliding window of the recovery search (it slides by a tenth of itself).
pub const WINDOW_MS: f64 = 10_000.0;
/// Back to steady: a window's p90 at most this multiple of the steady p90.
pub const RECOVERED: f64 = 1.2;
/// Back to steady: a window's hit rate at least this fraction of the steady hit rate.
pub const RECOVERED_HIT: f64 = 0.9;

fn figures(label: String, from_ms: f64, to_ms: f64, rs: &[&RequestRecord], slo: Slo) -> Phase {
    let ok: Vec<&&RequestRecord> = rs.iter().filter(|r| r.error.is_none()).collect();
    let ttft = stats::sorted(ok.iter().filter_map(|r| r.ttft_ms).collect());
    let e2e = stats::sorted(ok.iter().filter_map(|r| r.e2e_ms).collect());
    let attained = ok.iter().filter(|r| slo.met(r)).count();
    Phase {
        label,
        from_s: from_ms / 1000.0,
        to_s: to_ms / 1000.0,
        requests: rs.len(),
        errors: rs.len() - ok.len(),
        hit_rate: stats::cached_fraction(ok.iter().map(|r| **r)),
        ttft_ms_p50: stats::percentile(&ttft, 50.0),
        ttft_ms_p90: stats::percentile(&ttft, 90.0),
        ttft_ms_p99: stats::percentile(&ttft, 99.0),
        e2e_ms_p50: stats::percentile(&e2e, 50.0),
        e2e_ms_p90: stats::percentile(&e2e, 90.0),
        // every request counts: one that failed did not meet its target
        slo_attainment: if rs.is_empty() {
            0.0
        } else {
            attained as f64 / rs.len() as f64
        },
    }
}

/// The phases of a run: the scenario's start and end times cut the run, and each piece's
/// requests are those released in it.
pub fn phases(scenario: &Scenario, records: &[RequestRecord], slo: Slo) -> Vec<Phase> {
    let end = records
        .iter()
        .map(|r| r.release_ms)
        .fold(0.0, f64::max)
        .max(0.0)
        + 1.0;
    let mut cuts: Vec<(f64, String)> = vec![(0.0, "start".into())];
    for e in &scenario.events {
        cuts.push((e.at_ms, e.text.clone()));
        let span = e.action.span_ms();
        if span > 0.0 {
            cuts.push((e.at_ms + span, format!("end of {}", e.action.kind())));
        }
    }
    cuts.sort_by(|a, b| a.0.total_cmp(&b.0));
    // one phase per distinct start time; items at the same time share it
    let mut merged: Vec<(f64, String)> = Vec::new();
    for (t, label) in cuts {
        match merged.last_mut() {
            Some((lt, ll)) if (*lt - t).abs() < 1e-9 => {
                if ll == "start" {
                    *ll = label;
                } else {
                    ll.push_str(" + ");
                    ll.push_str(&label);
                }
            }
            _ => merged.push((t, label)),
        }
    }
    merged
        .iter()
        .enumerate()
        .filter(|&(_, (t, _))| *t < end)
        .map(|(i, (from, label))| {
            let to = merged.get(i + 1).map_or(end, |n| n.0.min(end));
            let rs: Vec<&RequestRecord> = records
                .iter()
                .filter(|r| r.release_ms >= *from && r.release_ms < to)
                .collect();
            figures(label.clone(), *from, to, &rs, slo)
        })
        .collect()
}

/// For every event: the steady p90 before it and when a window after it came back to it.
pub fn recoveries(scenario: &Scenario, records: &[RequestRecord]) -> Vec<Recovery> {
    // a request that failed counts as never answered (a window with failures is not back)
    let ttft_between = |from: f64, to: f64, failed: bool| {
        stats::sorted(
            records
                .iter()
                .filter(|r| r.release_ms >= from && r.release_ms < to)
                .filter(|r| failed || r.error.is_none())
                .map(|r| r.ttft_ms.unwrap_or(f64::INFINITY))
                .collect(),
        )
    };
    let hit_between = |from: f64, to: f64| {
        stats::cached_fraction(
            records
                .iter()
                .filter(|r| r.release_ms >= from && r.release_ms < to && r.error.is_none()),
        )
    };
    let end = records.iter().map(|r| r.release_ms).fold(0.0, f64::max);
    scenario
        .events
        .iter()
        .map(|e| {
            // the steady state: what was answered before (requests the event itself cut off
            // were released before it too)
            let steady = ttft_between((e.at_ms - STEADY_MS).max(0.0), e.at_ms, false);
            let steady_p90 = stats::percentile(&steady, 90.0);
            let steady_hit = hit_between((e.at_ms - STEADY_MS).max(0.0), e.at_ms);
            let from = e.at_ms + e.action.span_ms();
            let mut start = from;
            let mut recovered_after_s = None;
            let mut hit_recovered_after_s = None;
            while start + WINDOW_MS <= end
                && (recovered_after_s.is_none() || hit_recovered_after_s.is_none())
            {
                let after_s = (start + WINDOW_MS - from) / 1000.0;
                let w = ttft_between(start, start + WINDOW_MS, true);
                if recovered_after_s.is_none()
                    && !w.is_empty()
                    && steady_p90.is_finite()
                    && stats::percentile(&w, 90.0) <= RECOVERED * steady_p90
                {
                    recovered_after_s = Some(after_s);
                }
                if hit_recovered_after_s.is_none()
                    && !w.is_empty()
                    && hit_between(start, start + WINDOW_MS) >= RECOVERED_HIT * steady_hit
                {
                    hit_recovered_after_s = Some(after_s);
                }
                start += WINDOW_MS / 10.0;
            }
            Recovery {
                event: e.text.clone(),
                steady_p90_ms: steady_p90,
                recovered_after_s,
                steady_hit_rate: steady_hit,
                hit_recovered_after_s,
            }
        })
        .collect()
}

/// With several pickers, how the one a `picker-restart` restarted did on its first requests
/// after it came back, against the other pickers over the same span (issue 52: a picker
/// that joins warm ones routes as warm as they do).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RestartedPicker {
    /// Requests of the restarted picker counted (its first after the restart, at most 100).
    pub requests: usize,
    pub hit_rate: f64,
    /// The other pickers' requests released over the same span.
    pub others_requests: usize,
    pub others_hit_rate: f64,
}

/// [`RestartedPicker`] for picker 0 of `pickers` (request `id` goes to picker `id % pickers`),
/// from `records` and their request ids; `None` without a `picker-restart` or with one picker.
pub fn restarted_picker(
    scenario: &Scenario,
    records: &[RequestRecord],
    ids: &[u64],
    pickers: usize,
) -> Option<RestartedPicker> {
    const FIRST: usize = 100;
    if pickers < 2 {
        return None;
    }
    let at = scenario
        .events
        .iter()
        .find(|e| matches!(e.action, Action::PickerRestart { .. }))?
        .at_ms;
    let mut after: Vec<(&RequestRecord, bool)> = records
        .iter()
        .zip(ids)
        .filter(|(r, _)| r.release_ms >= at && r.error.is_none())
        .map(|(r, &id)| (r, id % pickers as u64 == 0))
        .collect();
    after.sort_by(|a, b| a.0.release_ms.total_cmp(&b.0.release_ms));
    let mine: Vec<&RequestRecord> = after
        .iter()
        .filter(|(_, m)| *m)
        .take(FIRST)
        .map(|(r, _)| *r)
        .collect();
    let until = mine.last()?.release_ms;
    let others: Vec<&RequestRecord> = after
        .iter()
        .filter(|(r, m)| !*m && r.release_ms <= until)
        .map(|(r, _)| *r)
        .collect();
    let hit = |rs: &[&RequestRecord]| {
        let prompt: f64 = rs.iter().map(|r| f64::from(r.prompt_tokens)).sum();
        let cached: f64 = rs
            .iter()
            .map(|r| f64::from(r.cached_tokens.unwrap_or(0)))
            .sum();
        if prompt > 0.0 { cached / prompt } else { 0.0 }
    };
    Some(RestartedPicker {
        requests: mine.len(),
        hit_rate: hit(&mine),
        others_requests: others.len(),
        others_hit_rate: hit(&others),
    })
}

/// The phase table and recoveries of one policy, for the terminal.
pub fn text(policy: &str, phases: &[Phase], recoveries: &[Recovery]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{policy}: per phase (requests by release time)\n  {:<34} {:>7} {:>7} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>6}",
        "phase", "from s", "reqs", "errs", "hit%", "TTFT p50", "p90", "p99", "E2E p50", "SLO%"
    );
    for p in phases {
        let mut label = p.label.clone();
        if label.len() > 34 {
            label.truncate(31);
            label.push_str("...");
        }
        let _ = writeln!(
            out,
            "  {label:<34} {:>7.1} {:>7} {:>6} {:>6.1} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>6.1}",
            p.from_s,
            p.requests,
            p.errors,
            p.hit_rate * 100.0,
            p.ttft_ms_p50,
            p.ttft_ms_p90,
            p.ttft_ms_p99,
            p.e2e_ms_p50,
            p.slo_attainment * 100.0
        );
    }
    for r in recoveries {
        let back = |after: Option<f64>, within: String| match after {
            Some(s) => format!("back within {within} of it {s:.0} s on"),
            None => "not back before the end of the run".into(),
        };
        let _ = writeln!(
            out,
            "  after {}: steady p90 {:.0} ms; {}; steady hit rate {:.1}%; {}",
            r.event,
            r.steady_p90_ms,
            back(r.recovered_after_s, format!("{RECOVERED}x")),
            r.steady_hit_rate * 100.0,
            back(r.hit_recovered_after_s, format!("{RECOVERED_HIT}x")),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(release_ms: f64, ttft: Option<f64>) -> RequestRecord {
        RequestRecord {
            release_ms,
            prompt_tokens: 100,
            ttft_ms: ttft,
            e2e_ms: ttft.map(|t| t + 100.0),
            tpot_ms: None,
            output_tokens: 10,
            cached_tokens: ttft.map(|_| 50),
            end_ms: release_ms + 200.0,
            error: ttft.is_none().then(|| "engine died".to_string()),
        }
    }

    /// Picker 0 of 4 restarted at 100 ms: its first requests after it (ids 0, 4, 8, ...) are
    /// compared with the others' released over the same span; failed requests do not count.
    #[test]
    fn the_restarted_pickers_first_requests_are_set_against_the_others() {
        let s = Scenario::parse("picker-restart@0.1").expect("parses");
        let mut records = Vec::new();
        let mut ids = Vec::new();
        for id in 0..1000u64 {
            let mut r = record(id as f64, Some(10.0));
            // the restarted picker's requests hit 20 of 100 tokens, the others' 60
            r.cached_tokens = Some(if id % 4 == 0 { 20 } else { 60 });
            if id == 104 {
                r.error = Some("lost".into());
            }
            records.push(r);
            ids.push(id);
        }
        let got = restarted_picker(&s, &records, &ids, 4).expect("a restart");
        assert_eq!(got.requests, 100);
        assert!((got.hit_rate - 0.2).abs() < 1e-9);
        assert!((got.others_hit_rate - 0.6).abs() < 1e-9);
        // ids 100..=500 (the 100th of picker 0, 104 having failed): the others' 300 in it
        assert_eq!(got.others_requests, 300);
        assert!(restarted_picker(&s, &records, &ids, 1).is_none());
        assert!(restarted_picker(&Scenario::default(), &records, &ids, 4).is_none());
    }

    #[test]
    fn parses_every_kind_and_sorts_by_time() {
        let s = Scenario::parse(
            "replace@120:engine=3,after=10; scale-out@60:n=2\nstale-metrics@30:for=5;\
             event-delay@40:ms=500,for=20; event-loss@50:fraction=0.25,for=10;\
             restart@90:engine=1; picker-restart@150:replay=30 # comment-free",
        );
        assert!(s.is_err(), "a trailing word is not a number");
        let s = Scenario::parse(
            "replace@120:engine=3,after=10; scale-out@60:n=2\nstale-metrics@30:for=5;\
             event-delay@40:ms=500,for=20; event-loss@50:fraction=0.25,for=10;\
             restart@90:engine=1; picker-restart@150:replay=30\n# a comment line",
        )
        .expect("parses");
        let kinds: Vec<(f64, &str)> = s
            .events
            .iter()
            .map(|e| (e.at_ms, e.action.kind()))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (30_000.0, "stale-metrics"),
                (40_000.0, "event-delay"),
                (50_000.0, "event-loss"),
                (60_000.0, "scale-out"),
                (90_000.0, "restart"),
                (120_000.0, "replace"),
                (150_000.0, "picker-restart"),
            ]
        );
        assert_eq!(
            s.events[4].action,
            Action::Restart {
                engine: 1,
                down_ms: 5_000.0
            }
        );
        assert_eq!(
            s.events[1].action,
            Action::EventDelay {
                delay_ms: 500.0,
                for_ms: 20_000.0
            }
        );
        assert_eq!(s.joining(8), vec![(7, 60_000.0), (6, 60_000.0)]);
        assert!(
            s.active(45_000.0, |a| matches!(a, Action::EventDelay { .. }))
                .is_some()
        );
        assert!(
            s.active(60_000.0, |a| matches!(a, Action::EventDelay { .. }))
                .is_none()
        );
    }

    #[test]
    fn bad_items_say_what_is_wrong() {
        for (text, want) in [
            ("reboot@10", "unknown kind"),
            ("restart@x:engine=1", "not a time"),
            ("restart@10", "needs engine"),
            ("restart@10:engine=1,for=3", "takes engine, down"),
            ("event-loss@10:fraction=2,for=1", "[0, 1]"),
            ("scale-out@10:n=1.5", "whole number"),
            ("stale-metrics@-1:for=1", "non-negative"),
            ("restart", "KIND@SECONDS"),
        ] {
            let err = Scenario::parse(text).expect_err(text);
            assert!(err.contains(want) && err.contains(text), "{text}: {err}");
        }
        let s = Scenario::parse("replace@10:engine=8").expect("parses");
        let err = s.validate(8).expect_err("engine 8 of 8");
        assert!(err.contains("engine 8 does not exist"), "{err}");
        let s = Scenario::parse("scale-out@10:n=4").expect("parses");
        assert!(s.validate(4).is_err() && s.validate(5).is_ok());
    }

    #[test]
    fn phases_cut_at_starts_and_ends_and_recovery_finds_the_first_good_window() {
        let s = Scenario::parse("restart@100:engine=0,down=20").expect("parses");
        let mut rs = Vec::new();
        // steady 100 ms for 100 s, failures and 5 s TTFTs while it is down, slow for 30 s
        // after it, then steady again
        for i in 0..300 {
            let t = f64::from(i) * 1000.0;
            let ttft = match t {
                t if t < 100_000.0 => Some(100.0),
                t if t < 120_000.0 => (i % 2 == 0).then_some(5_000.0),
                t if t < 150_000.0 => Some(1_000.0),
                _ => Some(110.0),
            };
            rs.push(record(t, ttft));
        }
        let slo = Slo {
            ttft_ms: 2_000.0,
            tpot_ms: 100.0,
        };
        let ph = phases(&s, &rs, slo);
        let labels: Vec<&str> = ph.iter().map(|p| p.label.as_str()).collect();
        assert_eq!(
            labels,
            vec!["start", "restart@100:engine=0,down=20", "end of restart"]
        );
        assert_eq!(
            ph.iter().map(|p| p.requests).collect::<Vec<_>>(),
            vec![100, 20, 180]
        );
        assert_eq!(ph[1].errors, 10);
        assert_eq!(ph[1].slo_attainment, 0.0, "failed or over the target");
        assert_eq!(ph[0].ttft_ms_p90, 100.0);
        assert!((ph[0].hit_rate - 0.5).abs() < 1e-9);
        let r = recoveries(&s, &rs);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].steady_p90_ms, 100.0);
        // the first window whose p90 is back: [149 s, 159 s), one slow request of ten (the
        // nearest-rank p90 of ten is the ninth), ending 39 s after the restart's end
        assert_eq!(r[0].recovered_after_s, Some(39.0));
        // every answered request had half its prompt cached: the hit rate is back at once
        assert!((r[0].steady_hit_rate - 0.5).abs() < 1e-9);
        assert_eq!(r[0].hit_recovered_after_s, Some(10.0));
        let text = text("cost-model", &ph, &r);
        assert!(text.contains("back within 1.2x of it 39 s on"), "{text}");
        assert!(
            text.contains("steady hit rate 50.0%; back within 0.9x of it 10 s on"),
            "{text}"
        );
    }
}
