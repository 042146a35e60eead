//! Fault injection: the same JSON shape on the command line (`--fault '{...}'`) and on
//! `POST /admin/fault`, so a benchmark script and a test describe faults identically.

use serde::{Deserialize, Serialize};

/// What to break.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// The engine dies. `exit` ends the whole process (exit code 1); `close` stops this engine
    /// only: its listeners and ZMQ sockets close and open connections are dropped mid-response.
    /// With `restart_after_ms` a `close`d engine comes back on the same ports with an empty
    /// cache, fresh counters and event sequence numbers from 0, like a restarted pod.
    Crash {
        #[serde(default)]
        mode: CrashMode,
        #[serde(default)]
        restart_after_ms: Option<u64>,
    },
    /// Accept connections but never answer (except `/admin/*`), and stop stepping, until a
    /// `clear`.
    Hang,
    /// Every step takes `factor` times longer.
    Slow { factor: f64 },
    /// Drop this fraction of KV event batches (1.0 = all). Their sequence numbers are used up,
    /// so subscribers see a gap. With `replayable` (the default) the dropped batches stay in
    /// the replay buffer, as when the network lost them; without it they are gone for good.
    DropEvents {
        #[serde(default = "one")]
        fraction: f64,
        #[serde(default = "yes")]
        replayable: bool,
    },
    /// The engine restarts in place with an empty cache: in-flight requests fail, counters
    /// start over, and `AllBlocksCleared` is published. `seq` says whether event sequence
    /// numbers continue or start again at 0 (the replay buffer is then emptied).
    Restart {
        #[serde(default)]
        seq: SeqMode,
    },
    /// Besides its real batches, the publisher floods its subscribers with `per_second`
    /// hostile messages: random bytes (up to `max_bytes`), msgpack of the wrong shape, bad
    /// sequence frames, and sequence numbers that jump ahead or back. They use no real
    /// sequence numbers and never enter the replay buffer, as from a buggy or hostile process
    /// publishing on the engine's port.
    GarbageEvents {
        #[serde(default = "garbage_rate")]
        per_second: u32,
        #[serde(default = "garbage_bytes")]
        max_bytes: usize,
    },
    /// Besides the requests it serves, each rank prefills synthetic prompts of
    /// `prompt_tokens` random tokens at `tokens_per_second` (wall time), as a GPU busy with
    /// traffic from elsewhere: their blocks enter its cache, evicting the least recently used
    /// once it is full, and it publishes what a real engine publishes for them (a
    /// `BlockStored` per prompt, a `BlockRemoved` per evicted block). It takes none of the
    /// modelled step time and moves none of the served-request counters. For scale
    /// benchmarks: a large pool's event load without serving its requests.
    BackgroundPrefill {
        tokens_per_second: f64,
        #[serde(default = "background_prompt")]
        prompt_tokens: u32,
    },
    /// Undo `hang`, `slow`, `drop_events`, `garbage_events` and `background_prefill`.
    Clear,
}

fn one() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

fn garbage_rate() -> u32 {
    1_000
}

fn garbage_bytes() -> usize {
    4_096
}

fn background_prompt() -> u32 {
    2_048
}

/// Highest background prefill rate (tokens per second per rank) and prompt accepted.
pub const MAX_BACKGROUND_TOKENS_PER_SECOND: f64 = 1e8;
pub const MAX_BACKGROUND_PROMPT: u32 = 1 << 20;

/// Highest garbage message rate and size accepted (the flood must not take the simulator down).
pub const MAX_GARBAGE_PER_SECOND: u32 = 1_000_000;
pub const MAX_GARBAGE_BYTES: usize = 16 << 20;

/// How a crash shows itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CrashMode {
    #[default]
    Exit,
    Close,
}

/// Event sequence numbers after a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SeqMode {
    #[default]
    Continue,
    Zero,
}

/// A fault plus when and where to apply it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultSpec {
    #[serde(flatten)]
    pub fault: Fault,
    /// Delay before applying it (wall milliseconds from now, or from start on the command
    /// line).
    #[serde(default)]
    pub after_ms: Option<u64>,
    /// Engine index in a multi-engine process (command line only; `None` = every engine).
    #[serde(default)]
    pub engine: Option<usize>,
    /// Data-parallel rank for `slow`, `drop_events`, `garbage_events` and `restart` (`None` =
    /// every rank).
    #[serde(default)]
    pub rank: Option<u32>,
}

impl FaultSpec {
    /// Checks the numbers.
    ///
    /// # Errors
    /// A message for a factor or fraction out of range.
    pub fn validate(&self) -> Result<(), String> {
        match &self.fault {
            Fault::Slow { factor } if !(factor.is_finite() && *factor >= 0.01) => Err(format!(
                "slow factor must be a number >= 0.01, got {factor}"
            )),
            Fault::DropEvents { fraction, .. } if !(0.0..=1.0).contains(fraction) => Err(format!(
                "drop_events fraction must be within 0..=1, got {fraction}"
            )),
            Fault::GarbageEvents {
                per_second,
                max_bytes,
            } if !(1..=MAX_GARBAGE_PER_SECOND).contains(per_second)
                || !(1..=MAX_GARBAGE_BYTES).contains(max_bytes) =>
            {
                Err(format!(
                    "garbage_events needs per_second within 1..={MAX_GARBAGE_PER_SECOND} and \
                     max_bytes within 1..={MAX_GARBAGE_BYTES}, got {per_second} and {max_bytes}"
                ))
            }
            Fault::BackgroundPrefill {
                tokens_per_second,
                prompt_tokens,
            } if !(tokens_per_second.is_finite()
                && *tokens_per_second > 0.0
                && *tokens_per_second <= MAX_BACKGROUND_TOKENS_PER_SECOND
                && (1..=MAX_BACKGROUND_PROMPT).contains(prompt_tokens)) =>
            {
                Err(format!(
                    "background_prefill needs tokens_per_second within (0, \
                     {MAX_BACKGROUND_TOKENS_PER_SECOND}] and prompt_tokens within \
                     1..={MAX_BACKGROUND_PROMPT}, got {tokens_per_second} and {prompt_tokens}"
                ))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind() {
        let p = |s: &str| serde_json::from_str::<FaultSpec>(s).unwrap();
        assert_eq!(
            p(r#"{"kind":"crash","mode":"close","restart_after_ms":50}"#).fault,
            Fault::Crash {
                mode: CrashMode::Close,
                restart_after_ms: Some(50)
            }
        );
        assert_eq!(
            p(r#"{"kind":"crash"}"#).fault,
            Fault::Crash {
                mode: CrashMode::Exit,
                restart_after_ms: None
            }
        );
        assert_eq!(p(r#"{"kind":"hang"}"#).fault, Fault::Hang);
        let s = p(r#"{"kind":"slow","factor":3,"after_ms":10,"engine":1,"rank":0}"#);
        assert_eq!(s.fault, Fault::Slow { factor: 3.0 });
        assert_eq!((s.after_ms, s.engine, s.rank), (Some(10), Some(1), Some(0)));
        assert_eq!(
            p(r#"{"kind":"drop_events"}"#).fault,
            Fault::DropEvents {
                fraction: 1.0,
                replayable: true
            }
        );
        assert_eq!(
            p(r#"{"kind":"restart","seq":"zero"}"#).fault,
            Fault::Restart { seq: SeqMode::Zero }
        );
        assert_eq!(
            p(r#"{"kind":"garbage_events"}"#).fault,
            Fault::GarbageEvents {
                per_second: 1_000,
                max_bytes: 4_096
            }
        );
        assert!(
            p(r#"{"kind":"garbage_events","per_second":0}"#)
                .validate()
                .is_err()
        );
        assert!(
            p(r#"{"kind":"garbage_events","max_bytes":999999999}"#)
                .validate()
                .is_err()
        );
        assert_eq!(
            p(r#"{"kind":"background_prefill","tokens_per_second":1e4}"#).fault,
            Fault::BackgroundPrefill {
                tokens_per_second: 1e4,
                prompt_tokens: 2_048
            }
        );
        for bad in [
            r#"{"kind":"background_prefill","tokens_per_second":0}"#,
            r#"{"kind":"background_prefill","tokens_per_second":1e12}"#,
            r#"{"kind":"background_prefill","tokens_per_second":10,"prompt_tokens":0}"#,
        ] {
            assert!(p(bad).validate().is_err(), "{bad}");
        }
        assert_eq!(p(r#"{"kind":"clear"}"#).fault, Fault::Clear);
        assert!(serde_json::from_str::<FaultSpec>(r#"{"kind":"melt"}"#).is_err());
        assert!(p(r#"{"kind":"slow","factor":0}"#).validate().is_err());
        assert!(
            p(r#"{"kind":"drop_events","fraction":1.5}"#)
                .validate()
                .is_err()
        );
    }
}
