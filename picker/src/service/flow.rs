//! The service's side of the waiting room ([`kvroute_routing::waiting`]): the pool's gate
//! decides who waits and who goes; this holds one oneshot sender per waiting request and one
//! task that steps the gate and answers them.
//!
//! The task steps the gate when something arrives or leaves, when a session is served, at
//! the gate's next deadline ([`Pool::next_wake`]) and, while requests wait for headroom (which
//! grows with scrapes and answers, unannounced), every [`ROUND`]. 100k waiting requests cost
//! no wakeups until their turn. A request whose client leaves drops its receiver and its guard
//! takes it out of the gate; a turn given to a request already gone is given back.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvroute_routing::place::Pool;
use kvroute_routing::waiting::{Action, Arrival, Arrived, Pass, Refusal};
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::state::PickerState;

/// How often the task looks for headroom while requests wait for it.
pub const ROUND: Duration = Duration::from_millis(10);

/// How a wait ended without a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoTurn {
    /// The gate answered it without service.
    Refused(Refusal),
    /// The picker is stopping.
    ShuttingDown,
}

/// See the module documentation.
#[derive(Default)]
pub struct Waiters {
    /// Per waiting request: its model config and where its answer goes.
    senders: Mutex<HashMap<u64, (String, oneshot::Sender<Action>)>>,
    next_id: AtomicU64,
    wake: tokio::sync::Notify,
}

/// Gives back what a turn took when nobody will use it: flow control's in-transit count and
/// admission's reservation.
fn give_back(pool: &Pool, config: &str, action: &Action) {
    if let Action::Go { pass, .. } = action {
        let mut w = pool.waiting().lock();
        if pass.flow_wait_ms.is_some() {
            w.placed(config);
        }
        if let Some(r) = pass.reservation {
            w.release(r);
        }
    }
}

impl Waiters {
    /// The gate may have something to do (a session was served, a request left).
    pub fn poke(&self) {
        self.wake.notify_one();
    }

    /// `a` (its id is set here) waits for its turn at `pool`'s gate: at once when the gate
    /// lets it by, else when the task answers it. A request released by flow control counts
    /// as placed once this returns.
    pub async fn turn(&self, pool: &Pool, now_ms: u64, mut a: Arrival) -> Result<Pass, NoTurn> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        a.id = id;
        let config = a.config.clone();
        let (tx, rx) = oneshot::channel();
        // registered before it arrives, so the task never answers an id it does not know
        self.senders.lock().insert(id, (config.clone(), tx));
        match pool.arrive(now_ms, a) {
            Arrived::Go(pass) => {
                self.senders.lock().remove(&id);
                return Ok(pass);
            }
            Arrived::Refused(r) => {
                self.senders.lock().remove(&id);
                return Err(NoTurn::Refused(r));
            }
            Arrived::Wait => self.wake.notify_one(),
        }
        /// Leaves the gate when the wait ends any way but an answer (the client left).
        struct InLine<'a> {
            waiters: &'a Waiters,
            pool: &'a Pool,
            id: u64,
            config: String,
            rx: oneshot::Receiver<Action>,
            answered: bool,
        }
        impl Drop for InLine<'_> {
            fn drop(&mut self) {
                if self.answered {
                    return;
                }
                // no answer gets in from now on: one sent before is taken back here, one sent
                // after is given back by its sender
                self.rx.close();
                if self.pool.waiting().lock().leave(self.id) {
                    self.waiters.senders.lock().remove(&self.id);
                } else if let Ok(action) = self.rx.try_recv() {
                    give_back(self.pool, &self.config, &action);
                }
                self.waiters.wake.notify_one();
            }
        }
        let mut line = InLine {
            waiters: self,
            pool,
            id,
            config,
            rx,
            answered: false,
        };
        let action = (&mut line.rx).await;
        line.answered = true;
        match action {
            Ok(Action::Go { pass, .. }) => {
                if pass.flow_wait_ms.is_some() {
                    pool.waiting().lock().placed(&line.config);
                }
                Ok(pass)
            }
            Ok(Action::Refuse { reason, .. }) => Err(NoTurn::Refused(reason)),
            Err(_) => Err(NoTurn::ShuttingDown),
        }
    }

    /// Hands out what one step of the gate decided.
    fn answer(&self, pool: &Pool, actions: Vec<Action>) {
        for action in actions {
            let id = match action {
                Action::Go { id, .. } | Action::Refuse { id, .. } => id,
            };
            let entry = self.senders.lock().remove(&id);
            // a request decided by the gate is registered until it is answered here
            if let Some((config, tx)) = entry
                && let Err(action) = tx.send(action)
            {
                give_back(pool, &config, &action);
            }
        }
    }
}

/// The task that steps the gate (see the module documentation).
pub async fn run_gate(picker: Arc<PickerState>, cancel: CancellationToken) {
    loop {
        let now = picker.now_ms();
        let actions = picker.pool.step_waiting(now);
        picker.waiters.answer(&picker.pool, actions);
        let (queued, held, polls) = {
            let w = picker.pool.waiting().lock();
            (w.queued(), w.admission_waiting(), w.waits_for_headroom())
        };
        picker.metrics.set_flow_queued(&queued);
        picker.metrics.admission_waiting.set(held as i64);
        let deadline = picker
            .pool
            .next_wake()
            .map(|t| Duration::from_millis(t.saturating_sub(now).max(1)));
        let wait = match (deadline, polls) {
            (Some(d), true) => Some(d.min(ROUND)),
            (Some(d), false) => Some(d),
            (None, true) => Some(ROUND),
            (None, false) => None,
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            () = picker.waiters.wake.notified() => {}
            () = async {
                match wait {
                    Some(w) => tokio::time::sleep(w).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}
