//! The pool's lock: a reader-writer lock whose writer, between two steps of a long KV-event
//! batch, lets in the picks that asked for it before the step ended.
//!
//! A plain `RwLock` hands the lock over badly here. A pick that finds it write-locked spins for
//! a moment and then parks, and waking a parked thread costs tens of microseconds on a shared
//! VM; a fair unlock between steps (`RwLockWriteGuard::bump`) only helps a pick once it has
//! parked, so every waiting pick paid the wake-up (`benches/index-compare --mixed`: p50 40-60
//! µs whatever the step). Here a pick keeps polling for up to [`READ_SPIN`] instead, and the
//! writer, between steps, counts who asked and steps aside until they are in (for at most
//! [`HANDOFF_WAIT`]): a pick waits about what is left of one step.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::index::KvIndex;
use crate::kv_events::ingest::IndexAccess;

/// How long a reader polls a write-locked lock before it parks: about two steps of a batch.
pub const READ_SPIN: Duration = Duration::from_micros(50);
/// The longest a writer steps aside for the readers that asked before it paused.
pub const HANDOFF_WAIT: Duration = Duration::from_micros(200);

/// See the module documentation.
#[derive(Debug, Default)]
pub struct HandoffLock<T> {
    lock: RwLock<T>,
    /// Readers that asked for the lock, and readers that got it.
    asked: AtomicU64,
    entered: AtomicU64,
}

impl<T> HandoffLock<T> {
    pub fn new(value: T) -> Self {
        Self {
            lock: RwLock::new(value),
            asked: AtomicU64::new(0),
            entered: AtomicU64::new(0),
        }
    }

    /// Share the value; a writer between two steps lets this reader in.
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        self.asked.fetch_add(1, Ordering::AcqRel);
        let guard = self.lock.try_read().unwrap_or_else(|| {
            let start = Instant::now();
            loop {
                if let Some(g) = self.lock.try_read() {
                    break g;
                }
                if start.elapsed() >= READ_SPIN {
                    break self.lock.read();
                }
                std::hint::spin_loop();
            }
        });
        self.entered.fetch_add(1, Ordering::AcqRel);
        guard
    }

    /// Hold the value alone.
    pub fn write(&self) -> HandoffWrite<'_, T> {
        HandoffWrite {
            guard: self.lock.write(),
            lock: self,
        }
    }
}

/// The lock held for writing; see [`HandoffWrite::let_readers_in`].
pub struct HandoffWrite<'a, T> {
    guard: RwLockWriteGuard<'a, T>,
    lock: &'a HandoffLock<T>,
}

impl<T> HandoffWrite<'_, T> {
    /// Step aside for the readers that asked for the lock before now, if any, until they are
    /// in (at most [`HANDOFF_WAIT`]), then take it back.
    pub fn let_readers_in(&mut self) {
        let asked = self.lock.asked.load(Ordering::Acquire);
        let entered = &self.lock.entered;
        if entered.load(Ordering::Acquire) >= asked {
            return;
        }
        RwLockWriteGuard::unlocked_fair(&mut self.guard, || wait_for(entered, asked));
    }

    /// Run `f` with the lock released (fairly: a waiting reader gets it first).
    pub fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
        RwLockWriteGuard::unlocked_fair(&mut self.guard, f)
    }

    /// Release the lock, and wait (at most [`HANDOFF_WAIT`]) until the readers that asked for
    /// it before now are in, so that this thread cannot take it straight back from them.
    pub fn release(self) {
        let asked = self.lock.asked.load(Ordering::Acquire);
        let entered = &self.lock.entered;
        RwLockWriteGuard::unlock_fair(self.guard);
        wait_for(entered, asked);
    }
}

/// Spin until `entered` reaches `asked`, at most [`HANDOFF_WAIT`].
fn wait_for(entered: &AtomicU64, asked: u64) {
    let start = Instant::now();
    while entered.load(Ordering::Acquire) < asked && start.elapsed() < HANDOFF_WAIT {
        std::hint::spin_loop();
    }
}

impl<T> Deref for HandoffWrite<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for HandoffWrite<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

/// A batch applied under the lock lets the picks in between its steps.
impl<T: AsMut<KvIndex>> IndexAccess for HandoffWrite<'_, T> {
    fn index(&mut self) -> &mut KvIndex {
        self.guard.as_mut()
    }

    fn yield_now(&mut self) {
        self.let_readers_in();
    }

    fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
        HandoffWrite::unlocked(self, f)
    }
}

impl AsMut<KvIndex> for KvIndex {
    fn as_mut(&mut self) -> &mut KvIndex {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn a_writer_between_steps_lets_a_waiting_reader_in() {
        let lock = HandoffLock::new(0u64);
        let stepped = AtomicBool::new(false);
        std::thread::scope(|s| {
            let mut w = lock.write();
            *w = 1;
            let reader = s.spawn(|| {
                let g = lock.read();
                // the writer is still inside its batch: it let this reader in between steps
                assert!(!stepped.load(Ordering::Acquire));
                *g
            });
            // wait until the reader asked
            while lock.asked.load(Ordering::Acquire) == 0 {
                std::hint::spin_loop();
            }
            let start = Instant::now();
            while lock.entered.load(Ordering::Acquire) == 0
                && start.elapsed() < Duration::from_secs(10)
            {
                w.let_readers_in();
            }
            assert_eq!(
                lock.entered.load(Ordering::Acquire),
                1,
                "the reader got in between two steps"
            );
            *w = 2;
            stepped.store(true, Ordering::Release);
            drop(w);
            assert_eq!(
                reader.join().expect("reader"),
                1,
                "it saw the first step's value"
            );
        });
        assert_eq!(*lock.read(), 2);
    }
}
