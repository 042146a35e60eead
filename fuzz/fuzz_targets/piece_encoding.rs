//! Differential: the tokenizer piece cache must give exactly the ids of encoding the whole
//! text, cold and warm, with and without special tokens, and so must cutting the text at every
//! place the encoder may cut (added tokens, and word and line boundaries inside text) with each
//! run encoded alone. Input: UTF-8 text in which the bytes
//! 0x01-0x08 stand for the fixture tokenizer's eight added tokens (so that random inputs cut
//! into pieces). One encoder with a small budget is shared by every run, so that runs are
//! found in the cache, evicted and encoded again across inputs.
#![no_main]

use std::sync::LazyLock;

use kvroute_routing::tokenize::piece_cache::PieceEncoder;
use libfuzzer_sys::fuzz_target;
use tokenizers::Tokenizer;

const TOKENIZER_JSON: &[u8] =
    include_bytes!("../../routing/tests/fixtures/tokenizer/tokenizer.json");

static TOKENIZER: LazyLock<Tokenizer> =
    LazyLock::new(|| Tokenizer::from_bytes(TOKENIZER_JSON).expect("fixture tokenizer"));
/// The tokenizer's added tokens in id order (the fixture has eight).
static ADDED: LazyLock<Vec<String>> = LazyLock::new(|| {
    let mut added: Vec<_> = TOKENIZER.get_added_tokens_decoder().into_iter().collect();
    added.sort_unstable_by_key(|&(id, _)| id);
    added.into_iter().map(|(_, t)| t.content).collect()
});
static ENCODER: LazyLock<PieceEncoder> = LazyLock::new(|| {
    PieceEncoder::new(&TOKENIZER, 20_000).expect("the fixture passes the self-check")
});

fuzz_target!(|data: &[u8]| {
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };
    let mut text = String::with_capacity(raw.len() * 2);
    for c in raw.chars() {
        match c as u32 {
            n @ 1..=8 if (n as usize) <= ADDED.len() => text.push_str(&ADDED[n as usize - 1]),
            _ => text.push(c),
        }
    }
    for add in [false, true] {
        let whole = TOKENIZER.encode_fast(text.as_str(), add).expect("encode");
        let everywhere = ENCODER
            .encode_cut_everywhere(&TOKENIZER, &text, add)
            .expect("encode cut everywhere");
        assert_eq!(
            everywhere,
            whole.get_ids(),
            "cut everywhere, add_special_tokens={add}: {text:?}"
        );
        for _ in 0..2 {
            let pieces = ENCODER
                .encode(&TOKENIZER, &text, add)
                .expect("encode pieces");
            assert_eq!(
                pieces.ids,
                whole.get_ids(),
                "add_special_tokens={add}: {text:?}"
            );
        }
    }
});
