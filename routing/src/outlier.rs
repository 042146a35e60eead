//! Passive health: outlier detection as Envoy does it.
//!
//! An engine that fails fast looks idle (its queue is empty, its metrics are healthy), so a
//! load-aware policy keeps choosing it. The detector watches what requests actually got:
//! `consecutive5xx` error responses in a row, or `consecutiveGatewayFailure` gateway errors in
//! a row (502/503/504, a refused or reset connection, a connection closed before the response,
//! no response in time), eject the endpoint for `baseEjectionTime × ejections` (capped at
//! `maxEjectionTime`). It comes back by itself when that time is over. At most
//! `maxEjectionPercent` of a model config's endpoints, and never all of them, are ejected at
//! once: detection alone can never empty a pool.
//!
//! Failures are charged to an endpoint only when they are its own. A request can fail by
//! itself (a body the engine answers with 500, a generation longer than `upstreamTimeout`),
//! and a client repeating one would otherwise eject healthy endpoints. So, besides what the
//! callers leave out (a request that failed on every endpoint it was tried on; the timeout of
//! a non-streamed request, whose response head waits for its whole generation), a trigger
//! ejects only while the endpoint is failing against its pool: when at least half of the
//! other endpoints of its group in rotation have also failed within `baseEjectionTime`
//! without a success since, the failures are the traffic's, and nobody is ejected (the
//! counters stay, and count again once the others recover). This is the pool-relative idea of
//! Envoy's success-rate detection, applied to the consecutive triggers.
//!
//! This is a state machine without I/O or clocks: results and the time go in, ejections come
//! out, so every rule is a unit or property test.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::duration_str;
use crate::endpoint::EndpointId;

/// `limits.outlierDetection` in the picker config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct OutlierDetection {
    /// Error responses (any 5xx, gateway errors included) in a row that eject an endpoint;
    /// 0 turns this trigger off.
    #[serde(rename = "consecutive5xx")]
    pub consecutive_5xx: u32,
    /// Gateway errors in a row that eject an endpoint: 502, 503, 504, a refused or reset
    /// connection, a connection closed before the response, no response within
    /// `upstreamTimeout`; 0 turns this trigger off.
    pub consecutive_gateway_failure: u32,
    /// How long the first ejection lasts; each further ejection lasts one more of it.
    #[serde(with = "duration_str")]
    pub base_ejection_time: Duration,
    /// The longest an ejection lasts.
    #[serde(with = "duration_str")]
    pub max_ejection_time: Duration,
    /// Most of a model config's endpoints ejected at once, in percent (0 turns ejection
    /// off). Never all of them, whatever the value.
    pub max_ejection_percent: u32,
}

impl Default for OutlierDetection {
    fn default() -> Self {
        Self {
            consecutive_5xx: 5,
            consecutive_gateway_failure: 5,
            base_ejection_time: Duration::from_secs(10),
            max_ejection_time: Duration::from_secs(300),
            max_ejection_percent: 50,
        }
    }
}

impl OutlierDetection {
    /// Errors name the field (`prefix` is where the block sits, e.g. `limits.outlierDetection`).
    pub fn validate(&self, prefix: &str) -> Result<(), String> {
        if self.base_ejection_time.is_zero() {
            return Err(format!("{prefix}.baseEjectionTime must be positive"));
        }
        if self.max_ejection_time < self.base_ejection_time {
            return Err(format!(
                "{prefix}.maxEjectionTime must be at least {prefix}.baseEjectionTime"
            ));
        }
        if self.max_ejection_percent > 100 {
            return Err(format!(
                "{prefix}.maxEjectionPercent must be between 0 and 100"
            ));
        }
        Ok(())
    }
}

/// What one request got from an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Anything but a 5xx (a 4xx is the client's problem, not the engine's).
    Success,
    /// A 5xx other than a gateway error (500, 501, ...).
    ServerError,
    /// 502, 503, 504, or the connection failed before a response (refused, reset, closed,
    /// timed out).
    GatewayError,
}

impl Outcome {
    pub fn from_status(status: u16) -> Self {
        match status {
            502..=504 => Self::GatewayError,
            500..=599 => Self::ServerError,
            _ => Self::Success,
        }
    }
}

/// Which rule ejected an endpoint (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    Consecutive5xx,
    ConsecutiveGatewayFailure,
}

impl Trigger {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Consecutive5xx => "consecutive_5xx",
            Self::ConsecutiveGatewayFailure => "consecutive_gateway_failure",
        }
    }
}

/// An endpoint was just ejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ejection {
    pub endpoint: EndpointId,
    pub trigger: Trigger,
    /// Back in rotation from this time on (milliseconds on the caller's clock).
    pub until_ms: u64,
    /// Ejections counted for the multiplier, this one included.
    pub ejections: u32,
}

/// What the detector knows about one endpoint, for `/debug/endpoints`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OutlierStatus {
    pub consecutive_5xx: u32,
    pub consecutive_gateway_failure: u32,
    /// The ejection multiplier (decays while the endpoint behaves).
    pub ejections: u32,
    /// Set while ejected: back in rotation at this time (ms since the picker started).
    pub ejected_until_ms: Option<u64>,
}

#[derive(Debug, Clone)]
struct Health {
    group: Arc<str>,
    consecutive_5xx: u32,
    consecutive_gateway: u32,
    ejections: u32,
    /// End of the current or the last ejection.
    ejected_until_ms: Option<u64>,
    /// When the current run of failures last grew.
    last_failure_ms: u64,
}

impl Health {
    fn new(group: Arc<str>) -> Self {
        Self {
            group,
            consecutive_5xx: 0,
            consecutive_gateway: 0,
            ejections: 0,
            ejected_until_ms: None,
            last_failure_ms: 0,
        }
    }

    /// Whether the endpoint has failed within `window_ms` of `now_ms` with no success since.
    fn failing(&self, now_ms: u64, window_ms: u64) -> bool {
        self.consecutive_5xx > 0 && now_ms.saturating_sub(self.last_failure_ms) < window_ms
    }

    fn is_ejected(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.is_some_and(|until| now_ms < until)
    }

    /// The multiplier, less one for every `base` spent back in rotation since the last
    /// ejection ended (Envoy decrements it every interval the host is not ejected).
    fn decayed_ejections(&self, now_ms: u64, base_ms: u64) -> u32 {
        match self.ejected_until_ms {
            Some(until) if now_ms >= until => {
                let healthy_periods = (now_ms - until) / base_ms.max(1);
                self.ejections
                    .saturating_sub(u32::try_from(healthy_periods).unwrap_or(u32::MAX))
            }
            _ => self.ejections,
        }
    }
}

/// The outlier detector of one picker: endpoints grouped by model config.
#[derive(Debug, Clone)]
pub struct OutlierDetector {
    settings: OutlierDetection,
    endpoints: BTreeMap<EndpointId, Health>,
}

impl OutlierDetector {
    pub fn new(settings: OutlierDetection) -> Self {
        Self {
            settings,
            endpoints: BTreeMap::new(),
        }
    }

    pub fn settings(&self) -> &OutlierDetection {
        &self.settings
    }

    /// The endpoints of the pool and the group (model config) of each. Endpoints that stay
    /// keep their state; departed ones are forgotten (returned, so their metrics can go).
    pub fn set_pool(
        &mut self,
        members: impl IntoIterator<Item = (EndpointId, Arc<str>)>,
    ) -> Vec<EndpointId> {
        let mut next = BTreeMap::new();
        for (id, group) in members {
            let mut h = self
                .endpoints
                .remove(&id)
                .unwrap_or_else(|| Health::new(group.clone()));
            h.group = group;
            next.insert(id, h);
        }
        let departed = std::mem::replace(&mut self.endpoints, next);
        departed.into_keys().collect()
    }

    /// Most endpoints of `group` that may be ejected at once.
    fn max_ejected(&self, group: &str) -> usize {
        let size = self
            .endpoints
            .values()
            .filter(|h| &*h.group == group)
            .count();
        let by_percent = size * self.settings.max_ejection_percent as usize / 100;
        by_percent.min(size.saturating_sub(1))
    }

    /// Whether at least half of the other endpoints of `group` in rotation are failing too
    /// (see the module docs): then the failures are the traffic's.
    fn pool_failing(&self, group: &str, except: &EndpointId, now_ms: u64) -> bool {
        let window = duration_ms(self.settings.base_ejection_time);
        let (mut others, mut failing) = (0usize, 0usize);
        for (id, h) in &self.endpoints {
            if id == except || &*h.group != group || h.is_ejected(now_ms) {
                continue;
            }
            others += 1;
            if h.failing(now_ms, window) {
                failing += 1;
            }
        }
        others > 0 && failing * 2 >= others
    }

    fn ejected_in(&self, group: &str, now_ms: u64) -> usize {
        self.endpoints
            .values()
            .filter(|h| &*h.group == group && h.is_ejected(now_ms))
            .count()
    }

    /// Count one result. Results for an endpoint outside the pool, or one ejected right now
    /// (requests that were in flight when it was ejected), change nothing.
    pub fn on_result(
        &mut self,
        endpoint: EndpointId,
        outcome: Outcome,
        now_ms: u64,
    ) -> Option<Ejection> {
        let s = &self.settings;
        let h = self.endpoints.get_mut(&endpoint)?;
        if h.is_ejected(now_ms) {
            return None;
        }
        match outcome {
            Outcome::Success => {
                h.consecutive_5xx = 0;
                h.consecutive_gateway = 0;
                return None;
            }
            Outcome::ServerError => {
                h.consecutive_5xx += 1;
                h.consecutive_gateway = 0;
                h.last_failure_ms = now_ms;
            }
            Outcome::GatewayError => {
                h.consecutive_5xx += 1;
                h.consecutive_gateway += 1;
                h.last_failure_ms = now_ms;
            }
        }
        let trigger = if s.consecutive_gateway_failure > 0
            && h.consecutive_gateway >= s.consecutive_gateway_failure
        {
            Trigger::ConsecutiveGatewayFailure
        } else if s.consecutive_5xx > 0 && h.consecutive_5xx >= s.consecutive_5xx {
            Trigger::Consecutive5xx
        } else {
            return None;
        };
        let group = h.group.clone();
        if self.ejected_in(&group, now_ms) >= self.max_ejected(&group)
            || self.pool_failing(&group, &endpoint, now_ms)
        {
            // the counters stay: the next failure ejects it once there is room, or once the
            // rest of the pool is healthy again
            return None;
        }
        let base_ms = duration_ms(self.settings.base_ejection_time);
        let max_ms = duration_ms(self.settings.max_ejection_time);
        let h = self.endpoints.get_mut(&endpoint)?;
        let ejections = h.decayed_ejections(now_ms, base_ms).saturating_add(1);
        let duration = base_ms.saturating_mul(u64::from(ejections)).min(max_ms);
        let until_ms = now_ms.saturating_add(duration);
        h.ejections = ejections;
        h.ejected_until_ms = Some(until_ms);
        // back in rotation it starts from a clean count, as in Envoy
        h.consecutive_5xx = 0;
        h.consecutive_gateway = 0;
        Some(Ejection {
            endpoint,
            trigger,
            until_ms,
            ejections,
        })
    }

    pub fn is_ejected(&self, endpoint: &EndpointId, now_ms: u64) -> bool {
        self.endpoints
            .get(endpoint)
            .is_some_and(|h| h.is_ejected(now_ms))
    }

    /// The endpoints ejected at `now_ms`, sorted.
    pub fn ejected(&self, now_ms: u64) -> Vec<EndpointId> {
        self.endpoints
            .iter()
            .filter(|(_, h)| h.is_ejected(now_ms))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Every endpoint of the pool and whether it is ejected at `now_ms`.
    pub fn states(&self, now_ms: u64) -> impl Iterator<Item = (EndpointId, bool)> + '_ {
        self.endpoints
            .iter()
            .map(move |(id, h)| (*id, h.is_ejected(now_ms)))
    }

    pub fn status(&self, endpoint: &EndpointId, now_ms: u64) -> Option<OutlierStatus> {
        let h = self.endpoints.get(endpoint)?;
        let base_ms = duration_ms(self.settings.base_ejection_time);
        Some(OutlierStatus {
            consecutive_5xx: h.consecutive_5xx,
            consecutive_gateway_failure: h.consecutive_gateway,
            ejections: h.decayed_ejections(now_ms, base_ms),
            ejected_until_ms: h.ejected_until_ms.filter(|_| h.is_ejected(now_ms)),
        })
    }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::{IpAddr, Ipv4Addr};

    fn id(n: u8) -> EndpointId {
        EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 8000, 0)
    }

    fn detector(n: u8, settings: OutlierDetection) -> OutlierDetector {
        let mut d = OutlierDetector::new(settings);
        d.set_pool((1..=n).map(|i| (id(i), Arc::from("llama"))));
        d
    }

    fn fail_n(
        d: &mut OutlierDetector,
        ep: EndpointId,
        o: Outcome,
        n: u32,
        now: u64,
    ) -> Option<Ejection> {
        let mut last = None;
        for _ in 0..n {
            last = d.on_result(ep, o, now);
        }
        last
    }

    #[test]
    fn five_errors_in_a_row_eject_for_the_base_time_then_it_returns() {
        let mut d = detector(2, OutlierDetection::default());
        assert_eq!(fail_n(&mut d, id(1), Outcome::ServerError, 4, 0), None);
        assert!(!d.is_ejected(&id(1), 0));
        let e = d
            .on_result(id(1), Outcome::ServerError, 100)
            .expect("ejected");
        assert_eq!(
            (e.trigger, e.until_ms, e.ejections),
            (Trigger::Consecutive5xx, 10_100, 1)
        );
        assert!(d.is_ejected(&id(1), 10_099));
        assert_eq!(d.ejected(5_000), vec![id(1)]);
        assert!(
            !d.is_ejected(&id(1), 10_100),
            "back after the ejection time"
        );
        assert!(d.ejected(10_100).is_empty());
    }

    #[test]
    fn a_success_resets_the_count_and_4xx_is_a_success() {
        let mut d = detector(2, OutlierDetection::default());
        fail_n(&mut d, id(1), Outcome::ServerError, 4, 0);
        assert_eq!(d.on_result(id(1), Outcome::from_status(404), 0), None);
        assert_eq!(fail_n(&mut d, id(1), Outcome::ServerError, 4, 0), None);
        assert!(!d.is_ejected(&id(1), 0));
    }

    #[test]
    fn gateway_errors_have_their_own_trigger() {
        let mut d = detector(
            2,
            OutlierDetection {
                consecutive_5xx: 0,
                consecutive_gateway_failure: 3,
                ..OutlierDetection::default()
            },
        );
        assert_eq!(
            fail_n(&mut d, id(1), Outcome::ServerError, 10, 0),
            None,
            "5xx trigger off"
        );
        let e = fail_n(&mut d, id(1), Outcome::GatewayError, 3, 0).expect("ejected");
        assert_eq!(e.trigger, Trigger::ConsecutiveGatewayFailure);
        assert_eq!(Outcome::from_status(503), Outcome::GatewayError);
        assert_eq!(Outcome::from_status(500), Outcome::ServerError);
        assert_eq!(Outcome::from_status(200), Outcome::Success);
    }

    #[test]
    fn repeated_ejections_last_longer_up_to_the_cap_and_the_multiplier_decays() {
        let s = OutlierDetection {
            consecutive_5xx: 1,
            base_ejection_time: Duration::from_secs(10),
            max_ejection_time: Duration::from_secs(25),
            ..OutlierDetection::default()
        };
        let mut d = detector(2, s);
        let e1 = d.on_result(id(1), Outcome::ServerError, 0).expect("1st");
        assert_eq!(e1.until_ms, 10_000);
        assert_eq!(
            d.on_result(id(1), Outcome::ServerError, 5_000),
            None,
            "ignored while ejected"
        );
        let e2 = d
            .on_result(id(1), Outcome::ServerError, 10_000)
            .expect("2nd");
        assert_eq!((e2.ejections, e2.until_ms), (2, 30_000));
        let e3 = d
            .on_result(id(1), Outcome::ServerError, 30_000)
            .expect("3rd");
        assert_eq!((e3.ejections, e3.until_ms), (3, 55_000), "capped at 25 s");
        // 20 s (two base times) back in rotation: the multiplier goes from 3 to 1
        let e4 = d
            .on_result(id(1), Outcome::ServerError, 75_000)
            .expect("4th");
        assert_eq!((e4.ejections, e4.until_ms), (2, 95_000));
    }

    #[test]
    fn max_ejection_percent_keeps_part_of_the_pool_and_never_all_of_it() {
        let s = OutlierDetection {
            consecutive_5xx: 1,
            ..OutlierDetection::default()
        };
        // 50 % of 4 = 2
        let mut d = detector(4, s.clone());
        assert!(d.on_result(id(1), Outcome::ServerError, 0).is_some());
        assert!(d.on_result(id(2), Outcome::ServerError, 0).is_some());
        assert!(d.on_result(id(3), Outcome::ServerError, 0).is_none());
        assert_eq!(d.ejected(0), vec![id(1), id(2)]);
        // once one returns there is room again, and the count kept makes the next error eject
        assert!(d.on_result(id(3), Outcome::ServerError, 10_000).is_some());
        // a single endpoint is never ejected; 100 % still leaves one
        let mut one = detector(1, s.clone());
        assert!(one.on_result(id(1), Outcome::ServerError, 0).is_none());
        let mut all = detector(
            3,
            OutlierDetection {
                max_ejection_percent: 100,
                ..s
            },
        );
        for n in 1..=3 {
            all.on_result(id(n), Outcome::ServerError, 0);
        }
        assert_eq!(all.ejected(0).len(), 2);
    }

    /// Ten poisoned requests spread over a pool of four fail on every endpoint they reach:
    /// that is the traffic, and nobody is ejected; an endpoint failing while the others
    /// succeed is.
    #[test]
    fn failures_across_the_pool_eject_nobody_and_one_endpoint_failing_alone_is_ejected() {
        let mut d = detector(4, OutlierDetection::default());
        let mut ejected = 0;
        for i in 0..40u64 {
            let ep = id((i % 4) as u8 + 1);
            ejected += usize::from(d.on_result(ep, Outcome::ServerError, i).is_some());
        }
        assert_eq!(ejected, 0);
        assert!(d.ejected(40).is_empty());
        // the others recover (or their failures age out); the one still failing goes
        for n in 2..=4 {
            d.on_result(id(n), Outcome::Success, 50);
        }
        let e = d.on_result(id(1), Outcome::ServerError, 60);
        assert!(e.is_some(), "its count was kept while the pool was failing");
        // aged failures of the others do not protect a failing endpoint either
        let mut d = detector(4, OutlierDetection::default());
        for n in 2..=4 {
            d.on_result(id(n), Outcome::ServerError, 0);
        }
        assert_eq!(fail_n(&mut d, id(1), Outcome::ServerError, 4, 20_000), None);
        assert!(d.on_result(id(1), Outcome::ServerError, 20_000).is_some());
    }

    #[test]
    fn groups_are_counted_apart_and_departed_endpoints_are_forgotten() {
        let s = OutlierDetection {
            consecutive_5xx: 1,
            ..OutlierDetection::default()
        };
        let mut d = OutlierDetector::new(s);
        d.set_pool([
            (id(1), Arc::from("a")),
            (id(2), Arc::from("a")),
            (id(3), Arc::from("b")),
        ]);
        assert!(d.on_result(id(1), Outcome::ServerError, 0).is_some());
        assert!(
            d.on_result(id(3), Outcome::ServerError, 0).is_none(),
            "b has one endpoint"
        );
        let departed = d.set_pool([(id(1), Arc::from("a")), (id(2), Arc::from("a"))]);
        assert_eq!(departed, vec![id(3)]);
        assert!(d.is_ejected(&id(1), 1), "kept across a pool change");
        assert!(d.on_result(id(9), Outcome::ServerError, 0).is_none());
    }

    #[test]
    fn settings_are_validated_naming_the_field() {
        let p = "limits.outlierDetection";
        let bad = OutlierDetection {
            base_ejection_time: Duration::ZERO,
            ..OutlierDetection::default()
        };
        assert!(
            bad.validate(p)
                .expect_err("zero")
                .to_string()
                .contains("baseEjectionTime")
        );
        let bad = OutlierDetection {
            max_ejection_percent: 101,
            ..OutlierDetection::default()
        };
        assert!(
            bad.validate(p)
                .expect_err("pct")
                .to_string()
                .contains("maxEjectionPercent")
        );
        let bad = OutlierDetection {
            max_ejection_time: Duration::from_secs(1),
            ..OutlierDetection::default()
        };
        assert!(
            bad.validate(p)
                .expect_err("max")
                .to_string()
                .contains("maxEjectionTime")
        );
        assert!(OutlierDetection::default().validate(p).is_ok());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Result(u8, Outcome),
        Wait(u64),
        Pool(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        let outcome = prop_oneof![
            Just(Outcome::Success),
            Just(Outcome::ServerError),
            Just(Outcome::GatewayError)
        ];
        prop_oneof![
            6 => (1u8..=6, outcome).prop_map(|(e, o)| Op::Result(e, o)),
            2 => (0u64..15_000).prop_map(Op::Wait),
            1 => (1u8..=6).prop_map(Op::Pool),
        ]
    }

    proptest! {
        /// Against a reference model of the counting rule: an endpoint is ejected exactly
        /// when it saw the threshold of errors in a row since it was last ejected (or came
        /// in), its group had room, and fewer than half of the rest of its group in rotation
        /// were failing too (an error within the base ejection time and no success since);
        /// ejections last between the base and the max time; no group is ever ejected past
        /// its share, nor whole.
        #[test]
        fn the_detector_follows_the_reference_model(ops in proptest::collection::vec(op(), 1..300)) {
            let s = OutlierDetection {
                consecutive_5xx: 3,
                consecutive_gateway_failure: 2,
                base_ejection_time: Duration::from_secs(1),
                max_ejection_time: Duration::from_secs(5),
                max_ejection_percent: 50,
            };
            let mut d = OutlierDetector::new(s.clone());
            let group = |n: u8| -> Arc<str> { if n.is_multiple_of(2) { "even".into() } else { "odd".into() } };
            let mut members: Vec<u8> = (1..=6).collect();
            d.set_pool(members.iter().map(|&n| (id(n), group(n))));
            // reference: errors in a row per endpoint, and the end of its ejection
            let mut runs: BTreeMap<u8, (u32, u32)> = BTreeMap::new();
            let mut until: BTreeMap<u8, u64> = BTreeMap::new();
            let mut last_error: BTreeMap<u8, u64> = BTreeMap::new();
            let mut now = 0u64;
            for op in ops {
                match op {
                    Op::Wait(ms) => now += ms,
                    Op::Pool(n) => {
                        members = (1..=6).filter(|&m| m != n).collect();
                        d.set_pool(members.iter().map(|&m| (id(m), group(m))));
                        runs.remove(&n);
                        until.remove(&n);
                        last_error.remove(&n);
                    }
                    Op::Result(n, o) => {
                        let member = members.contains(&n);
                        let was_ejected = until.get(&n).is_some_and(|&u| now < u);
                        let got = d.on_result(id(n), o, now);
                        if !member || was_ejected {
                            prop_assert_eq!(got, None);
                            continue;
                        }
                        if o != Outcome::Success {
                            last_error.insert(n, now);
                        }
                        let r = runs.entry(n).or_default();
                        match o {
                            Outcome::Success => *r = (0, 0),
                            Outcome::ServerError => *r = (r.0 + 1, 0),
                            Outcome::GatewayError => *r = (r.0 + 1, r.1 + 1),
                        }
                        let r = *r;
                        let tripped = r.0 >= 3 || r.1 >= 2;
                        let rotating: Vec<u8> = members
                            .iter()
                            .copied()
                            .filter(|&m| m != n && group(m) == group(n) && until.get(&m).is_none_or(|&u| now >= u))
                            .collect();
                        let failing = rotating
                            .iter()
                            .filter(|m| {
                                runs.get(m).is_some_and(|r| r.0 > 0)
                                    && last_error.get(m).is_some_and(|&t| now - t < 1_000)
                            })
                            .count();
                        let pool_failing = !rotating.is_empty() && failing * 2 >= rotating.len();
                        let size = members.iter().filter(|&&m| group(m) == group(n)).count();
                        let ejected_now = members
                            .iter()
                            .filter(|&&m| group(m) == group(n) && until.get(&m).is_some_and(|&u| now < u))
                            .count();
                        let room = ejected_now < (size / 2).min(size - 1);
                        prop_assert_eq!(got.is_some(), tripped && room && !pool_failing, "endpoint {} runs {:?}", n, r);
                        if let Some(e) = got {
                            prop_assert!(e.until_ms >= now + 1_000 && e.until_ms <= now + 5_000);
                            until.insert(n, e.until_ms);
                            runs.insert(n, (0, 0));
                        }
                    }
                }
                for g in ["odd", "even"] {
                    let size = members.iter().filter(|&&m| &*group(m) == g).count();
                    let ejected = members
                        .iter()
                        .filter(|&&m| &*group(m) == g && d.is_ejected(&id(m), now))
                        .count();
                    prop_assert!(ejected <= size / 2 && (size == 0 || ejected < size));
                }
                for &m in &members {
                    prop_assert_eq!(d.is_ejected(&id(m), now), until.get(&m).is_some_and(|&u| now < u));
                }
            }
        }
    }
}
