//! Sequence numbers of one publisher: in order, duplicate, stale, or a gap to replay.

use std::collections::VecDeque;

/// What [`SequenceTracker::observe`] concluded about a sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqOutcome {
    /// First number seen since creation or [`SequenceTracker::reset`]: nothing to compare.
    First,
    /// Exactly the next expected number.
    InOrder,
    /// Already seen (or older): drop the batch, its events were applied.
    Duplicate,
    /// Numbers `expected..got` were missed (ZMQ PUB drops under back-pressure). The tracker
    /// has moved past `got`; the caller may request a replay from `expected` and apply the
    /// replayed batches below `got` itself, or resynchronize the endpoint from scratch.
    Gap {
        /// First missing number.
        expected: u64,
        /// The number received.
        got: u64,
    },
    /// The number went back to 0, or further back than the restart window: the publisher
    /// restarted (the engine's cache is new). The tracker now follows the new stream; the
    /// caller should drop what it knew about this endpoint.
    Restart {
        /// What was expected from the old stream.
        expected: u64,
        /// The number received.
        got: u64,
    },
}

/// Per-publisher sequence bookkeeping (one per engine endpoint and rank).
///
/// Publishers number batches 0, 1, 2, ... from process start. Since an engine restart also
/// restarts the numbering, a number far below the expected one is a restart, not a duplicate:
/// duplicates only come from overlapping a replay with the live stream, and a replay reaches
/// back at most the publisher's buffer (10,000 batches by default), hence the default window.
///
/// A duplicate must also be a number this tracker has seen: it keeps the numbers it accepted
/// as a few ranges ([`SequenceTracker::SEEN_RANGES`]). A lower number it never saw means the
/// stream is below where the tracker thinks it is (a message numbered far ahead that the
/// publisher never sent moved it, or the publisher restarted): that is a
/// [`SeqOutcome::Restart`], so the tracker follows the stream again instead of taking every
/// real batch up to the bogus number for a duplicate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceTracker {
    next: Option<u64>,
    restart_window: u64,
    /// Accepted numbers as inclusive ranges, oldest first, at most `SEEN_RANGES`.
    pub(super) seen: VecDeque<(u64, u64)>,
}

impl Default for SequenceTracker {
    fn default() -> Self {
        Self::new()
    }
}

impl SequenceTracker {
    /// Default restart window: vLLM's and SGLang's default replay buffer (`buffer_steps`).
    pub const DEFAULT_RESTART_WINDOW: u64 = 10_000;

    /// Ranges of accepted numbers remembered. A healthy stream needs one; each gap starts
    /// another until a replay or a reset.
    pub const SEEN_RANGES: usize = 16;

    /// A tracker that has seen nothing yet.
    #[must_use]
    pub fn new() -> Self {
        Self::with_restart_window(Self::DEFAULT_RESTART_WINDOW)
    }

    /// A tracker treating a number more than `window` below the expected one as a restart.
    #[must_use]
    pub fn with_restart_window(window: u64) -> Self {
        Self {
            next: None,
            restart_window: window,
            seen: VecDeque::new(),
        }
    }

    fn accept(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
        match self.seen.back_mut() {
            Some((_, hi)) if hi.saturating_add(1) == seq => *hi = seq,
            Some(&mut (lo, hi)) if (lo..=hi).contains(&seq) => {}
            _ => {
                if self.seen.len() == Self::SEEN_RANGES {
                    self.seen.pop_front();
                }
                self.seen.push_back((seq, seq));
            }
        }
    }

    fn was_seen(&self, seq: u64) -> bool {
        self.seen.iter().any(|&(lo, hi)| (lo..=hi).contains(&seq))
    }

    /// Classifies `seq` and advances. Do not pass [`REPLAY_END_SEQ`]; it is not a batch.
    #[must_use = "a Duplicate must be dropped and a Gap or Restart handled"]
    pub fn observe(&mut self, seq: u64) -> SeqOutcome {
        let Some(expected) = self.next else {
            self.accept(seq);
            return SeqOutcome::First;
        };
        if seq == expected {
            self.accept(seq);
            SeqOutcome::InOrder
        } else if seq > expected {
            self.accept(seq);
            SeqOutcome::Gap { expected, got: seq }
        } else if seq == 0 || expected - seq > self.restart_window || !self.was_seen(seq) {
            self.seen.clear();
            self.accept(seq);
            SeqOutcome::Restart { expected, got: seq }
        } else {
            SeqOutcome::Duplicate
        }
    }

    /// The next number expected, if any was seen.
    #[must_use]
    pub fn expected(&self) -> Option<u64> {
        self.next
    }

    /// Forgets everything: the next number observed is [`SeqOutcome::First`]. Use after a
    /// reconnect, an epoch change or a full resynchronization.
    pub fn reset(&mut self) {
        self.next = None;
        self.seen.clear();
    }
}
