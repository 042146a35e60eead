//! The pool's lock: a reader-writer lock whose writer holds it alone only to write.
//!
//! A KV-event batch is applied in steps of [`STEP_BLOCKS`](crate::kv_events::ingest::STEP_BLOCKS)
//! blocks. Before each step the writer downgrades to an upgradable read, which picks share and
//! no other writer can take, and reads the lines the step will write
//! ([`HandoffWrite::shared`]); the index is larger than the cache, so a step is otherwise
//! mostly cache misses. It then takes the lock back alone by polling for a moment when no pick
//! is in, and writes from cache: a pick waits at most about a microsecond for a step. Between
//! two steps (and between the stretches of a batch that are not stepped, such as a run of
//! tier moves) it shares the lock the same way until the picks that asked are in
//! ([`HandoffWrite::let_readers_in`]).
//!
//! Handing the lock over is the other cost. A pick that finds a plain `RwLock` write-locked
//! spins for a moment and then parks, and waking a parked thread costs tens of microseconds on
//! a shared VM. Here a pick polls for up to [`READ_SPIN`] instead; the writer polls the same
//! way when it takes the lock back ([`upgrade`]); and at the end of a batch it waits (for at
//! most [`HANDOFF_WAIT`]) until the picks that asked while it held the lock are in, so that it
//! cannot take the lock straight back from them.
//!
//! With ingestion running on another core, a match's p99 went from 24.6 µs to 3.1-3.3 µs
//! against 2.3-2.6 µs with no ingestion (`picker/BENCHMARKS.md` §1c).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{RwLock, RwLockReadGuard, RwLockUpgradableReadGuard, RwLockWriteGuard};

use crate::index::KvIndex;
use crate::kv_events::ingest::IndexAccess;

/// How long a reader polls a write-locked lock, or a writer taking it back from readers, before
/// it parks.
pub const READ_SPIN: Duration = Duration::from_micros(50);
/// The longest a writer that released the lock waits for the readers that asked before.
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

    /// Share the value (with a writer that is reading a step's lines, too).
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
            guard: Some(self.lock.write()),
            lock: self,
        }
    }
}

/// The lock held for writing; see [`HandoffWrite::shared`] and [`HandoffWrite::let_readers_in`].
pub struct HandoffWrite<'a, T> {
    /// Always held; `None` only inside [`HandoffWrite::shared`].
    guard: Option<RwLockWriteGuard<'a, T>>,
    lock: &'a HandoffLock<T>,
}

impl<'a, T> HandoffWrite<'a, T> {
    fn guard_mut(&mut self) -> &mut RwLockWriteGuard<'a, T> {
        self.guard.as_mut().expect("the write guard is held")
    }

    /// Run `f` on the value while readers may share it (the lock held upgradable: no other
    /// writer gets in), then hold it alone again.
    pub fn shared<R>(&mut self, f: impl FnOnce(&T) -> R) -> R {
        let guard = self.guard.take().expect("the write guard is held");
        let upgradable = RwLockWriteGuard::downgrade_to_upgradable(guard);
        let r = f(&upgradable);
        self.guard = Some(upgrade(upgradable));
        r
    }

    /// Share the lock with the readers that asked for it before now, if any, until they are
    /// in (at most [`HANDOFF_WAIT`]), then hold it alone again.
    pub fn let_readers_in(&mut self) {
        let asked = self.lock.asked.load(Ordering::Acquire);
        let entered = &self.lock.entered;
        if entered.load(Ordering::Acquire) < asked {
            self.shared(|_| wait_for(entered, asked));
        }
    }

    /// Run `f` with the lock released (fairly: a waiting reader gets it first).
    pub fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
        RwLockWriteGuard::unlocked_fair(self.guard_mut(), f)
    }

    /// Release the lock, and wait (at most [`HANDOFF_WAIT`]) until the readers that asked for
    /// it before now are in, so that this thread cannot take it straight back from them.
    pub fn release(self) {
        let asked = self.lock.asked.load(Ordering::Acquire);
        let entered = &self.lock.entered;
        if let Some(guard) = self.guard {
            RwLockWriteGuard::unlock_fair(guard);
        }
        wait_for(entered, asked);
    }
}

/// Hold the lock alone again once the readers in it are out: polled for up to [`READ_SPIN`]
/// (a reader is in for microseconds, while parking and waking this thread costs tens of them
/// and shuts new readers out meanwhile), then waited for. New readers are not held back for
/// it: they would wait for the readers in as well, and the poll finds a gap.
fn upgrade<T>(mut guard: RwLockUpgradableReadGuard<'_, T>) -> RwLockWriteGuard<'_, T> {
    let start = Instant::now();
    loop {
        match RwLockUpgradableReadGuard::try_upgrade(guard) {
            Ok(w) => return w,
            Err(g) => guard = g,
        }
        if start.elapsed() >= READ_SPIN {
            return RwLockUpgradableReadGuard::upgrade(guard);
        }
        std::hint::spin_loop();
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
        self.guard.as_ref().expect("the write guard is held")
    }
}

impl<T> DerefMut for HandoffWrite<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard_mut()
    }
}

/// A batch applied under the lock shares it with the picks while it reads a step's lines, and
/// lets in the picks that asked between two steps.
impl<T: AsMut<KvIndex> + AsRef<KvIndex>> IndexAccess for HandoffWrite<'_, T> {
    fn index(&mut self) -> &mut KvIndex {
        self.guard_mut().as_mut()
    }

    fn yield_now(&mut self) {
        self.let_readers_in();
    }

    fn warm(&mut self, f: impl FnOnce(&KvIndex) -> usize) {
        std::hint::black_box(self.shared(|t| f(t.as_ref())));
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

impl AsRef<KvIndex> for KvIndex {
    fn as_ref(&self) -> &KvIndex {
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
            while lock.asked.load(Ordering::Acquire) == 0 {
                std::hint::spin_loop();
            }
            // the reader asked: one call lets it in (it waits up to HANDOFF_WAIT for it, and
            // is called again if the reader's thread was not scheduled meanwhile)
            let start = Instant::now();
            while lock.entered.load(Ordering::Acquire) == 0
                && start.elapsed() < Duration::from_secs(10)
            {
                w.let_readers_in();
            }
            assert_eq!(
                lock.entered.load(Ordering::Acquire),
                1,
                "let in between steps"
            );
            assert!(lock.lock.try_read().is_none(), "held alone again");
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

    #[test]
    fn a_writer_shares_the_value_while_it_warms_up_and_then_holds_it_alone() {
        let lock = HandoffLock::new(5u64);
        let left = AtomicBool::new(false);
        std::thread::scope(|s| {
            let mut w = lock.write();
            assert!(lock.lock.try_read().is_none(), "held alone");
            let doubled = w.shared(|v| {
                assert!(lock.lock.try_write().is_none(), "no other writer");
                // a reader gets in while the writer reads, and stays a while
                let (tx, rx) = std::sync::mpsc::channel();
                let (lock, left) = (&lock, &left);
                s.spawn(move || {
                    let g = lock.lock.try_read().expect("a reader shares it");
                    tx.send(*g).expect("send");
                    std::thread::sleep(Duration::from_millis(50));
                    left.store(true, Ordering::Release);
                    drop(g);
                });
                assert_eq!(rx.recv().expect("the reader read"), 5);
                *v * 2
            });
            assert_eq!(doubled, 10);
            assert!(
                left.load(Ordering::Acquire),
                "the writer took the lock back only once the reader was out"
            );
            assert!(lock.lock.try_read().is_none(), "held alone again");
            *w = 7;
            w.release();
        });
        assert_eq!(*lock.read(), 7);
    }
}
