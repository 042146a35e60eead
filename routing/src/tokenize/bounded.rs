//! Encoding that gives up as soon as a prompt is certain to exceed its token limit, and a
//! bound on how much text is being encoded at once.
//!
//! A Hugging Face `Encoding` costs about 150 bytes of memory per byte of text while it is
//! built (alignments per byte, a `String` and offsets per token): a 2 MiB prompt peaks at about
//! 300 MB, and a 14 MiB one — under the body limit, far over any token limit — used to cost
//! 3.3 GB and seconds of CPU before it was refused. Two rules keep that bounded:
//!
//! * **Count first.** A text with more bytes than tokens left in the budget may not fit. It is
//!   first encoded window by window ([`WINDOW_BYTES`], cut before a space or line break where
//!   there is one), only to count; the count stops at the first window that takes it past the
//!   budget (plus [`CUT_SLACK_TOKENS`] per cut, what a cut can change), and the prompt is
//!   refused there. Only a text that fits is then encoded whole, so its ids are the
//!   tokenizer's own, exactly. Counting costs one extra pass over texts longer (in bytes) than
//!   the tokens they may have; shorter texts, the common case, are encoded once.
//! * **A byte budget for large encodes.** Encoding a text of [`GATED_BYTES`] or more takes its
//!   length from a process-wide budget ([`EncodeGate`]); a text that does not fit while others
//!   are being encoded is refused as busy (the caller answers 429) rather than queued. One text
//!   alone is always admitted, whatever its size, so the limit never refuses a prompt that the
//!   token limit accepts on an idle picker.

use parking_lot::Mutex;
use tokenizers::Tokenizer;

/// Bytes encoded per window while counting (a few MB of memory per window).
pub const WINDOW_BYTES: usize = 32 * 1024;
/// Tokens one window cut may add to (or take from) the count of the text encoded whole: the
/// split word's extra pieces, a prefix space some pre-tokenizers add at a window's start.
pub const CUT_SLACK_TOKENS: usize = 8;
/// Texts from this size on are encoded under the [`EncodeGate`].
pub const GATED_BYTES: usize = 64 * 1024;

/// Why a bounded encode gave no ids.
#[derive(Debug)]
pub enum EncodeFailure {
    /// The tokenizer failed on the text.
    Tokenizer(tokenizers::Error),
    /// The text has at least this many tokens, more than the budget.
    OverLimit { at_least: usize },
    /// Other large texts are being encoded: this one would take the bytes in flight past
    /// `limit`.
    Busy { bytes: usize, limit: usize },
}

impl From<tokenizers::Error> for EncodeFailure {
    fn from(e: tokenizers::Error) -> Self {
        Self::Tokenizer(e)
    }
}

/// Bytes of text being encoded right now, against a limit.
#[derive(Debug, Default)]
pub struct EncodeGate {
    in_use: Mutex<usize>,
}

/// What a text holds of an [`EncodeGate`] while it is encoded.
#[derive(Debug)]
pub struct GatePass<'a> {
    gate: &'a EncodeGate,
    bytes: usize,
}

impl Drop for GatePass<'_> {
    fn drop(&mut self) {
        *self.gate.in_use.lock() -= self.bytes;
    }
}

impl EncodeGate {
    /// The gate every tokenizer of this process shares: memory is the process's.
    pub fn global() -> &'static EncodeGate {
        static GATE: EncodeGate = EncodeGate {
            in_use: Mutex::new(0),
        };
        &GATE
    }

    /// Take `bytes` of text (nothing below [`GATED_BYTES`]); refused when others hold some and
    /// the total would pass `limit`.
    pub fn enter(&self, bytes: usize, limit: usize) -> Result<Option<GatePass<'_>>, EncodeFailure> {
        if bytes < GATED_BYTES {
            return Ok(None);
        }
        let mut in_use = self.in_use.lock();
        if *in_use > 0 && in_use.saturating_add(bytes) > limit {
            return Err(EncodeFailure::Busy { bytes, limit });
        }
        *in_use += bytes;
        Ok(Some(GatePass { gate: self, bytes }))
    }

    /// Bytes being encoded now.
    pub fn in_use(&self) -> usize {
        *self.in_use.lock()
    }
}

/// The limits one bounded encode runs under.
#[derive(Debug, Clone, Copy)]
pub struct EncodeBound<'a> {
    /// Tokens the whole prompt may have.
    pub max_tokens: usize,
    /// Bytes of large texts that may be encoded at once, process-wide.
    pub max_bytes_at_once: usize,
    pub gate: &'a EncodeGate,
}

impl EncodeBound<'static> {
    /// No token limit and no byte budget: ids exactly as the tokenizer gives them.
    pub fn unlimited() -> Self {
        static UNGATED: EncodeGate = EncodeGate {
            in_use: Mutex::new(0),
        };
        Self {
            max_tokens: usize::MAX,
            max_bytes_at_once: usize::MAX,
            gate: &UNGATED,
        }
    }
}

impl EncodeBound<'_> {
    /// `Err(OverLimit)` once a prompt's `ids` are more than `max_tokens`.
    pub fn check(&self, ids: usize) -> Result<(), EncodeFailure> {
        if ids > self.max_tokens {
            return Err(EncodeFailure::OverLimit { at_least: ids });
        }
        Ok(())
    }

    /// `tokenizer.encode_fast(text, add_special_tokens)`'s ids, appended to `out`, unless the
    /// ids in `out` and these together are certain to be more than `max_tokens`.
    pub fn encode_into(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), EncodeFailure> {
        let left = self.max_tokens.saturating_sub(out.len());
        if text.len() > left {
            // what is certain is counted on top of the ids already in `out`
            count_within(tokenizer, text, left).map_err(|e| match e {
                EncodeFailure::OverLimit { at_least } => EncodeFailure::OverLimit {
                    at_least: at_least + out.len(),
                },
                other => other,
            })?;
        }
        // counting holds a window at a time; encoding whole holds the text's weight
        let _pass = self.gate.enter(text.len(), self.max_bytes_at_once)?;
        let encoding = tokenizer.encode_fast(text, add_special_tokens)?;
        out.extend_from_slice(encoding.get_ids());
        self.check(out.len())
    }
}

/// Counts `text`'s tokens window by window and fails as soon as the count shows more than
/// `budget`, allowing [`CUT_SLACK_TOKENS`] per cut.
fn count_within(tokenizer: &Tokenizer, text: &str, budget: usize) -> Result<(), EncodeFailure> {
    let mut counted = 0usize;
    let mut cuts = 0usize;
    let mut at = 0;
    while at < text.len() {
        let end = window_end(text, at);
        counted += tokenizer.encode_fast(&text[at..end], false)?.len();
        if end < text.len() {
            cuts += 1;
        }
        let at_least = counted.saturating_sub(cuts * CUT_SLACK_TOKENS);
        if at_least > budget {
            return Err(EncodeFailure::OverLimit { at_least });
        }
        at = end;
    }
    Ok(())
}

/// Where the window starting at `at` ends: the text's end, else the last space or line break
/// that follows a non-space in the window's second half, else the last character boundary.
fn window_end(text: &str, at: usize) -> usize {
    let limit = at + WINDOW_BYTES;
    if limit >= text.len() {
        return text.len();
    }
    let bytes = text.as_bytes();
    let half = at + WINDOW_BYTES / 2;
    if let Some(cut) = (half + 1..=limit)
        .rev()
        .find(|&i| matches!(bytes[i], b' ' | b'\n') && !bytes[i - 1].is_ascii_whitespace())
    {
        return cut;
    }
    let mut cut = limit;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    cut
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/tokenizer/tokenizer.json"
        );
        Tokenizer::from_file(path).expect("fixture tokenizer")
    }

    fn words(bytes: usize) -> String {
        let words = [
            "alpha ", "beta ", "route\n", "cache ", "the ", "of ", "é ", "日本 ",
        ];
        let mut s = String::new();
        let mut i = 0usize;
        while s.len() < bytes {
            s.push_str(words[i % words.len()]);
            i = (i * 31 + 7) % 1_000_003;
        }
        s
    }

    #[test]
    fn windows_end_at_a_space_or_a_character_boundary() {
        let text = words(5 * WINDOW_BYTES + 17);
        let mut at = 0;
        while at < text.len() {
            let end = window_end(&text, at);
            assert!(end > at && end - at <= WINDOW_BYTES);
            assert!(text.is_char_boundary(end));
            if end < text.len() {
                assert!(matches!(text.as_bytes()[end], b' ' | b'\n'));
            }
            at = end;
        }
        // no space at all: cut at a character boundary
        let cjk = "日".repeat(WINDOW_BYTES);
        let end = window_end(&cjk, 0);
        assert!(cjk.is_char_boundary(end) && end <= WINDOW_BYTES && end > WINDOW_BYTES - 3);
    }

    #[test]
    fn a_text_that_fits_gives_the_tokenizers_own_ids() {
        let tok = tokenizer();
        let text = words(3 * WINDOW_BYTES);
        let whole = tok.encode_fast(text.as_str(), true).expect("encodes");
        let gate = EncodeGate::default();
        // fewer tokens left than bytes: counted first, then encoded whole
        let bound = EncodeBound {
            max_tokens: whole.len(),
            max_bytes_at_once: 1 << 20,
            gate: &gate,
        };
        assert!(text.len() > bound.max_tokens);
        let mut out = Vec::new();
        bound
            .encode_into(&tok, &text, true, &mut out)
            .expect("fits");
        assert_eq!(out, whole.get_ids());
        assert_eq!(gate.in_use(), 0, "the pass is given back");
    }

    #[test]
    fn counting_stops_soon_after_the_budget_is_passed() {
        let tok = tokenizer();
        let text = words(40 * WINDOW_BYTES);
        let budget = 1000;
        let gate = EncodeGate::default();
        let bound = EncodeBound {
            max_tokens: budget,
            max_bytes_at_once: usize::MAX,
            gate: &gate,
        };
        let mut out = Vec::new();
        match bound.encode_into(&tok, &text, false, &mut out) {
            Err(EncodeFailure::OverLimit { at_least }) => {
                assert!(at_least > budget);
                // one window past the budget at most, far below the whole text's count
                let window = tok.encode_fast(&text[..WINDOW_BYTES], false).unwrap().len();
                assert!(at_least <= budget + window + CUT_SLACK_TOKENS, "{at_least}");
            }
            other => panic!("expected OverLimit, got {other:?}"),
        }
        assert!(out.is_empty());
        // ids already produced count against the budget
        let mut out = vec![0; budget];
        let small = EncodeBound {
            max_tokens: budget,
            max_bytes_at_once: usize::MAX,
            gate: &gate,
        };
        assert!(matches!(
            small.encode_into(&tok, "alpha beta", false, &mut out),
            Err(EncodeFailure::OverLimit { .. })
        ));
    }

    #[test]
    fn the_gate_admits_one_large_text_alone_and_bounds_several() {
        let gate = EncodeGate::default();
        assert!(
            gate.enter(GATED_BYTES - 1, 0).unwrap().is_none(),
            "small texts pass"
        );
        let big = gate.enter(10 * GATED_BYTES, GATED_BYTES).unwrap();
        assert!(big.is_some(), "alone, any size");
        assert!(matches!(
            gate.enter(GATED_BYTES, GATED_BYTES),
            Err(EncodeFailure::Busy { .. })
        ));
        drop(big);
        assert_eq!(gate.in_use(), 0);
        let a = gate.enter(GATED_BYTES, 2 * GATED_BYTES).unwrap();
        let b = gate.enter(GATED_BYTES, 2 * GATED_BYTES).unwrap();
        assert!(a.is_some() && b.is_some());
        assert_eq!(gate.in_use(), 2 * GATED_BYTES);
    }
}
