//! OpenAI Responses and Anthropic Messages bodies as the chat the engine renders for them.
//!
//! vLLM serves `/v1/responses` and `/v1/messages` by turning the request into chat messages and
//! rendering those with the model's chat template, the template chat completions use. The
//! picker maps them the same way (vLLM 0.32's `construct_input_messages` and the Messages
//! server's `to_chat_completion_request`), so a conversation gets the same token ids, and so
//! the same prefix credit, whichever of the three APIs carries it.
//!
//! What is not reproduced, and so routes by model and load (no prefix credit) rather than
//! with keys that might not match: Responses items other than messages, function calls and
//! their outputs and reasoning (`custom_tool_call`, built-in tool calls, item references,
//! namespaced function calls, encrypted reasoning), and Messages tool changes within the
//! conversation (`tool_addition`, `tool_removal`), content blocks of unknown types and
//! `tool_use` blocks without an id. As for chat completions, vLLM's own request models add
//! `null` fields to tools the template may print, and `thinking`/`output_config.effort` (a
//! template's `reasoning_effort`) are not passed to the template.

use serde_json::{Map, Value, json};

/// Why a body cannot be mapped to a chat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unmapped {
    /// The body is malformed where the engine would refuse it too: a 400 naming the field.
    Invalid(String),
    /// Valid, but its rendering is not reproduced: route it without prefix credit.
    NotReproduced(&'static str),
}

fn invalid(m: impl Into<String>) -> Unmapped {
    Unmapped::Invalid(m.into())
}

/// The chat messages of a Responses request: `instructions` as the system message, then the
/// `input` (a string is one user message; items map one by one, a function call or reasoning
/// joining the assistant message before it). The input's text moves into the messages, not
/// copied: a long conversation costs what chat completions' parse does.
pub fn responses_messages(
    instructions: Option<&Value>,
    input: Value,
) -> Result<Vec<Value>, Unmapped> {
    let mut messages: Vec<Value> = Vec::new();
    match instructions {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            if !s.is_empty() {
                messages.push(json!({"role": "system", "content": s}));
            }
        }
        Some(_) => return Err(invalid("`instructions` must be a string")),
    }
    match input {
        Value::String(s) => messages.push(json!({"role": "user", "content": s})),
        Value::Array(items) => {
            messages.reserve(items.len());
            for (i, item) in items.into_iter().enumerate() {
                if let Some(m) = responses_item(i, item, &mut messages)? {
                    messages.push(m);
                }
            }
        }
        _ => return Err(invalid("`input` must be a string or an array of items")),
    }
    Ok(messages)
}

/// The assistant message `messages` ends with, if it does.
fn last_assistant(messages: &mut [Value]) -> Option<&mut Map<String, Value>> {
    messages
        .last_mut()
        .and_then(Value::as_object_mut)
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
}

/// Whether `m` has `key` set to something other than `null`.
fn has(m: &Map<String, Value>, key: &str) -> bool {
    m.get(key).is_some_and(|v| !v.is_null())
}

/// The text of the first part of `content` (a string, or parts), moved out.
fn first_text(content: Option<Value>) -> Option<Value> {
    match content? {
        s @ Value::String(_) => Some(s),
        Value::Array(parts) => match parts.into_iter().next()? {
            Value::Object(mut p) => p.remove("text").filter(Value::is_string),
            _ => None,
        },
        _ => None,
    }
}

/// One Responses input item: a new message, or `None` when it joined the previous one.
fn responses_item(
    i: usize,
    item: Value,
    messages: &mut [Value],
) -> Result<Option<Value>, Unmapped> {
    let Value::Object(mut obj) = item else {
        return Err(invalid(format!("`input[{i}]` must be an object")));
    };
    let kind = obj.get("type").and_then(Value::as_str).map(str::to_owned);
    let role = obj.get("role").and_then(Value::as_str).map(str::to_owned);
    let present = |obj: &Map<String, Value>, k: &str| obj.get(k).is_some_and(|v| !v.is_null());
    match kind.as_deref() {
        Some("function_call") => {
            if present(&obj, "namespace") {
                return Err(Unmapped::NotReproduced("namespaced function call"));
            }
            let text_field = |k: &str| -> Result<&str, Unmapped> {
                obj.get(k)
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("`input[{i}].{k}` must be a string")))
            };
            let call = json!({
                "id": text_field("call_id")?,
                "function": {"name": text_field("name")?, "arguments": text_field("arguments")?},
                "type": "function",
            });
            if let Some(prev) = last_assistant(messages) {
                match prev.get_mut("tool_calls") {
                    None | Some(Value::Null) => {
                        prev.insert("tool_calls".into(), Value::Array(vec![call]));
                        return Ok(None);
                    }
                    Some(Value::Array(calls)) => {
                        calls.push(call);
                        return Ok(None);
                    }
                    Some(_) => {}
                }
            }
            Ok(Some(json!({"role": "assistant", "tool_calls": [call]})))
        }
        Some("reasoning") => {
            if present(&obj, "encrypted_content") {
                return Err(Unmapped::NotReproduced("encrypted reasoning"));
            }
            let content = obj
                .remove("content")
                .filter(|c| c.as_array().is_some_and(|a| !a.is_empty()));
            let reasoning = first_text(content)
                .or_else(|| first_text(obj.remove("summary")))
                .unwrap_or_else(|| Value::from(""));
            if let Some(prev) = last_assistant(messages)
                && !has(prev, "reasoning")
            {
                prev.insert("reasoning".into(), reasoning);
                return Ok(None);
            }
            Ok(Some(json!({"role": "assistant", "reasoning": reasoning})))
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            let mut m = Map::new();
            m.insert("role".into(), Value::from("tool"));
            m.insert(
                "content".into(),
                obj.remove("output").unwrap_or(Value::Null),
            );
            m.insert(
                "tool_call_id".into(),
                obj.remove("call_id").unwrap_or(Value::Null),
            );
            Ok(Some(Value::Object(m)))
        }
        _ if role.as_deref() == Some("assistant") => {
            let Some(text) = first_text(obj.remove("content").filter(|c| !c.is_null())) else {
                return Err(Unmapped::NotReproduced("assistant item without text"));
            };
            if let Some(prev) = last_assistant(messages)
                && !has(prev, "content")
            {
                prev.insert("content".into(), text);
                return Ok(None);
            }
            Ok(Some(json!({"role": "assistant", "content": text})))
        }
        None | Some("message") if role.is_some() => {
            let mut m = Map::new();
            m.insert("role".into(), Value::from(role.unwrap_or_default()));
            m.insert(
                "content".into(),
                match obj.remove("content") {
                    Some(Value::Array(parts)) => {
                        Value::Array(parts.into_iter().map(responses_part).collect())
                    }
                    Some(other) => other,
                    None => Value::Null,
                },
            );
            Ok(Some(Value::Object(m)))
        }
        None => Err(invalid(format!(
            "`input[{i}]` has neither a `role` nor a `type`"
        ))),
        Some(_) => Err(Unmapped::NotReproduced("input item type")),
    }
}

/// A content part of a Responses message as vLLM's chat parser reads it: `input_text` and
/// `output_text` are text parts.
fn responses_part(part: Value) -> Value {
    match part {
        Value::Object(mut p)
            if matches!(
                p.get("type").and_then(Value::as_str),
                Some("input_text" | "output_text")
            ) =>
        {
            let text = p.remove("text").unwrap_or(Value::Null);
            json!({"type": "text", "text": text})
        }
        other => other,
    }
}

/// The chat tools of a Responses request: its function tools (flat
/// `{"type": "function", "name": ...}`) in chat completions' shape; `None` without tools.
pub fn responses_tools(tools: Option<&Value>) -> Result<Option<Value>, Unmapped> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(list)) if list.is_empty() => return Ok(None),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(invalid("`tools` must be an array")),
    };
    let mut out = Vec::new();
    for tool in list {
        let Some(obj) = tool.as_object() else {
            return Err(invalid("`tools` entries must be objects"));
        };
        match obj.get("type").and_then(Value::as_str) {
            Some("function") => {
                let function: Map<String, Value> = obj
                    .iter()
                    .filter(|(k, _)| *k != "type")
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                out.push(json!({"type": "function", "function": function}));
            }
            Some("namespace") => return Err(Unmapped::NotReproduced("namespaced tools")),
            _ => {}
        }
    }
    Ok(Some(Value::Array(out)))
}

/// The chat messages of a Messages request: `system` (a string, or text blocks joined) as the
/// system message, then each message with its content blocks mapped, `tool_result` blocks of a
/// user turn becoming `tool` messages of their own. Inline system messages stay where they
/// are; [`merge_inline_system`] moves them for templates that need the system message first.
pub fn anthropic_messages(
    system: Option<&Value>,
    messages: &Value,
) -> Result<Vec<Value>, Unmapped> {
    let mut out: Vec<Value> = Vec::new();
    let mut system_parts: Vec<&str> = Vec::new();
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => system_parts.push(s),
        Some(Value::Array(blocks)) => {
            for b in blocks {
                if let Some(text) = system_block_text(b)? {
                    system_parts.push(text);
                }
            }
        }
        Some(_) => {
            return Err(invalid(
                "`system` must be a string or an array of text blocks",
            ));
        }
    }
    if system_parts.iter().any(|s| !s.is_empty()) {
        out.push(json!({"role": "system", "content": system_parts.concat()}));
    }
    let Value::Array(list) = messages else {
        return Err(invalid("`messages` must be an array"));
    };
    if list.is_empty() {
        return Err(invalid("`messages` must not be empty"));
    }
    for (i, msg) in list.iter().enumerate() {
        let Some(role) = msg.get("role").and_then(Value::as_str) else {
            return Err(invalid(format!("`messages[{i}].role` must be a string")));
        };
        let content = msg.get("content").unwrap_or(&Value::Null);
        if role == "system" {
            let text = match content {
                Value::String(s) => (!s.starts_with(BILLING_HEADER)).then(|| s.clone()),
                Value::Array(blocks) => {
                    let mut parts = Vec::new();
                    for b in blocks {
                        if let Some(t) = system_block_text(b)? {
                            parts.push(t);
                        }
                    }
                    Some(parts.concat())
                }
                _ => {
                    return Err(invalid(format!(
                        "`messages[{i}].content` must be a string or an array of blocks"
                    )));
                }
            };
            if let Some(text) = text.filter(|t| !t.is_empty()) {
                out.push(json!({"role": "system", "content": text}));
            }
            continue;
        }
        let mut m = Map::new();
        m.insert("role".into(), Value::from(role));
        match content {
            Value::String(s) => {
                m.insert("content".into(), Value::from(s.as_str()));
            }
            Value::Array(blocks) => anthropic_blocks(i, role, blocks, &mut m, &mut out)?,
            _ => {
                return Err(invalid(format!(
                    "`messages[{i}].content` must be a string or an array of blocks"
                )));
            }
        }
        if role != "user" || m.contains_key("content") {
            out.push(Value::Object(m));
        }
    }
    Ok(out)
}

/// Claude Code's per-request attribution header, which vLLM strips from system text.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The text of a system block: `Some` for a non-empty text block that is not the billing
/// header.
fn system_block_text(b: &Value) -> Result<Option<&str>, Unmapped> {
    if !b.is_object() {
        return Err(invalid("system blocks must be objects"));
    }
    Ok(
        match (
            b.get("type").and_then(Value::as_str),
            b.get("text").and_then(Value::as_str),
        ) {
            (Some("text"), Some(t)) if !t.is_empty() && !t.starts_with(BILLING_HEADER) => Some(t),
            _ => None,
        },
    )
}

/// The content blocks of message `i` into `m` (content parts, tool calls, reasoning); a user
/// turn's tool results go to `out` as messages of their own, before `m`.
fn anthropic_blocks(
    i: usize,
    role: &str,
    blocks: &[Value],
    m: &mut Map<String, Value>,
    out: &mut Vec<Value>,
) -> Result<(), Unmapped> {
    let mut parts: Vec<Value> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut reasoning: Vec<&str> = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let Some(kind) = b.get("type").and_then(Value::as_str) else {
            return Err(invalid(format!(
                "`messages[{i}].content[{j}].type` must be a string"
            )));
        };
        let field = |k: &str| b.get(k).filter(|v| !v.is_null());
        match kind {
            "text" => {
                if let Some(t) = field("text")
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
                {
                    parts.push(json!({"type": "text", "text": t}));
                }
            }
            "image" => {
                if let Some(source) = field("source") {
                    parts.push(
                        json!({"type": "image_url", "image_url": {"url": image_url(source)}}),
                    );
                }
            }
            "thinking" => {
                if let Some(t) = field("thinking").and_then(Value::as_str) {
                    reasoning.push(t);
                }
            }
            "redacted_thinking" | "tool_reference" => {}
            "tool_use" => {
                let Some(id) = field("id")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                else {
                    // vLLM names such a call after the clock
                    return Err(Unmapped::NotReproduced("tool_use without an id"));
                };
                let arguments = match field("input") {
                    Some(v) => python_json_dumps(v),
                    None => "{}".to_owned(),
                };
                calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {
                        "name": field("name").and_then(Value::as_str).unwrap_or_default(),
                        "arguments": arguments,
                    },
                }));
            }
            "tool_result" if role == "user" => user_tool_result(b, out),
            "tool_result" => match field("content") {
                None => parts.push(json!({"type": "text", "text": "Tool result: "})),
                Some(Value::String(s)) => {
                    parts.push(json!({"type": "text", "text": format!("Tool result: {s}")}));
                }
                // Python's repr of a list
                Some(_) => return Err(Unmapped::NotReproduced("assistant tool_result blocks")),
            },
            "tool_addition" | "tool_removal" => {
                return Err(Unmapped::NotReproduced("tool changes within messages"));
            }
            _ => return Err(Unmapped::NotReproduced("content block type")),
        }
    }
    if !reasoning.is_empty() {
        m.insert("reasoning".into(), Value::from(reasoning.concat()));
    }
    if !calls.is_empty() {
        m.insert("tool_calls".into(), Value::Array(calls));
    }
    if parts.len() == 1 && parts[0].get("type").and_then(Value::as_str) == Some("text") {
        let text = parts.swap_remove(0)["text"].take();
        m.insert("content".into(), text);
    } else if !parts.is_empty() {
        m.insert("content".into(), Value::Array(parts));
    }
    Ok(())
}

/// A user turn's `tool_result` block as a `tool` message (text blocks joined by `\n`), then its
/// images as a user message and its tool references as another `tool` message.
fn user_tool_result(b: &Value, out: &mut Vec<Value>) {
    let id = b
        .get("tool_use_id")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let mut text = String::new();
    let mut images = Vec::new();
    let mut references = Vec::new();
    match b.get("content") {
        Some(Value::String(s)) => text.clone_from(s),
        Some(Value::Array(items)) => {
            let mut texts = Vec::new();
            for item in items.iter().filter(|x| x.is_object()) {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        texts.push(item.get("text").and_then(Value::as_str).unwrap_or_default());
                    }
                    Some("image") => {
                        let url = image_url(item.get("source").unwrap_or(&Value::Null));
                        if !url.is_empty() {
                            images.push(json!({"type": "image_url", "image_url": {"url": url}}));
                        }
                    }
                    Some("tool_reference") => {
                        if let Some(name) = ["tool_name", "name"].iter().find_map(|k| {
                            item.get(*k)
                                .and_then(Value::as_str)
                                .filter(|s| !s.is_empty())
                        }) {
                            references.push(json!({"type": "tool_reference", "name": name}));
                        }
                    }
                    _ => {}
                }
            }
            text = texts.join("\n");
        }
        _ => {}
    }
    out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    if !images.is_empty() {
        out.push(json!({"role": "user", "content": images}));
    }
    if !references.is_empty() {
        out.push(json!({"role": "tool", "tool_call_id": id, "content": references}));
    }
}

/// An Anthropic image source as the URL vLLM gives the chat parser.
fn image_url(source: &Value) -> String {
    let get = |k: &str| source.get(k).and_then(Value::as_str);
    if get("type") == Some("url") {
        return get("url").unwrap_or_default().to_owned();
    }
    format!(
        "data:{};base64,{}",
        get("media_type").unwrap_or("image/jpeg"),
        get("data").unwrap_or_default()
    )
}

/// The chat tools of a Messages request (`name`, `description`, `input_schema` as the
/// function's `parameters`, `strict`); `None` without tools.
pub fn anthropic_tools(tools: Option<&Value>) -> Result<Option<Value>, Unmapped> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(invalid("`tools` must be an array")),
    };
    let mut out = Vec::with_capacity(list.len());
    for tool in list {
        let Some(obj) = tool.as_object() else {
            return Err(invalid("`tools` entries must be objects"));
        };
        let mut function = Map::new();
        for (from, to) in [
            ("name", "name"),
            ("description", "description"),
            ("input_schema", "parameters"),
            ("strict", "strict"),
        ] {
            if let Some(v) = obj.get(from).filter(|v| !v.is_null()) {
                function.insert(to.into(), v.clone());
            }
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Some(Value::Array(out)))
}

/// The messages with every system message merged, in order and joined without a separator,
/// into one leading system message: what vLLM renders for a Messages request when the chat
/// template refuses system messages after the first (vLLM probes the template with
/// `[system, user, system, user]`).
pub fn merge_inline_system(messages: &[Value]) -> Vec<Value> {
    let is_system = |m: &&Value| m.get("role").and_then(Value::as_str) == Some("system");
    let system: String = messages
        .iter()
        .filter(is_system)
        .filter_map(|m| m.get("content").and_then(Value::as_str))
        .collect();
    let rest = messages.iter().filter(|m| !is_system(m)).cloned();
    if system.is_empty() {
        rest.collect()
    } else {
        std::iter::once(json!({"role": "system", "content": system}))
            .chain(rest)
            .collect()
    }
}

/// Python's `json.dumps(v)`: `, ` and `: ` separators, non-ASCII escaped as `\uXXXX`, keys in
/// their order, floats as Python prints them.
pub fn python_json_dumps(v: &Value) -> String {
    let mut out = String::new();
    write_python_json(&mut out, v);
    out
}

fn write_python_json(out: &mut String, v: &Value) {
    use std::fmt::Write as _;
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => {
                let _ = write!(out, "{i}");
            }
            (None, Some(u), _) => {
                let _ = write!(out, "{u}");
            }
            (None, None, Some(f)) => {
                crate::tokenize::push_python_float(out, f, "NaN", "Infinity");
            }
            _ => out.push_str("null"),
        },
        Value::String(s) => crate::tokenize::write_python_json_str(out, s, true),
        Value::Array(items) => {
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push_str(", ");
                }
                write_python_json(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (k, (key, item)) in map.iter().enumerate() {
                if k > 0 {
                    out.push_str(", ");
                }
                crate::tokenize::write_python_json_str(out, key, true);
                out.push_str(": ");
                write_python_json(out, item);
            }
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_responses_conversation_maps_like_vllm() {
        let input = json!([
            {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
            {"type": "reasoning", "id": "r1", "summary": [], "content": [{"type": "reasoning_text", "text": "add"}]},
            {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{\"x\": 2}"},
            {"type": "function_call", "call_id": "c2", "name": "calc", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "4"},
            {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
             "content": [{"type": "output_text", "text": "It is 4.", "annotations": []}]},
            {"type": "message", "role": "user", "content": "Thanks"}
        ]);
        let got = responses_messages(Some(&json!("Be brief.")), input).expect("maps");
        assert_eq!(
            Value::Array(got),
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
                {"role": "assistant", "reasoning": "add", "tool_calls": [
                    {"id": "c1", "function": {"name": "calc", "arguments": "{\"x\": 2}"}, "type": "function"},
                    {"id": "c2", "function": {"name": "calc", "arguments": "{}"}, "type": "function"}
                ]},
                {"role": "tool", "content": "4", "tool_call_id": "c1"},
                {"role": "assistant", "content": "It is 4."},
                {"role": "user", "content": "Thanks"}
            ])
        );
        // a string input is one user message, and empty instructions add nothing
        assert_eq!(
            responses_messages(Some(&json!("")), json!("hi")).expect("maps"),
            vec![json!({"role": "user", "content": "hi"})]
        );
    }

    #[test]
    fn responses_items_it_cannot_reproduce_or_the_engine_refuses_are_told_apart() {
        for (input, want) in [
            (
                json!([{"type": "web_search_call", "id": "w"}]),
                Unmapped::NotReproduced("input item type"),
            ),
            (
                json!([{"type": "reasoning", "encrypted_content": "x", "summary": []}]),
                Unmapped::NotReproduced("encrypted reasoning"),
            ),
        ] {
            assert_eq!(responses_messages(None, input).expect_err("unmapped"), want);
        }
        for input in [
            json!(7),
            json!([3]),
            json!([{"content": "x"}]),
            json!([{"type": "function_call", "name": "f"}]),
        ] {
            assert!(
                matches!(
                    responses_messages(None, input.clone()),
                    Err(Unmapped::Invalid(_))
                ),
                "{input}"
            );
        }
        assert!(matches!(
            responses_messages(Some(&json!(1)), json!("x")),
            Err(Unmapped::Invalid(m)) if m.contains("instructions")
        ));
    }

    #[test]
    fn responses_tools_take_the_chat_shape() {
        let tools = json!([
            {"type": "function", "name": "calc", "description": "adds", "parameters": {"type": "object"}},
            {"type": "web_search"}
        ]);
        assert_eq!(
            responses_tools(Some(&tools)).expect("maps"),
            Some(
                json!([{"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {"type": "object"}}}])
            )
        );
        assert_eq!(responses_tools(Some(&json!([]))).expect("maps"), None);
    }

    #[test]
    fn an_anthropic_conversation_maps_like_vllm() {
        let system = json!([
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
            {"type": "text", "text": "You are "},
            {"type": "text", "text": "terse."}
        ]);
        let messages = json!([
            {"role": "user", "content": "List files"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use ls", "signature": "s"},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "ls -l", "why": "café"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]},
            {"role": "system", "content": "Reminder"},
            {"role": "user", "content": [{"type": "text", "text": "Now?"}, {"type": "text", "text": ""}]}
        ]);
        let got = anthropic_messages(Some(&system), &messages).expect("maps");
        assert_eq!(
            Value::Array(got.clone()),
            json!([
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "List files"},
                {"role": "assistant", "reasoning": "use ls", "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "bash", "arguments": "{\"cmd\": \"ls -l\", \"why\": \"caf\\u00e9\"}"}}
                ], "content": "Listing."},
                {"role": "tool", "tool_call_id": "t1", "content": "a\nb"},
                {"role": "system", "content": "Reminder"},
                {"role": "user", "content": "Now?"}
            ])
        );
        assert_eq!(
            Value::Array(merge_inline_system(&got)),
            json!([
                {"role": "system", "content": "You are terse.Reminder"},
                {"role": "user", "content": "List files"},
                {"role": "assistant", "reasoning": "use ls", "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "bash", "arguments": "{\"cmd\": \"ls -l\", \"why\": \"caf\\u00e9\"}"}}
                ], "content": "Listing."},
                {"role": "tool", "tool_call_id": "t1", "content": "a\nb"},
                {"role": "user", "content": "Now?"}
            ])
        );
        assert_eq!(
            anthropic_messages(
                Some(&json!("sys")),
                &json!([{"role": "user", "content": "hi"}])
            )
            .expect("maps"),
            vec![
                json!({"role": "system", "content": "sys"}),
                json!({"role": "user", "content": "hi"})
            ]
        );
    }

    #[test]
    fn anthropic_bodies_it_cannot_reproduce_or_the_engine_refuses_are_told_apart() {
        let blocks = |b: Value| json!([{"role": "assistant", "content": [b]}]);
        for b in [
            json!({"type": "tool_use", "name": "f", "input": {}}),
            json!({"type": "server_tool_use", "id": "x"}),
            json!({"type": "tool_addition", "tool": {"name": "f"}}),
        ] {
            assert!(
                matches!(
                    anthropic_messages(None, &blocks(b.clone())),
                    Err(Unmapped::NotReproduced(_))
                ),
                "{b}"
            );
        }
        for (system, messages) in [
            (json!(null), json!([])),
            (json!(null), json!("hi")),
            (json!(5), json!([{"role": "user", "content": "x"}])),
            (json!(null), json!([{"content": "x"}])),
            (json!(null), json!([{"role": "user", "content": 5}])),
        ] {
            assert!(
                matches!(
                    anthropic_messages(Some(&system), &messages),
                    Err(Unmapped::Invalid(_))
                ),
                "{system} {messages}"
            );
        }
    }

    #[test]
    fn anthropic_tools_take_the_chat_shape() {
        let tools =
            json!([{"name": "bash", "description": "runs", "input_schema": {"type": "object"}}]);
        assert_eq!(
            anthropic_tools(Some(&tools)).expect("maps"),
            Some(
                json!([{"type": "function", "function": {"name": "bash", "description": "runs", "parameters": {"type": "object"}}}])
            )
        );
    }

    #[test]
    fn json_dumps_matches_python() {
        let v: Value =
            serde_json::from_str(r#"{"b": [1, 2.5, 1e20, true, null], "a": "é\u0001\"😀"}"#)
                .expect("json");
        assert_eq!(
            python_json_dumps(&v),
            r#"{"b": [1, 2.5, 1e+20, true, null], "a": "\u00e9\u0001\"\ud83d\ude00"}"#
        );
    }
}
