//! Hash ids → token ids.
//!
//! Traces publish prefixes as chained block hash ids (equal id ⇒ identical prefix up to and
//! including that block), not text. To replay them against engines that hash real token ids,
//! every id becomes `block_tokens` pseudo-random token ids seeded by the id alone. Two prompts
//! that share their first `k` ids therefore share their first `k × block_tokens` tokens exactly,
//! and prompts that differ in an id differ in that block's tokens, so every engine and router
//! sees exactly the trace's prefix structure, at whatever KV block size it uses.

/// Lowest token id produced (keeps clear of special tokens in real vocabularies).
pub const TOKEN_BASE: u32 = 1_000;
/// Token ids fall in `TOKEN_BASE..TOKEN_BASE + TOKEN_SPAN`, inside a 128k vocabulary.
pub const TOKEN_SPAN: u32 = 120_000;

/// SplitMix64 finalizer: a cheap, well-mixed bijection of 64-bit values.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Token `j` of the block with hash id `id`.
#[inline]
pub fn block_token(id: u64, j: u32) -> u32 {
    let r = mix64(mix64(id) ^ u64::from(j).wrapping_mul(0xa076_1d64_78bd_642f));
    TOKEN_BASE + (r % u64::from(TOKEN_SPAN)) as u32
}

/// `token` (a [`block_token`] id) folded into a vocabulary of `vocab` ids, for models smaller
/// than [`TOKEN_BASE`] + [`TOKEN_SPAN`] (the real-engine bench's tiny model has 4,096). Ids stay
/// clear of the low ids where special tokens live (at or above 1,000 when the vocabulary has
/// more than 2,000 ids, else 16); a large vocabulary keeps ids unchanged.
pub fn fold_into_vocab(token: u32, vocab: u32) -> u32 {
    if vocab >= TOKEN_BASE + TOKEN_SPAN {
        return token;
    }
    let lo = if vocab > 2 * TOKEN_BASE {
        TOKEN_BASE
    } else {
        16.min(vocab / 2)
    };
    let span = (vocab - lo).max(1);
    lo + token.saturating_sub(TOKEN_BASE) % span
}

/// The prompt of a request: the tokens of its hash ids' blocks, `block_tokens` each, cut at
/// `input_len` (the last block of a trace request is usually partial).
pub fn prompt_tokens(hash_ids: &[u64], block_tokens: u32, input_len: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(input_len as usize);
    'outer: for &id in hash_ids {
        for j in 0..block_tokens {
            if out.len() >= input_len as usize {
                break 'outer;
            }
            out.push(block_token(id, j));
        }
    }
    out
}

#[cfg(test)]
mod fold_tests {
    use super::*;

    #[test]
    fn folded_ids_fit_the_vocabulary_and_keep_clear_of_special_ids() {
        for id in 0..200u64 {
            for j in 0..32 {
                let t = block_token(id, j);
                let f = fold_into_vocab(t, 4_096);
                assert!((TOKEN_BASE..4_096).contains(&f), "{f}");
                let g = fold_into_vocab(t, 512);
                assert!((16..512).contains(&g), "{g}");
                assert_eq!(fold_into_vocab(t, 128_256), t);
            }
        }
        // distinct blocks stay distinct after folding
        let a: Vec<u32> = (0..32)
            .map(|j| fold_into_vocab(block_token(1, j), 4_096))
            .collect();
        let b: Vec<u32> = (0..32)
            .map(|j| fold_into_vocab(block_token(2, j), 4_096))
            .collect();
        assert_ne!(a, b);
    }
}
