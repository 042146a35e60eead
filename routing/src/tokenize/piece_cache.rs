//! Exact reuse of token ids for the repeated parts of prompts.
//!
//! A Hugging Face tokenizer first cuts its input at every *added token* it matches literally
//! (`<|im_start|>`, `<|eot_id|>`, …) and then normalizes, pre-tokenizes and encodes each piece
//! between two added tokens on its own. The ids of a piece therefore depend on the piece's text
//! alone, not on what surrounds it. Chat prompts are full of added tokens (the template writes
//! them around every message), and in a multi-turn conversation, an agent loop or a RAG
//! pipeline most messages — system prompt, tool schemas, documents, earlier turns — are the
//! same text request after request. Encoding costs about a microsecond per token, so a
//! 128k-token prompt spends over 100 ms in the tokenizer while its KV-cache lookup takes
//! microseconds.
//!
//! [`PieceEncoder`] finds the places where the tokenizer cuts (leftmost-longest matching of the
//! literal added tokens, as the `tokenizers` crate does) and groups the text into *runs*: from
//! the end of the previous run to the first cut at least [`MIN_RUN_BYTES`] further on. Equal
//! prompt prefixes give equal runs, so a run seen before (a system prompt with its header, a
//! document, earlier turns) is looked up in a bounded LRU keyed by its 128-bit hash (seeded
//! per process); only new runs go through the tokenizer, and the ids are concatenated.
//! The result is the tokenizer's own output, not an approximation.
//!
//! A completion prompt, or any long text between two added tokens, is cut further: at a word
//! or line boundary that the pre-tokenizer never merges across ([`text_cut`]), again at the
//! first such place at least [`MIN_RUN_BYTES`] past the previous cut. An agent resending its
//! growing transcript as plain text, or a client sending the same document with a new
//! question, then finds every run but the last in the cache.
//!
//! That equivalence holds for the tokenizers in use today, but two features break it: an added
//! token that strips the whitespace beside it or must stand as a single word (the cut then
//! depends on neighbouring text), and a pre-tokenizer that treats the very start of the input
//! specially (Metaspace's `prepend_scheme: first`). The first is checked in the added
//! vocabulary; the second, and anything else, by a self-check when the encoder is built:
//! probe texts are encoded whole and piece by piece, and any difference leaves the cache off
//! for that tokenizer (every request is then encoded whole, as before). The cuts inside text
//! have probes of their own: a tokenizer failing only those keeps the cuts at added tokens.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::{AhoCorasick, MatchKind};
use hashlink::LruCache;
use parking_lot::Mutex;
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_128_with_seed;

use super::bounded::{EncodeBound, EncodeFailure};

/// Shortest run (in bytes, about 128 tokens of English) before the next cut. A call into the
/// tokenizer costs microseconds however short its text, so a chat's many short pieces (role
/// names, blank lines, short turns) are encoded, and cached, together; and a cold prompt costs
/// at most one call per this many bytes more than encoding it whole.
pub const MIN_RUN_BYTES: usize = 512;

/// Per-entry bookkeeping charged to the cache's budget on top of the ids (key, links, `Arc`).
const ENTRY_OVERHEAD_TOKENS: usize = 24;

/// Counters of a [`PieceEncoder`] since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PieceCacheStats {
    /// Runs found in the cache.
    pub hits: u64,
    /// Runs that had to be encoded.
    pub misses: u64,
    /// Token ids currently held.
    pub tokens: u64,
    /// Entries currently held.
    pub entries: u64,
}

/// Why a tokenizer gets no piece cache.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PieceCacheOff {
    #[error("the piece cache is configured off (0 tokens)")]
    Disabled,
    #[error("added token {0:?} strips whitespace or must be a single word")]
    ContextualAddedToken(String),
    #[error("the added tokens cannot be matched: {0}")]
    Matcher(String),
    #[error("encoding piece by piece differs from encoding whole on probe {0}")]
    ProbeMismatch(usize),
    #[error("the tokenizer failed on probe {0}: {1}")]
    ProbeFailed(usize, String),
}

struct Lru {
    map: LruCache<u128, Arc<[u32]>>,
    /// Ids held (the budget also charges [`ENTRY_OVERHEAD_TOKENS`] per entry).
    tokens: usize,
}

impl Lru {
    /// What the entries cost against the budget, in tokens.
    fn weight(&self) -> usize {
        self.tokens + self.map.len() * ENTRY_OVERHEAD_TOKENS
    }
}

/// Encodes prompts piece by piece with a cache of the pieces' ids; see the module docs.
pub struct PieceEncoder {
    /// The literal (non-normalized) added tokens; `None` when the tokenizer has none.
    splitter: Option<AhoCorasick>,
    /// Ids the post-processor puts before and after a sequence when special tokens are added;
    /// `None` when they could not be derived (such requests are encoded whole).
    wrap: Option<(Vec<u32>, Vec<u32>)>,
    /// Whether runs are also cut inside the text between added tokens, at word and line
    /// boundaries the pre-tokenizer cannot merge across ([`text_cut`]); off when the
    /// tokenizer fails the text probes of the self-check.
    text_cuts: bool,
    capacity_tokens: usize,
    /// Per-process hash seed, so that colliding pieces cannot be crafted offline (a collision
    /// could only misroute: the forwarded request is never rewritten from these ids).
    seed: u64,
    lru: Mutex<Lru>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for PieceEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PieceEncoder")
            .field("capacity_tokens", &self.capacity_tokens)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Token ids of one prompt and how many of them came from the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PieceEncoding {
    pub ids: Vec<u32>,
    pub cached_tokens: usize,
}

impl PieceEncoder {
    /// An encoder for `tokenizer` holding at most about `capacity_tokens` ids, or why the
    /// tokenizer cannot use one.
    pub fn new(tokenizer: &Tokenizer, capacity_tokens: usize) -> Result<Self, PieceCacheOff> {
        if capacity_tokens == 0 {
            return Err(PieceCacheOff::Disabled);
        }
        let mut literal = Vec::new();
        for token in tokenizer.get_added_tokens_decoder().into_values() {
            if token.normalized {
                // Matched after normalization, inside a piece: encoding the piece finds it.
                continue;
            }
            if token.lstrip || token.rstrip || token.single_word {
                return Err(PieceCacheOff::ContextualAddedToken(token.content));
            }
            if !token.content.is_empty() {
                literal.push(token.content);
            }
        }
        literal.sort_unstable();
        let splitter = if literal.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&literal)
                    .map_err(|e| PieceCacheOff::Matcher(e.to_string()))?,
            )
        };
        let mut encoder = Self {
            splitter,
            text_cuts: false,
            wrap: None,
            capacity_tokens,
            seed: std::hash::BuildHasher::hash_one(
                &std::collections::hash_map::RandomState::new(),
                0x006b_7672_6f75_7465_u64,
            ),
            lru: Mutex::new(Lru {
                map: LruCache::new_unbounded(),
                tokens: 0,
            }),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        };
        encoder.wrap = derive_wrap(tokenizer);
        encoder.self_check(tokenizer, &probes(&literal))?;
        // then the cuts inside text, on their own probes: a tokenizer that fails them keeps
        // the cuts at added tokens
        encoder.text_cuts = true;
        if let Err(why) = encoder.self_check(tokenizer, &text_probes(&literal)) {
            tracing::info!("tokenizer piece cache: runs are cut at added tokens only: {why}");
            encoder.text_cuts = false;
        }
        Ok(encoder)
    }

    /// Whether runs are also cut at word and line boundaries inside text (see the module
    /// docs); `false` when the tokenizer failed the text probes of the self-check.
    pub fn cuts_text(&self) -> bool {
        self.text_cuts
    }

    /// The ids of `text` encoded run by run with a cut at every place this encoder may cut,
    /// without the cache: for differential tests and fuzzing (it must equal encoding whole).
    #[doc(hidden)]
    pub fn encode_cut_everywhere(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> tokenizers::Result<Vec<u32>> {
        self.encode_with(
            tokenizer,
            text,
            add_special_tokens,
            1,
            false,
            &EncodeBound::unlimited(),
        )
        .map(|e| e.ids)
        .map_err(|e| match e {
            EncodeFailure::Tokenizer(e) => e,
            other => format!("{other:?}").into(),
        })
    }

    /// Counters since the encoder was built.
    pub fn stats(&self) -> PieceCacheStats {
        let lru = self.lru.lock();
        PieceCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            tokens: lru.tokens as u64,
            entries: lru.map.len() as u64,
        }
    }

    /// The ids `tokenizer.encode_fast(text, add_special_tokens)` would give.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> tokenizers::Result<PieceEncoding> {
        self.encode_bounded(
            tokenizer,
            text,
            add_special_tokens,
            &EncodeBound::unlimited(),
        )
        .map_err(|e| match e {
            EncodeFailure::Tokenizer(e) => e,
            // without a limit nothing else fails
            other => format!("{other:?}").into(),
        })
    }

    /// As [`PieceEncoder::encode`], under `bound`: runs the cache does not hold are encoded
    /// as [`EncodeBound::encode_into`] does, and the prompt is refused once its ids pass the
    /// bound's token limit.
    pub fn encode_bounded(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
        bound: &EncodeBound<'_>,
    ) -> Result<PieceEncoding, EncodeFailure> {
        self.encode_with(
            tokenizer,
            text,
            add_special_tokens,
            MIN_RUN_BYTES,
            true,
            bound,
        )
    }

    /// Cuts `text` into runs of at least `min_run` bytes ending where the tokenizer cuts, and
    /// encodes each on its own (through the cache when `cached`).
    fn encode_with(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
        min_run: usize,
        cached: bool,
        bound: &EncodeBound<'_>,
    ) -> Result<PieceEncoding, EncodeFailure> {
        let (prefix, suffix) = match (&self.wrap, add_special_tokens) {
            (_, false) => (&[][..], &[][..]),
            (Some((p, s)), true) => (&p[..], &s[..]),
            (None, true) => {
                let mut ids = Vec::new();
                bound.encode_into(tokenizer, text, true, &mut ids)?;
                return Ok(PieceEncoding {
                    ids,
                    cached_tokens: 0,
                });
            }
        };
        let mut out = PieceEncoding {
            ids: Vec::with_capacity(text.len() / 3 + prefix.len() + suffix.len()),
            cached_tokens: 0,
        };
        out.ids.extend_from_slice(prefix);
        let min_run = min_run.max(1);
        let mut run = 0;
        // the text between two added tokens starts here
        let mut segment = 0;
        if let Some(splitter) = &self.splitter {
            for m in splitter.find_iter(text) {
                self.cut_text(
                    tokenizer,
                    text,
                    (segment, m.start()),
                    min_run,
                    cached,
                    bound,
                    &mut run,
                    &mut out,
                )?;
                for cut in [m.start(), m.end()] {
                    if cut - run >= min_run {
                        self.encode_part(tokenizer, &text[run..cut], cached, bound, &mut out)?;
                        run = cut;
                    }
                }
                segment = m.end();
            }
        }
        self.cut_text(
            tokenizer,
            text,
            (segment, text.len()),
            min_run,
            cached,
            bound,
            &mut run,
            &mut out,
        )?;
        self.encode_part(tokenizer, &text[run..], cached, bound, &mut out)?;
        out.ids.extend_from_slice(suffix);
        bound.check(out.ids.len())?;
        Ok(out)
    }

    /// Within the text `segment` (start, end) between two added tokens: encodes a run up to
    /// each [`text_cut`] at least `min_run` bytes after the previous one and before the
    /// segment's end, moving `run`.
    #[allow(clippy::too_many_arguments)]
    fn cut_text(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        (start, end): (usize, usize),
        min_run: usize,
        cached: bool,
        bound: &EncodeBound<'_>,
        run: &mut usize,
        out: &mut PieceEncoding,
    ) -> Result<(), EncodeFailure> {
        if !self.text_cuts {
            return Ok(());
        }
        let bytes = text.as_bytes();
        // the segment's last run keeps at least `min_run` bytes too, so that the run ends at
        // the added token after it, wherever the text goes on from there
        while let Some(cut) = text_cut(bytes, (*run + min_run).max(start + 1), end)
            .filter(|&cut| end - cut >= min_run)
        {
            self.encode_part(tokenizer, &text[*run..cut], cached, bound, out)?;
            *run = cut;
        }
        Ok(())
    }

    /// Appends the ids of one run: from the cache, or encoded and then cached.
    fn encode_part(
        &self,
        tokenizer: &Tokenizer,
        part: &str,
        cached: bool,
        bound: &EncodeBound<'_>,
        out: &mut PieceEncoding,
    ) -> Result<(), EncodeFailure> {
        if part.is_empty() {
            return Ok(());
        }
        if !cached {
            return bound.encode_into(tokenizer, part, false, &mut out.ids);
        }
        let key = xxh3_128_with_seed(part.as_bytes(), self.seed);
        if let Some(ids) = self.lookup(key) {
            out.ids.extend_from_slice(&ids);
            out.cached_tokens += ids.len();
            // a prompt past the limit stops before its next run is encoded
            return bound.check(out.ids.len());
        }
        let from = out.ids.len();
        bound.encode_into(tokenizer, part, false, &mut out.ids)?;
        self.insert(key, &out.ids[from..]);
        Ok(())
    }

    fn lookup(&self, key: u128) -> Option<Arc<[u32]>> {
        let found = self.lru.lock().map.get(&key).cloned();
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    fn insert(&self, key: u128, ids: &[u32]) {
        if ids.len() + ENTRY_OVERHEAD_TOKENS > self.capacity_tokens / 4 {
            return; // one run may not take over the cache
        }
        let ids: Arc<[u32]> = ids.into();
        let mut lru = self.lru.lock();
        lru.tokens += ids.len();
        if let Some(old) = lru.map.insert(key, ids) {
            lru.tokens -= old.len();
        }
        while lru.weight() > self.capacity_tokens {
            let Some((_, old)) = lru.map.remove_lru() else {
                break;
            };
            lru.tokens -= old.len();
        }
    }

    /// Encodes probe texts whole and piece by piece (every piece alone, no cache); any
    /// difference means this tokenizer's pieces are not independent.
    fn self_check(&self, tokenizer: &Tokenizer, probes: &[String]) -> Result<(), PieceCacheOff> {
        for (n, probe) in probes.iter().enumerate() {
            for add in [false, true] {
                let whole = tokenizer
                    .encode_fast(probe.as_str(), add)
                    .map_err(|e| PieceCacheOff::ProbeFailed(n, e.to_string()))?;
                let pieces = self
                    .encode_with(tokenizer, probe, add, 1, false, &EncodeBound::unlimited())
                    .map_err(|e| PieceCacheOff::ProbeFailed(n, format!("{e:?}")))?;
                if whole.get_ids() != pieces.ids {
                    return Err(PieceCacheOff::ProbeMismatch(n));
                }
            }
        }
        Ok(())
    }
}

/// The first place in `bytes[from..end]` where text may be cut between runs: before a space
/// that follows an ASCII letter, digit or punctuation mark and precedes an ASCII letter (`the
/// cache|␣aware`), or after a line feed followed by an ASCII letter (`…\n|Next`).
///
/// The pre-tokenizers of today's byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's and
/// their kin: a regex split, then byte mapping) never put those two characters in one
/// pre-token. None of their alternatives matches a non-space followed by a space, or a line
/// feed followed by a letter, and their only lookahead (`\s+(?!\S)`) ends inside whitespace.
/// The model then encodes each pre-token on its own, so the ids of the text before the cut
/// and after it, each encoded alone, are the ids of the whole. Tokenizers where this does not
/// hold (a SentencePiece normalizer that prepends `▁` to every input, a pre-tokenizer that
/// keeps a line with the next) fail the self-check's text probes and are cut at added tokens
/// only. Letters, digits and punctuation are ASCII here so that no Unicode category question
/// (combining marks, normalization) can arise at a cut.
fn text_cut(bytes: &[u8], from: usize, end: usize) -> Option<usize> {
    let from = from.max(1);
    let mut at = from;
    while at < end {
        let p = at
            + bytes[at..end]
                .iter()
                .position(|&b| b == b' ' || b == b'\n')?;
        if p + 1 < end && bytes[p + 1].is_ascii_alphabetic() {
            if bytes[p] == b'\n' {
                return Some(p + 1);
            }
            if bytes[p - 1].is_ascii_graphic() {
                return Some(p); // before the space
            }
        }
        at = p + 1;
    }
    None
}

/// The ids the post-processor adds around a single sequence, found by encoding two texts with
/// and without special tokens; `None` unless both agree on a fixed prefix and suffix.
fn derive_wrap(tokenizer: &Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "kv 42\n\nroute",
    ] {
        let with = tokenizer.encode_fast(text, true).ok()?.get_ids().to_vec();
        let bare = tokenizer.encode_fast(text, false).ok()?.get_ids().to_vec();
        if bare.is_empty() || with.len() < bare.len() {
            return None;
        }
        let at = (0..=with.len() - bare.len()).find(|&i| with[i..i + bare.len()] == bare[..])?;
        let wrap = (with[..at].to_vec(), with[at + bare.len()..].to_vec());
        if found.as_ref().is_some_and(|f| *f != wrap) {
            return None;
        }
        found = Some(wrap);
    }
    found
}

/// Texts that put added tokens next to words, spaces, newlines, digits and non-ASCII text, at
/// the start, in the middle and at the end.
fn probes(literal: &[String]) -> Vec<String> {
    let pick = |i: usize| -> &str {
        if literal.is_empty() {
            ""
        } else {
            &literal[i % literal.len()]
        }
    };
    let (a, b, c) = (pick(0), pick(1), pick(2));
    vec![
        "Hello world. A probe with 123456 numbers,  double  spaces and\n\nnewlines.".to_string(),
        format!("{a}system\n\nYou are helpful.{b}\n{a}user{b}Hi there!  How are you?{c} x"),
        format!("lead{a} spaced out {b}\n\n\ttabs{a}{b}end{c}"),
        format!("   {b}ünïcödé 日本語 text{a}\n"),
        format!("{c}{c}word{a}  {b}99 bottles"),
    ]
}

/// Texts that put the cuts [`text_cut`] makes next to what could merge across them: words,
/// digits, punctuation, contractions, runs of spaces and line breaks, code, non-ASCII text and
/// added tokens.
fn text_probes(literal: &[String]) -> Vec<String> {
    let pick = |i: usize| -> &str {
        if literal.is_empty() {
            ""
        } else {
            &literal[i % literal.len()]
        }
    };
    let (a, b) = (pick(0), pick(1));
    vec![
        "Hello world. It's 2024, isn't it? They'll say we've won 1234567 times; x86_64 ok!"
            .to_string(),
        "line one\nline two\n\nThird  line,  double  spaces\n\tTabbed\n  Spaced\r\nCrlf\nz"
            .to_string(),
        "ünïcödé wörds, 日本語 text and English words, émojis 🎉 here\nÄnd more é a".to_string(),
        "a b c d e f g h i j k l m n o p q r s t u v w x y z A B C D E F G\nH\nI\n\nJ".to_string(),
        "don't won't THEY'LL I'm we've she'd IT'S o'clock 'quoted' \"double\" (paren) [b] {c}"
            .to_string(),
        "#include <stdio.h>\nint main(void) {\n    return 0;\n}\n// done\ndef f(x):\n  return x"
            .to_string(),
        "- item one\n- item two\n1. first\n2. second\n* star\n> quote\nhttps://e.x/p?q=1&b=2 ok"
            .to_string(),
        format!(
            "{a}system\n\nYou are helpful. Answer briefly.{b}\n{a}user{b}\nHi there friend{b}x y"
        ),
        "   leading spaces and trailing   \n\n\nthree breaks then words  \n tail".to_string(),
        "mixed123 abc456 7 eight 9nine ten10 -eleven +twelve .thirteen ,fourteen ;fifteen"
            .to_string(),
    ]
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TOKENIZER_JSON: &[u8] = include_bytes!("../../tests/fixtures/tokenizer/tokenizer.json");

    fn fixture() -> Tokenizer {
        Tokenizer::from_bytes(TOKENIZER_JSON).unwrap()
    }

    fn whole(tok: &Tokenizer, text: &str, add: bool) -> Vec<u32> {
        tok.encode_fast(text, add).unwrap().get_ids().to_vec()
    }

    /// A long chat in the fixture's Llama-3 format: turns of `len` bytes each.
    fn chat(turns: &[&str]) -> String {
        let mut out = String::from("<|begin_of_text|>");
        for (i, t) in turns.iter().enumerate() {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            out += &format!("<|start_header_id|>{role}<|end_header_id|>\n\n{t}<|eot_id|>");
        }
        out + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    }

    /// At least `bytes` of pseudo-random picks from `vocab`.
    fn from_vocab(vocab: &[&str], seed: u64, bytes: usize) -> String {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut s = String::new();
        while s.len() < bytes {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s += vocab[(x % vocab.len() as u64) as usize];
        }
        s
    }

    fn words(seed: u64, bytes: usize) -> String {
        let vocab = [
            "kv", "cache", "route", " ", "  ", "\n", "42", "prefix", "ü", "日本", "!?",
        ];
        from_vocab(&vocab, seed, bytes)
    }

    #[test]
    fn repeated_pieces_come_from_the_cache_with_the_tokenizers_own_ids() {
        let tok = fixture();
        let enc = PieceEncoder::new(&tok, 1 << 20).unwrap();
        let system = words(1, 4000);
        let first = chat(&[&system, &words(2, 3000)]);
        let got = enc.encode(&tok, &first, false).unwrap();
        assert_eq!(got.ids, whole(&tok, &first, false));
        assert_eq!(got.cached_tokens, 0);

        // The next turn repeats both earlier messages and adds two.
        let next = chat(&[&system, &words(2, 3000), &words(3, 2000), &words(4, 900)]);
        let got = enc.encode(&tok, &next, false).unwrap();
        assert_eq!(got.ids, whole(&tok, &next, false));
        // A message's piece runs from its header's end to its `<|eot_id|>`.
        let piece = |t: &str| whole(&tok, &format!("\n\n{t}"), false).len();
        assert!(got.cached_tokens >= piece(&system) + piece(&words(2, 3000)));
        assert!(got.cached_tokens < got.ids.len());
        // The same prompt again: all of it from the cache, nothing encoded.
        let misses = enc.stats().misses;
        let again = enc.encode(&tok, &next, false).unwrap();
        assert_eq!(again.ids, got.ids);
        assert_eq!(again.cached_tokens, again.ids.len());
        assert_eq!(enc.stats().misses, misses);

        // With special tokens added (a completions prompt) the post-processor's BOS is kept.
        let text = words(5, 2000);
        for _ in 0..2 {
            assert_eq!(
                enc.encode(&tok, &text, true).unwrap().ids,
                whole(&tok, &text, true)
            );
        }
    }

    #[test]
    fn the_cache_stays_within_its_budget() {
        let tok = fixture();
        let capacity = 4000;
        let enc = PieceEncoder::new(&tok, capacity).unwrap();
        for seed in 0..40 {
            let text = chat(&[&words(seed, 600)]);
            assert_eq!(
                enc.encode(&tok, &text, false).unwrap().ids,
                whole(&tok, &text, false)
            );
            let lru = enc.lru.lock();
            assert!(lru.weight() <= capacity, "{} > {capacity}", lru.weight());
            let held: usize = lru.map.iter().map(|(_, ids)| ids.len()).sum();
            assert_eq!(lru.tokens, held, "token bookkeeping");
        }
        let stats = enc.stats();
        assert!(stats.entries > 1 && stats.entries < 40, "{stats:?}");
        // Least recently used first: the last piece is still there, the first is gone.
        let last = chat(&[&words(39, 600)]);
        let first = chat(&[&words(0, 600)]);
        let misses = enc.stats().misses;
        let got = enc.encode(&tok, &last, false).unwrap();
        assert_eq!(got.cached_tokens, got.ids.len());
        assert_eq!(enc.stats().misses, misses);
        let got = enc.encode(&tok, &first, false).unwrap();
        assert!(got.cached_tokens < got.ids.len() / 2, "{got:?}");
        assert!(enc.stats().misses > misses);
    }

    #[test]
    fn zero_capacity_turns_the_cache_off() {
        assert_eq!(
            PieceEncoder::new(&fixture(), 0).unwrap_err(),
            PieceCacheOff::Disabled
        );
    }

    /// A word-level tokenizer with one added token, `<s>`, configured as given.
    fn word_level(added: &str, prepend_scheme: &str) -> Tokenizer {
        let json = format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null,
              "added_tokens": [{{"id": 0, "content": "<s>", {added}, "special": true}}],
              "normalizer": null,
              "pre_tokenizer": {{"type": "Metaspace", "replacement": "\u2581",
                                 "prepend_scheme": "{prepend_scheme}", "split": true}},
              "post_processor": null, "decoder": null,
              "model": {{"type": "WordLevel", "unk_token": "<unk>",
                         "vocab": {{"<s>": 0, "<unk>": 1, "system": 2, "\u2581system": 3,
                                    "user": 4, "\u2581user": 5, "word": 6, "\u2581word": 7,
                                    "end": 8, "\u2581end": 9}}}}}}"#
        );
        Tokenizer::from_bytes(json.as_bytes()).unwrap()
    }

    const PLAIN: &str =
        r#""single_word": false, "lstrip": false, "rstrip": false, "normalized": false"#;

    #[test]
    fn tokenizers_whose_pieces_depend_on_context_get_no_cache() {
        // Metaspace prepending only at the very start: a piece after `<s>` is encoded
        // differently alone. The self-check finds it.
        let first = word_level(PLAIN, "first");
        assert!(matches!(
            PieceEncoder::new(&first, 1 << 20),
            Err(PieceCacheOff::ProbeMismatch(_))
        ));
        // Prepending everywhere is context-free: cached, and exact.
        let always = word_level(PLAIN, "always");
        let enc = PieceEncoder::new(&always, 1 << 20).unwrap();
        let text = format!("<s>{}<s>user end", "word ".repeat(200));
        for _ in 0..2 {
            assert_eq!(
                enc.encode(&always, &text, false).unwrap().ids,
                whole(&always, &text, false)
            );
        }
        // two runs (up to the second `<s>`, and the rest), both found the second time
        assert_eq!(enc.stats().hits, 2);
        // An added token that eats neighbouring spaces.
        let lstrip = word_level(
            r#""single_word": false, "lstrip": true, "rstrip": false, "normalized": false"#,
            "always",
        );
        assert_eq!(
            PieceEncoder::new(&lstrip, 1 << 20).unwrap_err(),
            PieceCacheOff::ContextualAddedToken("<s>".into())
        );
    }

    /// Text without added tokens: words, digits, punctuation, spaces, line breaks, non-ASCII.
    fn prose(seed: u64, bytes: usize) -> String {
        let vocab = [
            "the", " ", " ", "  ", "\n", "\n\n", " \n", "Cache", "route", "42", "7", ".", ",",
            "'s", "'t", "\t", "é", "日本", "!?", "(x)", "-", "\r\n", "A", "b", "🎉", "don't",
        ];
        from_vocab(&vocab, seed, bytes)
    }

    #[test]
    fn a_long_text_with_a_new_ending_is_served_from_the_cache_but_its_ending() {
        let tok = fixture();
        let enc = PieceEncoder::new(&tok, 1 << 20).unwrap();
        assert!(enc.cuts_text());
        // a completion prompt: no added tokens at all, as the overhead benchmark sends it
        let body = prose(11, 60_000);
        let first = format!("{body} request 1");
        let got = enc.encode(&tok, &first, true).unwrap();
        assert_eq!(got.ids, whole(&tok, &first, true));
        assert_eq!(got.cached_tokens, 0);
        assert!(enc.stats().entries > 50, "cut into runs: {:?}", enc.stats());
        // the same text with another ending: all but the last run or two from the cache
        let next = format!("{body} request 2 and why");
        let got = enc.encode(&tok, &next, true).unwrap();
        assert_eq!(got.ids, whole(&tok, &next, true));
        assert!(
            got.cached_tokens * 100 >= got.ids.len() * 97,
            "{} of {} cached",
            got.cached_tokens,
            got.ids.len()
        );
        // a transcript that grows: the earlier part is found again
        let longer = format!("{body} request 2 and why\nBecause the cache holds it.");
        let got = enc.encode(&tok, &longer, false).unwrap();
        assert_eq!(got.ids, whole(&tok, &longer, false));
        assert!(got.cached_tokens * 100 >= got.ids.len() * 97);
    }

    #[test]
    fn where_text_is_cut() {
        let cut = |s: &str, from: usize| text_cut(s.as_bytes(), from, s.len());
        // before a space between a word and a letter
        assert_eq!(cut("kv cache", 0), Some(2));
        assert_eq!(cut("x1 y", 0), Some(2));
        assert_eq!(cut("end. Next", 0), Some(4));
        // not before a space followed by a digit, a space or punctuation, nor after a space
        assert_eq!(cut("a 1", 0), None);
        assert_eq!(cut("a  b", 0), None);
        assert_eq!(cut("a .b", 0), None);
        assert_eq!(cut(" b", 0), None);
        // after a line feed followed by a letter, not by a space or a digit
        assert_eq!(cut("a\nb", 0), Some(2));
        assert_eq!(cut("a\n\nb", 0), Some(3));
        assert_eq!(cut("a\n b", 0), None);
        assert_eq!(cut("a\n1", 0), None);
        // not before non-ASCII letters, nor after them
        assert_eq!(cut("a é", 0), None);
        assert_eq!(cut("é a", 0), None);
        // the first at or after `from`, inside the end
        assert_eq!(cut("aa bb cc", 3), Some(5));
        assert_eq!(text_cut(b"aa bb", 0, 3), None);
    }

    /// A tokenizer whose normalizer prepends `▁` to every input it is given (SentencePiece's
    /// `add_dummy_prefix`, as Llama 2's tokenizer.json writes it): text pieces are not
    /// independent, the pieces between added tokens are.
    #[test]
    fn a_tokenizer_that_prepends_to_each_input_is_cut_at_added_tokens_only() {
        let json = r#"{"version": "1.0", "truncation": null, "padding": null,
          "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                            "rstrip": false, "normalized": false, "special": true}],
          "normalizer": {"type": "Prepend", "prepend": "\u2581"},
          "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                            "prepend_scheme": "never", "split": true},
          "post_processor": null, "decoder": null,
          "model": {"type": "WordLevel", "unk_token": "<unk>",
                    "vocab": {"<s>": 0, "<unk>": 1, "\u2581": 2, "\u2581word": 3,
                              "\u2581end": 4, "\u2581system": 5}}}"#;
        let tok = Tokenizer::from_bytes(json.as_bytes()).unwrap();
        let enc = PieceEncoder::new(&tok, 1 << 20).unwrap();
        assert!(!enc.cuts_text());
        let text = format!("<s>system {}<s>end", "word ".repeat(300));
        assert_eq!(
            enc.encode_cut_everywhere(&tok, &text, false).unwrap(),
            whole(&tok, &text, false)
        );
        // and cut text would not be exact here: what the self-check saw
        let bytes = text.as_bytes();
        let at = text_cut(bytes, 4, bytes.len()).unwrap();
        let mut pieces = whole(&tok, &text[..at], false);
        pieces.extend(whole(&tok, &text[at..], false));
        assert_ne!(pieces, whole(&tok, &text, false));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Cut at every place text may be cut, each run encoded alone: the ids of the whole.
        #[test]
        fn text_cut_everywhere_equals_whole(
            seed in any::<u64>(),
            len in 1usize..3000,
            special in prop::option::of(0usize..4),
            add in any::<bool>(),
        ) {
            let tok = fixture();
            let enc = PieceEncoder::new(&tok, 1 << 16).unwrap();
            let mut text = prose(seed, len);
            if let Some(s) = special {
                let specials = ["<|eot_id|>", "<|start_header_id|>", "<|im_start|>", "<|"];
                let mut at = text.len() / 2;
                while !text.is_char_boundary(at) {
                    at -= 1;
                }
                text.insert_str(at, specials[s]);
            }
            let expected = whole(&tok, &text, add);
            prop_assert_eq!(&enc.encode_cut_everywhere(&tok, &text, add).unwrap(), &expected);
            prop_assert_eq!(&enc.encode(&tok, &text, add).unwrap().ids, &expected);
        }

        /// Any text made of the fixture's special tokens and words: piece-wise encoding,
        /// cold or warm, equals whole encoding.
        #[test]
        fn piecewise_equals_whole(
            parts in prop::collection::vec((0usize..9, 0u64..6, 0usize..700), 1..12),
            add in any::<bool>(),
        ) {
            let tok = fixture();
            let enc = PieceEncoder::new(&tok, 1 << 16).unwrap();
            let specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|", " "];
            let mut text = String::new();
            for &(s, seed, len) in &parts {
                text += specials[s];
                text += &words(seed, len);
            }
            let expected = whole(&tok, &text, add);
            prop_assert_eq!(&enc.encode(&tok, &text, add).unwrap().ids, &expected);
            prop_assert_eq!(&enc.encode(&tok, &text, add).unwrap().ids, &expected);
        }
    }
}
