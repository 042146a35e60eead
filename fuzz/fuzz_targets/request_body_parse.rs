//! Request bodies: the typed parse for every API kind, the local tokenizer path (character
//! chunks and the fallback chat rendering) on whatever parsed, and the salt injection.
//!
//! The property behind the tenancy guarantee: every body the picker would forward under
//! `SaltedCache` parses as JSON and carries exactly one top-level `cache_salt`, the tenant's.
#![no_main]

use std::borrow::Cow;

use bytes::Bytes;
use kvroute_routing::request::{ApiKind, ParsedRequest, RequestLimits, engine_body};
use kvroute_routing::tokenize::{PromptTokenizer, PromptTokenizerOptions};
use libfuzzer_sys::fuzz_target;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

const TENANT_SALT: &str = "0123456789abcdef0123456789abcdef";

/// How many times `key` appears among the top-level keys of a JSON object (a tree would
/// keep only one of duplicated keys, and an engine may read either).
fn top_level_count(body: &[u8], key: &str) -> usize {
    struct Count<'k>(&'k str);
    impl<'de> Visitor<'de> for Count<'_> {
        type Value = usize;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
            let mut n = 0;
            while let Some(k) = map.next_key::<Cow<'de, str>>()? {
                n += usize::from(k == self.0);
                map.next_value::<IgnoredAny>()?;
            }
            Ok(n)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    de.deserialize_map(Count(key))
        .expect("a forwarded body is a JSON object")
}

fuzz_target!(|data: &[u8]| {
    let limits = RequestLimits::default();
    let tok = PromptTokenizer::new(None, None, PromptTokenizerOptions::default())
        .expect("char-chunk tokenizer");
    for kind in [ApiKind::Completions, ApiKind::ChatCompletions, ApiKind::Other] {
        let Ok(req) = ParsedRequest::parse(kind, Bytes::copy_from_slice(data), &limits) else {
            continue;
        };
        if let Ok(body) = engine_body(&req, Some(TENANT_SALT), None, None) {
            let v: serde_json::Value =
                serde_json::from_slice(&body).expect("the forwarded body parses");
            assert_eq!(v["cache_salt"], TENANT_SALT, "the tenant's salt is forwarded");
            assert_eq!(top_level_count(&body, "cache_salt"), 1, "exactly one salt");
        }
        let Some(input) = req.prompt_input() else {
            continue;
        };
        let _ = tok.tokenize(input);
    }
});
