#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::python::*;
use super::template::*;
use super::*;
use serde_json::json;
use std::time::Instant;

const TOKENIZER_JSON: &[u8] = include_bytes!("../../tests/fixtures/tokenizer/tokenizer.json");
const TOKENIZER_CONFIG: &str = include_str!("../../tests/fixtures/tokenizer/tokenizer_config.json");
const LLAMA3: &str = include_str!("../../tests/fixtures/tokenizer/llama3_style.jinja");
const CHATML: &str = include_str!("../../tests/fixtures/tokenizer/chatml_style.jinja");
const CASES: &str = include_str!("../../tests/fixtures/tokenizer/chat_cases.json");

const BOS: &str = "<|begin_of_text|>";
const EOT: &str = "<|eot_id|>";

fn template(source: &str) -> ChatTemplateSource {
    ChatTemplateSource {
        source: source.to_owned(),
        bos_token: Some(BOS.to_owned()),
        eos_token: Some(EOT.to_owned()),
    }
}

fn with_template(source: &str) -> PromptTokenizer {
    PromptTokenizer::new(
        Some(TOKENIZER_JSON),
        Some(template(source)),
        PromptTokenizerOptions::default(),
    )
    .unwrap()
}

fn template_only(source: &str, limits: TokenizeLimits) -> PromptTokenizer {
    PromptTokenizer::new(
        None,
        Some(ChatTemplateSource::new(source)),
        PromptTokenizerOptions {
            limits,
            ..PromptTokenizerOptions::default()
        },
    )
    .unwrap()
}

fn chat<'a>(messages: &'a Json, add_generation_prompt: bool) -> PromptInput<'a> {
    PromptInput::Chat {
        messages,
        tools: None,
        add_generation_prompt,
        extra: None,
        add_special_tokens: false,
    }
}

#[test]
fn text_prompts_match_the_python_tokenizer() {
    // Expected ids printed by gen_tokenizer.py (Python `tokenizers`, add_special_tokens=True).
    let tok = PromptTokenizer::new(Some(TOKENIZER_JSON), None, Default::default()).unwrap();
    let cases: [(&str, &[u32]); 4] = [
        ("Hello, world!", &[0, 375, 284, 19, 228, 94, 86, 89, 328, 8]),
        (
            "The quick brown fox",
            &[0, 315, 347, 408, 287, 89, 302, 85, 228, 401, 95],
        ),
        (
            "日本語 🚀",
            &[
                0, 170, 253, 106, 170, 258, 113, 172, 111, 260, 228, 180, 261, 256, 230,
            ],
        ),
        (
            "  two  spaces\n\nnewlines",
            &[
                0, 228, 266, 94, 86, 228, 271, 87, 72, 74, 278, 206, 206, 85, 76, 94, 300, 85, 278,
            ],
        ),
    ];
    for (text, ids) in cases {
        let got = tok.tokenize(PromptInput::Text(text)).unwrap();
        assert_eq!(got.ids, ids, "{text:?}");
        assert_eq!(got.kind, TokenKind::Tokens);
        assert_eq!(got.rendered_chars, text.chars().count());
    }
    assert_eq!(tok.max_token_id(), Some(419));
}

#[test]
fn special_tokens_in_text_are_recognised() {
    let tok = PromptTokenizer::new(Some(TOKENIZER_JSON), None, Default::default()).unwrap();
    let got = tok.tokenize(PromptInput::Text("<|eot_id|>")).unwrap();
    // BOS from the post-processor, then the single special token (id 4 in SPECIAL order).
    assert_eq!(got.ids, [0, 4]);
}

#[test]
fn chat_cases_match_transformers() {
    let cases: Json = serde_json::from_str(CASES).unwrap();
    // The fixtures list tool keys in non-alphabetical order, as clients send them.
    let probe: Json = serde_json::from_str(r#"{"b": 1, "a": 2}"#).unwrap();
    assert_eq!(
        probe.as_object().unwrap().keys().next().map(String::as_str),
        Some("b"),
        "serde_json must be built with `preserve_order`, or tool schemas are re-ordered \
         and no longer render like the engine renders them"
    );
    let llama = with_template(LLAMA3);
    let chatml = with_template(CHATML);
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let tok = match case["template"].as_str().unwrap() {
            "llama3_style.jinja" => &llama,
            "chatml_style.jinja" => &chatml,
            other => panic!("unknown template {other}"),
        };
        let rendered = tok.render_chat(
            &case["messages"],
            case.get("tools"),
            case["add_generation_prompt"].as_bool().unwrap_or(false),
            case.get("extra"),
        );
        match (case.get("expected"), case.get("error")) {
            (Some(expected), _) => {
                assert_eq!(
                    rendered.as_deref().ok(),
                    expected.as_str(),
                    "case {name}: {rendered:?}"
                );
            }
            (None, Some(error)) => assert_eq!(
                rendered,
                Err(TokenizeError::TemplateRaised(
                    error.as_str().unwrap().to_owned()
                )),
                "case {name}"
            ),
            _ => panic!("case {name} has neither expected nor error"),
        }
    }
}

#[test]
fn llama3_style_renders_exactly() {
    let tok = with_template(LLAMA3);
    let messages = json!([
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
    ]);
    let extra = json!({"date_string": "26 Jul 2024"});
    let rendered = tok
        .render_chat(&messages, None, true, Some(&extra))
        .unwrap();
    assert_eq!(
        rendered,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n\
         Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n\
         Be brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    // The rendered text already holds BOS: encoding must not add a second one.
    let ids = tok.tokenize(PromptInput::Chat {
        messages: &messages,
        tools: None,
        add_generation_prompt: true,
        extra: Some(&extra),
        add_special_tokens: false,
    });
    let ids = ids.unwrap();
    assert_eq!(ids.kind, TokenKind::Tokens);
    assert_eq!(ids.ids.iter().filter(|&&id| id == 0).count(), 1);
    assert_eq!(ids.ids[0], 0);
    assert_eq!(ids.rendered_chars, rendered.chars().count());
}

#[test]
fn chatml_style_renders_exactly_with_tools() {
    let tok = with_template(CHATML);
    let messages = json!([
        {"role": "user", "content": "Time?"},
    ]);
    let tools = json!([{"type": "function", "function": {"name": "now", "parameters": {}}}]);
    let rendered = tok
        .render_chat(&messages, Some(&tools), true, None)
        .unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n\
         You may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n\
         {\"type\": \"function\", \"function\": {\"name\": \"now\", \"parameters\": {}}}\n\
         </tools>\n\n\
         For each function call, return a json object with function name and arguments within \
         <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n\
         </tool_call><|im_end|>\n\
         <|im_start|>user\nTime?<|im_end|>\n<|im_start|>assistant\n"
    );
    // `tools: null` is the same as no tools.
    let without = tok
        .render_chat(&messages, Some(&Json::Null), false, None)
        .unwrap();
    assert_eq!(
        without,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nTime?<|im_end|>\n"
    );
}

#[test]
fn chats_with_the_same_system_prompt_share_leading_ids() {
    let tok = with_template(LLAMA3);
    let extra = json!({"date_string": "26 Jul 2024"});
    let system = "You are a helpful assistant. Answer the user's questions concisely.";
    let a = json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the weather like in Paris?"},
    ]);
    let b = json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "The quick brown fox jumps"},
    ]);
    let run = |m: &Json| {
        tok.tokenize(PromptInput::Chat {
            messages: m,
            tools: None,
            add_generation_prompt: true,
            extra: Some(&extra),
            add_special_tokens: false,
        })
        .unwrap()
        .ids
    };
    let (ia, ib) = (run(&a), run(&b));
    let system_only = tok
        .render_chat(
            &json!([{"role": "system", "content": system}]),
            None,
            false,
            Some(&extra),
        )
        .unwrap();
    let system_ids = tok.tokenize(PromptInput::Text(&system_only)).unwrap().ids;
    // `system_ids` has a second BOS from add_special_tokens; skip it.
    let prefix = &system_ids[1..];
    assert!(prefix.len() > 20);
    assert_eq!(&ia[..prefix.len()], prefix);
    assert_eq!(&ib[..prefix.len()], prefix);
    assert_ne!(ia, ib);
}

#[test]
fn token_ids_pass_through_and_are_checked() {
    let tok = PromptTokenizer::new(Some(TOKENIZER_JSON), None, Default::default()).unwrap();
    let ok = tok.tokenize(PromptInput::TokenIds(&[0, 5, 419])).unwrap();
    assert_eq!(
        ok,
        TokenizedPrompt {
            ids: vec![0, 5, 419],
            kind: TokenKind::Tokens,
            rendered_chars: 0,
            cached_tokens: 0
        }
    );
    let err = tok
        .tokenize(PromptInput::TokenIds(&[0, 5, 420, 9]))
        .unwrap_err();
    assert_eq!(
        err,
        TokenizeError::TokenOutOfVocab {
            id: 420,
            index: 2,
            max_id: 419
        }
    );
    assert!(err.to_string().contains("420"), "{err}");

    // Without a tokenizer there is nothing to check against.
    let bare = PromptTokenizer::new(None, None, Default::default()).unwrap();
    let ids = bare
        .tokenize(PromptInput::TokenIds(&[7, 1_000_000]))
        .unwrap();
    assert_eq!(ids.ids, [7, 1_000_000]);
    assert_eq!(ids.kind, TokenKind::Tokens);
}

#[test]
fn char_chunk_fallback() {
    let tok = PromptTokenizer::new(
        None,
        None,
        PromptTokenizerOptions {
            char_chunk_tokens: 16,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(tok.char_chunk_tokens(), 16);
    let got = tok.tokenize(PromptInput::Text("añ🚀")).unwrap();
    assert_eq!(
        got,
        TokenizedPrompt {
            ids: vec![0x61, 0xf1, 0x1f680],
            kind: TokenKind::CharChunks,
            rendered_chars: 3,
            cached_tokens: 0
        }
    );

    // Chats without template: the documented fallback rendering.
    let messages = json!([
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "u"}},
        ]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]},
    ]);
    let tools = json!([{"name": "t"}]);
    let rendered = tok
        .render_chat(&messages, Some(&tools), true, None)
        .unwrap();
    assert_eq!(
        rendered,
        "<|tools|>\n[{\"name\":\"t\"}]\n<|system|>\nsys\n<|user|>\na\n\
         {\"image_url\":{\"url\":\"u\"},\"type\":\"image_url\"}\n\
         <|assistant|>\n\n<|tool_calls|>[{\"id\":\"1\"}]\n<|assistant|>\n"
            .replace(
                "{\"image_url\":{\"url\":\"u\"},\"type\":\"image_url\"}",
                &serde_json::to_string(&messages[1]["content"][1]).unwrap()
            )
    );
    let a = tok
        .tokenize(chat(
            &json!([{"role": "system", "content": "shared"}, {"role": "user", "content": "x"}]),
            true,
        ))
        .unwrap();
    let b = tok
        .tokenize(chat(
            &json!([{"role": "system", "content": "shared"}, {"role": "user", "content": "y"}]),
            true,
        ))
        .unwrap();
    assert_eq!(a.kind, TokenKind::CharChunks);
    assert_eq!(a.ids[..18], b.ids[..18]);
    assert_ne!(a.ids, b.ids);

    // Template without tokenizer: rendered text in char chunks.
    let tpl = template_only(
        "{% for m in messages %}{{ m.content }}|{% endfor %}",
        TokenizeLimits::default(),
    );
    let got = tpl
        .tokenize(chat(&json!([{"role": "user", "content": "ab"}]), false))
        .unwrap();
    assert_eq!(got.ids, ['a' as u32, 'b' as u32, '|' as u32]);

    assert!(matches!(
        PromptTokenizer::new(
            None,
            None,
            PromptTokenizerOptions {
                char_chunk_tokens: 0,
                ..Default::default()
            }
        ),
        Err(TokenizeError::InvalidOptions(_))
    ));
}

#[test]
fn fallback_chat_with_tokenizer_adds_bos_once() {
    let tok = PromptTokenizer::new(Some(TOKENIZER_JSON), None, Default::default()).unwrap();
    let got = tok
        .tokenize(chat(&json!([{"role": "user", "content": "Hello"}]), true))
        .unwrap();
    let text = tok
        .tokenize(PromptInput::Text("<|user|>\nHello\n<|assistant|>\n"))
        .unwrap();
    assert_eq!(got.ids, text.ids);
    assert_eq!(got.ids[0], 0);
}

#[test]
fn tokenizer_config_variants() {
    let t = ChatTemplateSource::from_tokenizer_config(TOKENIZER_CONFIG)
        .unwrap()
        .unwrap();
    assert!(t.source.starts_with("{{- bos_token }}"));
    assert_eq!(t.bos_token.as_deref(), Some(BOS));
    assert_eq!(t.eos_token.as_deref(), Some(EOT));

    let tok = PromptTokenizer::from_hf_files(
        Some(TOKENIZER_JSON),
        Some(TOKENIZER_CONFIG),
        Default::default(),
    )
    .unwrap();
    let rendered = tok
        .render_chat(
            &json!([{"role": "user", "content": " Hi "}]),
            None,
            true,
            None,
        )
        .unwrap();
    assert_eq!(
        rendered,
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );

    let plain =
        ChatTemplateSource::from_tokenizer_config(r#"{"chat_template": "x", "bos_token": null}"#)
            .unwrap()
            .unwrap();
    assert_eq!(plain, ChatTemplateSource::new("x"));
    assert_eq!(
        ChatTemplateSource::from_tokenizer_config(r#"{"bos_token": "<s>"}"#).unwrap(),
        None
    );
    assert_eq!(
        special_tokens_from_config(r#"{"bos_token": "<s>", "eos_token": {"content": "</s>"}}"#)
            .unwrap(),
        (Some("<s>".to_owned()), Some("</s>".to_owned()))
    );
    for bad in [
        "not json",
        "[1]",
        r#"{"chat_template": 5}"#,
        r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#,
        r#"{"chat_template": "x", "eos_token": {"id": 3}}"#,
        r#"{"chat_template": "x", "bos_token": 3}"#,
    ] {
        assert!(
            matches!(
                ChatTemplateSource::from_tokenizer_config(bad),
                Err(TokenizeError::TokenizerConfig(_))
            ),
            "{bad}"
        );
    }
}

#[test]
fn malformed_tokenizer_json_is_an_error() {
    for bad in [
        &b"{"[..],
        b"{}",
        b"[]",
        b"\xff\xfe",
        &TOKENIZER_JSON[..TOKENIZER_JSON.len() / 2],
    ] {
        let err = PromptTokenizer::new(Some(bad), None, Default::default()).unwrap_err();
        assert!(matches!(err, TokenizeError::TokenizerLoad(_)), "{err:?}");
    }
}

#[test]
fn malformed_templates_and_inputs_are_errors() {
    let err = PromptTokenizer::new(
        None,
        Some(ChatTemplateSource::new("{% for %}")),
        Default::default(),
    )
    .unwrap_err();
    assert!(matches!(err, TokenizeError::TemplateSyntax(_)), "{err:?}");

    let tok = with_template(CHATML);
    for (messages, extra) in [
        (json!({"role": "user"}), None),
        (json!(["hi"]), None),
        (json!([{"role": "user", "content": "x"}]), Some(json!([1]))),
    ] {
        let err = tok
            .render_chat(&messages, None, false, extra.as_ref())
            .unwrap_err();
        assert!(matches!(err, TokenizeError::InvalidChat(_)), "{err:?}");
    }
    // A template error that is not raise_exception: calling an undefined function.
    let tpl = template_only("{{ nope() }}", TokenizeLimits::default());
    let err = tpl.render_chat(&json!([]), None, false, None).unwrap_err();
    assert!(matches!(err, TokenizeError::TemplateRender(_)), "{err:?}");
    // Values nested deeper than the JSON limit, built in code.
    let mut deep = json!("x");
    for _ in 0..200 {
        deep = json!([deep]);
    }
    let err = tok
        .render_chat(
            &json!([{"role": "user", "content": deep}]),
            None,
            false,
            None,
        )
        .unwrap_err();
    assert!(matches!(err, TokenizeError::InvalidChat(_)), "{err:?}");
}

#[test]
fn input_limits_name_the_limit() {
    let limits = TokenizeLimits {
        max_prompt_bytes: 10,
        max_tokens: 3,
        max_messages: 2,
        ..Default::default()
    };
    let tok = PromptTokenizer::new(
        Some(TOKENIZER_JSON),
        Some(template(CHATML)),
        PromptTokenizerOptions {
            limits,
            ..Default::default()
        },
    )
    .unwrap();
    let err = tok.tokenize(PromptInput::Text("01234567890")).unwrap_err();
    assert_eq!(
        err,
        TokenizeError::InputLimit {
            limit: InputLimit::PromptBytes,
            actual: 11,
            max: 10
        }
    );
    assert!(err.to_string().contains("limits.maxBodyBytes"), "{err}");

    let err = tok.tokenize(PromptInput::Text("Hello, world")).unwrap_err();
    assert!(matches!(
        err,
        TokenizeError::InputLimit {
            limit: InputLimit::PromptBytes,
            ..
        }
    ));
    let err = tok.tokenize(PromptInput::Text("a b c d e")).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizeError::InputLimit {
                limit: InputLimit::Tokens,
                max: 3,
                ..
            }
        ),
        "{err:?}"
    );
    // the picker's setting, not the request's `max_tokens`
    assert!(err.to_string().contains("limits.maxPromptTokens"), "{err}");
    let err = tok
        .tokenize(PromptInput::TokenIds(&[1, 2, 3, 4]))
        .unwrap_err();
    assert_eq!(
        err,
        TokenizeError::InputLimit {
            limit: InputLimit::Tokens,
            actual: 4,
            max: 3
        }
    );

    let three = json!([
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]);
    let err = tok.tokenize(chat(&three, true)).unwrap_err();
    assert_eq!(
        err,
        TokenizeError::InputLimit {
            limit: InputLimit::Messages,
            actual: 3,
            max: 2
        }
    );
    assert!(err.to_string().contains("limits.maxMessages"), "{err}");

    let big = json!([{"role": "user", "content": "this is longer than ten bytes"}]);
    let err = tok.render_chat(&big, None, false, None).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizeError::InputLimit {
                limit: InputLimit::PromptBytes,
                ..
            }
        ),
        "{err:?}"
    );
}

/// Each hostile template must fail with the expected limit (the limit, not a clock, is
/// what bounds it; the time is printed for the record).
fn assert_limited(source: &str, limits: TokenizeLimits, expected: TemplateLimit) {
    let tok = template_only(source, limits);
    let started = Instant::now();
    let err = tok
        .render_chat(&json!([{"role": "user", "content": "x"}]), None, true, None)
        .unwrap_err();
    let elapsed = started.elapsed();
    assert!(
        matches!(&err, TokenizeError::TemplateLimit { limit, .. } if *limit == expected),
        "{source}: {err:?}"
    );
    eprintln!("{expected}: {elapsed:?} for {source}");
    assert!(err.to_string().contains(&expected.to_string()), "{err}");
}

#[test]
fn hostile_templates_hit_limits_quickly() {
    let limits = TokenizeLimits::default();
    // Python-style huge range: minijinja refuses ranges over 100k items outright.
    let tok = template_only("{% for i in range(10**9) %}x{% endfor %}", limits);
    assert!(tok.render_chat(&json!([]), None, false, None).is_err());
    // Nested loops that each stay under the range cap: fuel.
    assert_limited(
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        limits,
        TemplateLimit::Fuel,
    );
    // Unbounded recursion through a macro.
    assert_limited(
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        limits,
        TemplateLimit::Recursion,
    );
    // Huge output: cut off by the output cap before the fuel runs out.
    assert_limited(
        "{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}",
        TokenizeLimits {
            max_rendered_bytes: 1 << 20,
            ..limits
        },
        TemplateLimit::RenderedBytes,
    );
    // One giant string: refused by fuel before it is allocated.
    assert_limited("{{ 'x' * 10**12 }}", limits, TemplateLimit::Fuel);
    // Exponential growth by doubling a string in a namespace.
    assert_limited(
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}\
         {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
        limits,
        TemplateLimit::Fuel,
    );
    // Deeply nested values: tojson and printing refuse instead of overflowing the stack.
    let nest = "{% set ns = namespace(x=[]) %}\
                {% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}";
    for tail in ["{{ ns.x | tojson }}", "{{ ns.x }}", "{{ ns.x | string }}"] {
        let tok = template_only(&format!("{nest}{tail}"), limits);
        let err = tok.render_chat(&json!([]), None, false, None).unwrap_err();
        assert!(
            matches!(err, TokenizeError::TemplateRender(_)),
            "{tail}: {err:?}"
        );
    }
}

#[test]
fn tojson_indent_blowup_is_bounded() {
    // 128-deep tool schemas under `tojson(indent=...)`: every line repeats the indent per
    // level, so the output is far larger than the request. It must stop at a limit.
    let mut deep = json!(1);
    for _ in 0..100 {
        deep = json!([deep]);
    }
    for _ in 0..12 {
        deep = json!([deep, deep.clone()]);
    }
    // About 0.8 MB of request; about 3 GB once indented.
    assert!(deep.to_string().len() < 1 << 20);
    let tools = json!([deep]);
    let messages = json!([{"role": "user", "content": "x"}]);
    for (fuel, max_rendered_bytes, expected) in [
        (u64::MAX / 128, 4 << 20, TemplateLimit::RenderedBytes),
        (
            TokenizeLimits::default().template_fuel,
            1 << 30,
            TemplateLimit::Fuel,
        ),
    ] {
        let limits = TokenizeLimits {
            template_fuel: fuel,
            max_rendered_bytes,
            ..Default::default()
        };
        let tok = template_only("{{ tools | tojson(indent=40) | length }}", limits);
        let err = tok
            .render_chat(&messages, Some(&tools), false, None)
            .unwrap_err();
        assert!(
            matches!(&err, TokenizeError::TemplateLimit { limit, .. } if *limit == expected),
            "{err:?}"
        );
    }
}

#[test]
fn python_isms() {
    let tok = template_only(
        "{{ none }}|{{ true }}|{{ [1, 'a', none, 1.5, {'k': false}] }}|{{ 1e20 }}|\
         {{ 0.1 + 0.2 }}|\
         {{ ' a '.strip() }}|{{ 'a,b'.split(',') }}|{{ {'x': 1}.keys() | list }}|\
         {{ 'abc'.startswith('ab') }}|{{ \"it's\" ~ '' }}|{{ [\"it's\"] }}|\
         {{ {'a': 1}.get('b', 2) }}|\
         {{ {'é': 'ü', 'n': [1.0, 2], 't': true} | tojson }}|\
         {{ 'é' | tojson(ensure_ascii=true) }}|\
         {{ {'b': 1, 'a': [] } | tojson(sort_keys=true, separators=(',', ':')) }}|\
         {{ [1] | tojson(indent=2) }}|{{ dict(a=1) | tojson }}|{{ [none, 'x'] | string }}|\
         {{ 2 | string }}|{{ undefined_name | string }}",
        TokenizeLimits::default(),
    );
    let got = tok.render_chat(&json!([]), None, false, None).unwrap();
    assert_eq!(
        got,
        "None|True|[1, 'a', None, 1.5, {'k': False}]|1e+20|0.30000000000000004|\
         a|['a', 'b']|['x']|True|it's|[\"it's\"]|2|\
         {\"é\": \"ü\", \"n\": [1.0, 2], \"t\": true}|\"\\u00e9\"|\
         {\"a\":[],\"b\":1}|[\n  1\n]|{\"a\": 1}|[None, 'x']|2|"
    );
}

#[test]
fn context_precedence() {
    let tok = with_template(
        "{{ bos_token }}|{{ eos_token }}|{{ documents is none }}|{{ add_generation_prompt }}|\
         {{ tools is none }}|{{ messages | length }}",
    );
    let messages = json!([{"role": "user", "content": "x"}]);
    let plain = tok.render_chat(&messages, None, true, None).unwrap();
    assert_eq!(plain, "<|begin_of_text|>|<|eot_id|>|True|True|True|1");
    let extra =
        json!({"bos_token": "B", "documents": [], "add_generation_prompt": 0, "messages": []});
    let overridden = tok
        .render_chat(&messages, None, true, Some(&extra))
        .unwrap();
    assert_eq!(overridden, "B|<|eot_id|>|False|True|True|1");
}

#[test]
fn generation_tags_and_loop_controls() {
    let src = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\
               {%- generation -%} {{ m.content }} {%- endgeneration %}{% endfor %}";
    let tok = template_only(src, TokenizeLimits::default());
    let got = tok
        .render_chat(
            &json!([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]),
            None,
            false,
            None,
        )
        .unwrap();
    assert_eq!(got, "a");
    assert_eq!(
        rewrite_generation_tags("{{ generation }}"),
        "{{ generation }}"
    );
    assert_eq!(
        rewrite_generation_tags("{% generation_x %}"),
        "{% generation_x %}"
    );
    assert_eq!(
        rewrite_generation_tags("{%+ generation+%}x{% endgeneration %}"),
        "{%+ if true+%}x{% endif %}"
    );
}

#[test]
fn strftime_matches_python() {
    // 2024-07-26 13:25:09 UTC, a Friday; values from Python's time.strftime.
    let t = 1_722_000_309;
    assert_eq!(format_strftime("%d %b %Y", t), "26 Jul 2024");
    assert_eq!(
        format_strftime("%A %B %-d, %y %H:%M:%S %p %I %j %e", t),
        "Friday July 26, 24 13:25:09 PM 01 208 26"
    );
    assert_eq!(
        format_strftime("%F %T %D %% %q %", t),
        "2024-07-26 13:25:09 07/26/24 % %q %"
    );
    assert_eq!(format_strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
    assert_eq!(
        format_strftime("%Y-%m-%d %j", 951_782_400),
        "2000-02-29 060"
    );
    let tok = template_only(
        "{{ strftime_now('%Y') | length }}",
        TokenizeLimits::default(),
    );
    assert_eq!(tok.render_chat(&json!([]), None, false, None).unwrap(), "4");
}

#[test]
fn python_float_repr() {
    let cases = [
        (1.0, "1.0"),
        (0.1, "0.1"),
        (-2.5, "-2.5"),
        (1e16, "1e+16"),
        (1e15, "1000000000000000.0"),
        (123_456_789.125, "123456789.125"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (1.5e-7, "1.5e-07"),
        (1e100, "1e+100"),
        (-0.0, "-0.0"),
        (f64::NAN, "nan"),
        (f64::NEG_INFINITY, "-inf"),
    ];
    for (f, want) in cases {
        let mut s = String::new();
        push_python_float(&mut s, f, "nan", "inf");
        assert_eq!(s, want, "{f}");
    }
}

#[test]
fn prompt_tokenizer_is_shareable() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<PromptTokenizer>();
}

/// Regression (hardening review): before renders ran on their own stack, this template
/// overflowed the stack of the calling thread and aborted the process.
#[test]
fn a_template_nesting_values_as_deep_as_fuel_allows_does_not_overflow() {
    let source = "{% set ns = namespace(x=none) %}{% for i in range(100000) %}{% for j in range(100) %}{% set ns.x = [ns.x] %}{% endfor %}{% endfor %}{{ ns.x }}";
    let tok = PromptTokenizer::new(
        None,
        Some(ChatTemplateSource {
            source: source.into(),
            bos_token: None,
            eos_token: None,
        }),
        PromptTokenizerOptions::default(),
    )
    .expect("compiles");
    let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
    let r = tok.render_chat(&messages, None, true, None);
    assert!(
        matches!(r, Err(TokenizeError::TemplateLimit { .. })),
        "{r:?}"
    );
    // the same with the output printed before fuel runs out
    let shallow = source.replace("range(100000)", "range(50)");
    let tok = PromptTokenizer::new(
        None,
        Some(ChatTemplateSource {
            source: shallow,
            bos_token: None,
            eos_token: None,
        }),
        PromptTokenizerOptions::default(),
    )
    .expect("compiles");
    let _ = tok.render_chat(&messages, None, true, None);
}

/// A text far over the token limit is refused after counting a little past the limit, not
/// after encoding it whole (which cost 3.3 GB for a 14 MiB prompt); with the piece cache on
/// and off, as a completion and as a chat.
#[test]
fn a_text_far_over_the_token_limit_is_refused_after_counting_past_the_limit() {
    let words = "route the cache of alpha beta gamma to the engine\n".repeat(20_000);
    let whole = tokenizers::Tokenizer::from_bytes(TOKENIZER_JSON)
        .unwrap()
        .encode_fast(words.as_str(), false)
        .unwrap()
        .len();
    let max_tokens = 2_000;
    for piece_cache_tokens in [0, 1 << 20] {
        let tok = PromptTokenizer::new(
            Some(TOKENIZER_JSON),
            Some(template(CHATML)),
            PromptTokenizerOptions {
                limits: TokenizeLimits {
                    max_tokens,
                    ..Default::default()
                },
                piece_cache_tokens,
                ..Default::default()
            },
        )
        .unwrap();
        let chat_messages = json!([{"role": "user", "content": words}]);
        for input in [PromptInput::Text(&words), chat(&chat_messages, true)] {
            match tok.tokenize(input).unwrap_err() {
                TokenizeError::InputLimit {
                    limit: InputLimit::Tokens,
                    actual,
                    max,
                } => {
                    assert_eq!(max, max_tokens);
                    assert!(actual > max_tokens);
                    assert!(
                        actual < whole / 10,
                        "counted {actual} of the text's {whole} tokens"
                    );
                }
                other => panic!("expected the token limit, got {other:?}"),
            }
        }
    }
}

#[test]
fn templates_that_need_the_system_message_first_are_told_apart() {
    let strict = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}\
                  {{ raise_exception('System message must be at the beginning.') }}{% endif %}\
                  <{{ m.role }}>{{ m.content }}{% endfor %}";
    let lenient = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
    assert!(template_only(strict, TokenizeLimits::default()).requires_system_first());
    assert!(!template_only(lenient, TokenizeLimits::default()).requires_system_first());
    let none = PromptTokenizer::new(None, None, PromptTokenizerOptions::default()).expect("tok");
    assert!(
        none.requires_system_first(),
        "vLLM merges without a template"
    );
}
