//! OpenAI request bodies: the typed parse for both APIs, then the local tokenizer path
//! (character chunks and the fallback chat rendering) on whatever parsed.
#![no_main]

use bytes::Bytes;
use kvroute_picker::service::core::{ApiKind, ParsedRequest, Prompt};
use kvroute_picker::service::settings::Limits;
use kvroute_picker::tokenize::{PromptInput, PromptTokenizer, PromptTokenizerOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let tok = PromptTokenizer::new(None, None, PromptTokenizerOptions::default())
        .expect("char-chunk tokenizer");
    for kind in [ApiKind::Completions, ApiKind::ChatCompletions] {
        let Ok(req) = ParsedRequest::parse(kind, Bytes::copy_from_slice(data), &limits) else {
            continue;
        };
        let input = match (&req.prompt, &req.chat) {
            (Some(Prompt::Ids(ids)), _) => PromptInput::TokenIds(ids),
            (Some(Prompt::Text(t)), _) => PromptInput::Text(t),
            (None, Some(chat)) => PromptInput::Chat {
                messages: &chat.messages,
                tools: chat.tools.as_ref(),
                add_generation_prompt: chat.add_generation_prompt,
                extra: chat.kwargs.as_ref(),
            },
            (None, None) => continue,
        };
        let _ = tok.tokenize(input);
    }
});
