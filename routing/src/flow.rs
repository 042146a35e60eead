//! Flow control's queue: requests waiting for the pool to have headroom, by priority band, fair
//! between flows inside a band, bounded by count, bytes and time (issue 18).
//!
//! - **Bands**: a request's priority (higher first). A band is served only when every higher
//!   band is empty; when the queue is full, a newcomer pushes out the newest request of the
//!   lowest band below its own; when no band is lower, the newest request of the flow of its
//!   own band holding the most, while that flow holds more than the newcomer's would (one
//!   flow cannot fill the queue and lock the others out); else it is refused.
//! - **Flows** inside a band, keyed by a fairness id (the tenant, a header, or one flow):
//!   [`Fairness::RoundRobin`] takes one request from each flow in turn;
//!   [`Fairness::LeastAttainedService`] takes from the flow that has been served the fewest
//!   tokens (prompt + expected output), so a flow sending ten times the traffic does not get
//!   ten times the pool. A flow that was idle starts from the least service of the active
//!   ones (it gets no credit for having been away).
//! - **Inside a flow**: arrival order, or the earliest deadline first when requests carry one
//!   ([`Order::EarliestDeadline`]; requests without a deadline go after those with one).
//! - **Time**: a request waits at most `ttl_ms`; [`FlowQueue::expire`] returns the ones past it.
//!
//! Like the session admission queue ([`crate::admission`]), it holds no timers or wakers: its
//! owner asks it for the next request when the pool has headroom ([`FlowQueue::pop`]), and
//! expires it at [`FlowQueue::next_deadline`], so the service and the offline benchmark drive
//! the same code. Every operation is O(log n) or O(flows in a band).

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::Serialize;

/// How a band chooses between its flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Fairness {
    /// One request from each flow in turn.
    RoundRobin,
    /// The flow served the fewest tokens so far goes next.
    #[default]
    LeastAttainedService,
}

/// The order inside a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Order {
    /// First come, first served.
    #[default]
    Fcfs,
    /// The earliest deadline first; requests without one after those with one, in arrival
    /// order.
    EarliestDeadline,
}

/// The queue's bounds and policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FlowSettings {
    /// Most requests waiting.
    pub max_requests: usize,
    /// Most request bytes waiting (their bodies are held while they wait).
    pub max_bytes: u64,
    /// Longest wait, ms.
    pub ttl_ms: u64,
    pub fairness: Fairness,
    pub order: Order,
}

impl Default for FlowSettings {
    fn default() -> Self {
        Self {
            max_requests: 10_000,
            max_bytes: 1 << 30,
            ttl_ms: 60_000,
            fairness: Fairness::default(),
            order: Order::default(),
        }
    }
}

/// A request waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Waiting {
    /// The caller's id for it (unique among waiting requests).
    pub id: u64,
    /// Its priority band: higher is served first.
    pub band: i32,
    /// Its fairness flow (a hash of the tenant or fairness id).
    pub flow: u64,
    /// Prompt + expected output tokens: what serving it costs its flow.
    pub tokens: u64,
    /// Its body's size.
    pub bytes: u64,
    /// When it arrived (ms).
    pub arrival_ms: u64,
    /// When its client wants its first token at the latest (ms), if it said.
    pub deadline_ms: Option<u64>,
}

/// Why a request is not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Refused {
    /// The queue is full of requests of its band or higher.
    QueueFull,
    /// Its body alone is larger than the queue's byte bound.
    TooLarge,
    /// Its id is already waiting.
    Duplicate,
}

/// What [`FlowQueue::push`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// Lower-band requests pushed out to make room, to be answered as shed.
    pub shed: Vec<Waiting>,
}

/// One flow's waiting requests, in the order they leave.
#[derive(Debug, Default)]
struct Flow {
    /// (deadline key, arrival sequence) → request: deadline key 0 under FCFS.
    requests: BTreeMap<(u64, u64), Waiting>,
}

#[derive(Debug, Default)]
struct Band {
    flows: HashMap<u64, Flow>,
    /// (arrival, id) of every request: the newest are shed first.
    by_arrival: BTreeMap<(u64, u64), ()>,
    /// Flows with waiting requests, in round-robin order.
    active: VecDeque<u64>,
    /// Tokens served per flow (least attained service), active flows only.
    attained: HashMap<u64, u64>,
    len: usize,
}

/// Where a waiting request is.
#[derive(Debug, Clone, Copy)]
struct Pos {
    band: i32,
    flow: u64,
    key: (u64, u64),
    /// When its TTL runs out.
    until: u64,
}

/// See the module documentation.
#[derive(Debug)]
pub struct FlowQueue {
    settings: FlowSettings,
    /// Bands, lowest priority first.
    bands: BTreeMap<i32, Band>,
    at: HashMap<u64, Pos>,
    /// (arrival + ttl, id): the expiry order.
    expiries: BTreeMap<(u64, u64), ()>,
    bytes: u64,
    seq: u64,
}

impl FlowQueue {
    pub fn new(settings: FlowSettings) -> Self {
        Self {
            settings,
            bands: BTreeMap::new(),
            at: HashMap::new(),
            expiries: BTreeMap::new(),
            bytes: 0,
            seq: 0,
        }
    }

    /// New bounds and policies (a live edit). Requests already waiting stay; the bounds apply
    /// to the next push, the TTL to requests that arrive from now on.
    pub fn set_settings(&mut self, settings: FlowSettings) {
        self.settings = settings;
    }

    pub fn settings(&self) -> &FlowSettings {
        &self.settings
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// Bytes of the requests waiting.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Requests waiting per band, highest first.
    pub fn band_lengths(&self) -> Vec<(i32, usize)> {
        self.bands
            .iter()
            .rev()
            .map(|(&b, band)| (b, band.len))
            .collect()
    }

    /// Queues `w`, pushing out lower-band requests (newest first, lowest band first) when the
    /// queue is full.
    ///
    /// # Errors
    /// [`Refused`] when `w` cannot wait: the queue is full of its band or higher, its body
    /// exceeds the byte bound, or its id is waiting already.
    pub fn push(&mut self, w: Waiting) -> Result<Pushed, Refused> {
        if self.at.contains_key(&w.id) {
            return Err(Refused::Duplicate);
        }
        if w.bytes > self.settings.max_bytes {
            return Err(Refused::TooLarge);
        }
        // what must leave for `w` to fit, taken from the lowest bands below its own
        let mut shed = Vec::new();
        let mut count = self.len();
        let mut bytes = self.bytes;
        let fits = |count: usize, bytes: u64| {
            count < self.settings.max_requests.max(1)
                && bytes.saturating_add(w.bytes) <= self.settings.max_bytes
        };
        let mut victims = Vec::new();
        'bands: for (&b, band) in &self.bands {
            if b >= w.band {
                break;
            }
            for &(_, id) in band.by_arrival.keys().rev() {
                if fits(count, bytes) {
                    break 'bands;
                }
                let Some(p) = self.at.get(&id) else { continue };
                let Some(e) = band.flows.get(&p.flow).and_then(|f| f.requests.get(&p.key)) else {
                    continue;
                };
                victims.push(id);
                count -= 1;
                bytes -= e.bytes;
            }
        }
        // still full: inside its own band, the flow holding the most gives up its newest
        // request while it holds more than the newcomer's flow would, so one flow filling
        // the queue does not lock every other flow out
        if !fits(count, bytes)
            && let Some(band) = self.bands.get(&w.band)
        {
            let mut held: HashMap<u64, usize> = band
                .flows
                .iter()
                .map(|(&f, fl)| (f, fl.requests.len()))
                .collect();
            let mine = held.get(&w.flow).copied().unwrap_or(0);
            while !fits(count, bytes) {
                let Some((big, n)) = held
                    .iter()
                    .filter(|&(&f, _)| f != w.flow)
                    .map(|(&f, &n)| (f, n))
                    .max_by_key(|&(f, n)| (n, std::cmp::Reverse(f)))
                else {
                    break;
                };
                if n <= mine + 1 {
                    break;
                }
                let newest = band.by_arrival.keys().rev().find_map(|&(_, id)| {
                    let p = self.at.get(&id).filter(|p| p.flow == big)?;
                    if victims.contains(&id) {
                        return None;
                    }
                    band.flows
                        .get(&big)?
                        .requests
                        .get(&p.key)
                        .map(|e| (id, e.bytes))
                });
                let Some((id, b)) = newest else { break };
                victims.push(id);
                count -= 1;
                bytes -= b;
                held.insert(big, n - 1);
            }
        }
        if !fits(count, bytes) {
            return Err(Refused::QueueFull);
        }
        for id in victims {
            if let Some(v) = self.remove(id) {
                shed.push(v);
            }
        }
        self.insert(w);
        Ok(Pushed { shed })
    }

    fn insert(&mut self, w: Waiting) {
        self.seq += 1;
        let key = match (self.settings.order, w.deadline_ms) {
            (Order::EarliestDeadline, Some(d)) => (d, self.seq),
            (Order::EarliestDeadline, None) => (u64::MAX, self.seq),
            (Order::Fcfs, _) => (0, self.seq),
        };
        let band = self.bands.entry(w.band).or_default();
        let flow = band.flows.entry(w.flow).or_default();
        if flow.requests.is_empty() {
            band.active.push_back(w.flow);
            // an idle flow starts from the least service of the active ones
            let floor = band.attained.values().copied().min().unwrap_or(0);
            let a = band.attained.entry(w.flow).or_insert(floor);
            *a = (*a).max(floor);
        }
        flow.requests.insert(key, w);
        band.by_arrival.insert((w.arrival_ms, w.id), ());
        band.len += 1;
        let until = w.arrival_ms.saturating_add(self.settings.ttl_ms);
        self.at.insert(
            w.id,
            Pos {
                band: w.band,
                flow: w.flow,
                key,
                until,
            },
        );
        self.expiries.insert((until, w.id), ());
        self.bytes += w.bytes;
    }

    /// Takes request `id` out (its client left, or it was shed); `None` when it is not waiting.
    pub fn remove(&mut self, id: u64) -> Option<Waiting> {
        let p = self.at.remove(&id)?;
        let (b, f) = (p.band, p.flow);
        let band = self.bands.get_mut(&b)?;
        let flow = band.flows.get_mut(&f)?;
        let w = flow.requests.remove(&p.key)?;
        band.by_arrival.remove(&(w.arrival_ms, id));
        band.len -= 1;
        if flow.requests.is_empty() {
            band.flows.remove(&f);
            band.active.retain(|&x| x != f);
            band.attained.remove(&f);
        }
        if band.len == 0 {
            self.bands.remove(&b);
        }
        self.expiries.remove(&(p.until, id));
        self.bytes -= w.bytes;
        Some(w)
    }

    /// The request that would leave next: the highest band's, from the flow its fairness
    /// policy chooses, in the flow's order.
    pub fn peek(&self) -> Option<&Waiting> {
        let (_, band) = self.bands.iter().next_back()?;
        let flow = self.next_flow(band)?;
        band.flows.get(&flow)?.requests.values().next()
    }

    fn next_flow(&self, band: &Band) -> Option<u64> {
        match self.settings.fairness {
            Fairness::RoundRobin => band.active.front().copied(),
            Fairness::LeastAttainedService => band
                .active
                .iter()
                .copied()
                .min_by_key(|f| band.attained.get(f).copied().unwrap_or(0)),
        }
    }

    /// Takes the request that leaves next ([`Self::peek`]) for dispatch and charges its flow.
    pub fn pop(&mut self) -> Option<Waiting> {
        let id = self.peek()?.id;
        let Pos {
            band: b, flow: f, ..
        } = *self.at.get(&id)?;
        let w = self.remove(id)?;
        if let Some(band) = self.bands.get_mut(&b) {
            if let Some(a) = band.attained.get_mut(&f) {
                *a = a.saturating_add(w.tokens);
            }
            // round robin: the flow goes to the back
            if band.active.front() == Some(&f) {
                band.active.rotate_left(1);
            }
        }
        Some(w)
    }

    /// Takes out every request that has waited its TTL by `now_ms` (oldest first).
    pub fn expire(&mut self, now_ms: u64) -> Vec<Waiting> {
        let due: Vec<u64> = self
            .expiries
            .keys()
            .take_while(|&&(until, _)| until <= now_ms)
            .map(|&(_, id)| id)
            .collect();
        due.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// When the next request's TTL runs out.
    pub fn next_deadline(&self) -> Option<u64> {
        self.expiries.keys().next().map(|&(until, _)| until)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn w(id: u64, band: i32, flow: u64, arrival_ms: u64) -> Waiting {
        Waiting {
            id,
            band,
            flow,
            tokens: 100,
            bytes: 10,
            arrival_ms,
            deadline_ms: None,
        }
    }

    fn drain(q: &mut FlowQueue) -> Vec<u64> {
        std::iter::from_fn(|| q.pop().map(|w| w.id)).collect()
    }

    #[test]
    fn higher_bands_leave_first_and_arrival_order_inside_a_flow() {
        let mut q = FlowQueue::new(FlowSettings::default());
        for (id, band) in [(1, 0), (2, 5), (3, 0), (4, 5), (5, -1)] {
            q.push(w(id, band, 7, id)).unwrap();
        }
        assert_eq!(q.band_lengths(), vec![(5, 2), (0, 2), (-1, 1)]);
        assert_eq!(drain(&mut q), vec![2, 4, 1, 3, 5]);
        assert!(q.is_empty() && q.bytes() == 0);
    }

    #[test]
    fn a_heavy_flow_gets_no_more_than_its_share() {
        for fairness in [Fairness::RoundRobin, Fairness::LeastAttainedService] {
            let mut q = FlowQueue::new(FlowSettings {
                fairness,
                ..FlowSettings::default()
            });
            // flow 1 sends ten times flow 2's requests, all before flow 2's
            for id in 0..20 {
                q.push(w(id, 0, 1, id)).unwrap();
            }
            q.push(w(100, 0, 2, 50)).unwrap();
            q.push(w(101, 0, 2, 51)).unwrap();
            let order = drain(&mut q);
            // flow 2's two requests leave among the first four
            let pos = |id| order.iter().position(|&x| x == id).unwrap();
            assert!(pos(100) < 2 && pos(101) < 4, "{fairness:?}: {order:?}");
        }
    }

    #[test]
    fn least_attained_service_counts_tokens() {
        let mut q = FlowQueue::new(FlowSettings::default());
        // flow 1's requests are ten times larger: flow 2 gets ten turns per flow-1 turn
        for id in 0..3 {
            q.push(Waiting {
                tokens: 1000,
                ..w(id, 0, 1, id)
            })
            .unwrap();
        }
        for id in 10..30 {
            q.push(w(id, 0, 2, id)).unwrap();
        }
        let order = drain(&mut q);
        let first_two_big = order
            .iter()
            .enumerate()
            .filter(|(_, id)| **id < 3)
            .map(|(i, _)| i)
            .take(2)
            .collect::<Vec<_>>();
        // after the first big one, ten small ones before the next
        assert!(first_two_big[1] - first_two_big[0] >= 10, "{order:?}");
    }

    #[test]
    fn earliest_deadline_inside_a_flow() {
        let mut q = FlowQueue::new(FlowSettings {
            order: Order::EarliestDeadline,
            ..FlowSettings::default()
        });
        for (id, d) in [(1, None), (2, Some(500)), (3, Some(100)), (4, None)] {
            q.push(Waiting {
                deadline_ms: d,
                ..w(id, 0, 1, id)
            })
            .unwrap();
        }
        assert_eq!(drain(&mut q), vec![3, 2, 1, 4]);
    }

    #[test]
    fn a_full_queue_sheds_the_lowest_band_newest_first() {
        let mut q = FlowQueue::new(FlowSettings {
            max_requests: 3,
            ..FlowSettings::default()
        });
        q.push(w(1, 0, 1, 1)).unwrap();
        q.push(w(2, -1, 1, 2)).unwrap();
        q.push(w(3, -1, 1, 3)).unwrap();
        // a critical request pushes out the newest sheddable one
        let p = q.push(w(4, 5, 1, 4)).unwrap();
        assert_eq!(p.shed.iter().map(|w| w.id).collect::<Vec<_>>(), vec![3]);
        // a sheddable one finds no lower band: refused
        assert_eq!(q.push(w(5, -1, 1, 5)), Err(Refused::QueueFull));
        // a band-0 one pushes out the other sheddable one
        let p = q.push(w(6, 0, 1, 6)).unwrap();
        assert_eq!(p.shed.iter().map(|w| w.id).collect::<Vec<_>>(), vec![2]);
        assert_eq!(q.push(w(7, 0, 1, 7)), Err(Refused::QueueFull));
        assert_eq!(drain(&mut q), vec![4, 1, 6]);
    }

    /// Hardening IV, 4: tenant A filling the queue used to lock tenant B out (`queue_full`
    /// for every B request while A held every slot).
    #[test]
    fn one_flow_filling_the_queue_does_not_lock_the_others_out() {
        let mut q = FlowQueue::new(FlowSettings {
            max_requests: 20,
            ..FlowSettings::default()
        });
        for id in 0..20 {
            q.push(w(id, 0, 1, id)).unwrap();
        }
        // flow 1 asks for more: it holds the most already, so it is refused
        assert_eq!(q.push(w(20, 0, 1, 20)), Err(Refused::QueueFull));
        // flow 2 gets in, each time at the cost of flow 1's newest
        for id in 100..110 {
            let p = q.push(w(id, 0, 2, id)).unwrap();
            assert_eq!(p.shed.len(), 1);
            assert_eq!(p.shed[0].flow, 1);
            assert_eq!(p.shed[0].id, 19 - (id - 100));
        }
        assert_eq!(q.len(), 20);
        // half each now: flow 2 is refused as flow 1 was, and flow 1 is too
        assert_eq!(q.push(w(110, 0, 2, 110)), Err(Refused::QueueFull));
        assert_eq!(q.push(w(21, 0, 1, 21)), Err(Refused::QueueFull));
        // a third flow takes from whichever holds the most (a tie: the lower flow id)
        let p = q.push(w(200, 0, 3, 200)).unwrap();
        assert_eq!(p.shed[0].flow, 1);
        let p = q.push(w(201, 0, 3, 201)).unwrap();
        assert_eq!(p.shed[0].flow, 2);
        // a higher band is never taken from by a lower one
        let mut q = FlowQueue::new(FlowSettings {
            max_requests: 2,
            ..FlowSettings::default()
        });
        q.push(w(1, 5, 1, 1)).unwrap();
        q.push(w(2, 5, 1, 2)).unwrap();
        assert_eq!(q.push(w(3, 0, 2, 3)), Err(Refused::QueueFull));
    }

    #[test]
    fn bytes_are_bounded_too() {
        let mut q = FlowQueue::new(FlowSettings {
            max_bytes: 25,
            ..FlowSettings::default()
        });
        q.push(w(1, 0, 1, 1)).unwrap();
        q.push(w(2, 0, 1, 2)).unwrap();
        assert_eq!(q.push(w(3, 0, 1, 3)), Err(Refused::QueueFull));
        assert_eq!(
            q.push(Waiting {
                bytes: 26,
                ..w(4, 9, 1, 4)
            }),
            Err(Refused::TooLarge)
        );
        assert_eq!(q.push(w(1, 0, 1, 1)), Err(Refused::Duplicate));
        assert_eq!(q.bytes(), 20);
    }

    #[test]
    fn requests_leave_at_their_ttl_and_on_disconnect() {
        let mut q = FlowQueue::new(FlowSettings {
            ttl_ms: 100,
            ..FlowSettings::default()
        });
        q.push(w(1, 0, 1, 0)).unwrap();
        q.push(w(2, 0, 2, 50)).unwrap();
        q.push(w(3, 0, 1, 60)).unwrap();
        assert_eq!(q.next_deadline(), Some(100));
        assert!(q.expire(99).is_empty());
        assert_eq!(
            q.expire(150).iter().map(|w| w.id).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert_eq!(q.remove(3).map(|w| w.id), Some(3));
        assert_eq!(q.remove(3), None);
        assert!(q.is_empty() && q.next_deadline().is_none() && q.bytes() == 0);
    }
}
