//! The chat rendering used when a model has no chat template.

use serde_json::Value as Json;

use super::*;

pub(super) fn fallback_render(
    messages: &[Json],
    tools: Option<&Json>,
    add_generation_prompt: bool,
    limits: &TokenizeLimits,
) -> Result<String, TokenizeError> {
    let mut out = String::new();
    let push = |out: &mut String, s: &str| -> Result<(), TokenizeError> {
        check_prompt_bytes(out.len().saturating_add(s.len()), limits)?;
        out.push_str(s);
        Ok(())
    };
    let compact = |value: &Json| {
        serde_json::to_string(value).map_err(|err| TokenizeError::InvalidChat(err.to_string()))
    };
    if let Some(tools) = tools.filter(|t| !t.is_null()) {
        push(&mut out, "<|tools|>\n")?;
        push(&mut out, &compact(tools)?)?;
        push(&mut out, "\n")?;
    }
    for (index, message) in messages.iter().enumerate() {
        let role = message.get("role").and_then(Json::as_str).ok_or_else(|| {
            TokenizeError::InvalidChat(format!("message {index} has no string \"role\""))
        })?;
        push(&mut out, "<|")?;
        push(&mut out, role)?;
        push(&mut out, "|>\n")?;
        match message.get("content") {
            None | Some(Json::Null) => {}
            Some(Json::String(text)) => push(&mut out, text)?,
            Some(Json::Array(parts)) => {
                for (i, part) in parts.iter().enumerate() {
                    if i > 0 {
                        push(&mut out, "\n")?;
                    }
                    match part.get("text").and_then(Json::as_str) {
                        Some(text) if part.get("type").and_then(Json::as_str) == Some("text") => {
                            push(&mut out, text)?;
                        }
                        _ => push(&mut out, &compact(part)?)?,
                    }
                }
            }
            Some(other) => push(&mut out, &compact(other)?)?,
        }
        push(&mut out, "\n")?;
        if let Some(calls) = message.get("tool_calls").filter(|c| !c.is_null()) {
            push(&mut out, "<|tool_calls|>")?;
            push(&mut out, &compact(calls)?)?;
            push(&mut out, "\n")?;
        }
    }
    if add_generation_prompt {
        push(&mut out, "<|assistant|>\n")?;
    }
    Ok(out)
}
