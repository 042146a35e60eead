//! The tokenizer + chat template path: a template (hostile, from a ConfigMap) and messages
//! (hostile, from a request), rendered with the picker's limits and tokenized with a real
//! tokenizer. Input: template source, a NUL byte, then the request's `messages` JSON.
#![no_main]

use kvroute_routing::tokenize::{
    ChatTemplateSource, PromptInput, PromptTokenizer, PromptTokenizerOptions,
};
use libfuzzer_sys::fuzz_target;

const TOKENIZER_JSON: &[u8] =
    include_bytes!("../../routing/tests/fixtures/tokenizer/tokenizer.json");

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (template, messages) = text.split_once('\0').unwrap_or((text, "[]"));
    let Ok(messages) = serde_json::from_str::<serde_json::Value>(messages) else {
        return;
    };
    let source = ChatTemplateSource {
        source: template.to_owned(),
        bos_token: Some("<s>".into()),
        eos_token: Some("</s>".into()),
    };
    let Ok(tok) = PromptTokenizer::new(
        Some(TOKENIZER_JSON),
        Some(source),
        PromptTokenizerOptions::default(),
    ) else {
        return;
    };
    let _ = tok.tokenize(PromptInput::Chat {
        messages: &messages,
        tools: None,
        add_generation_prompt: true,
        extra: None,
        add_special_tokens: false,
    });
});
