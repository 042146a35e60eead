//! Chat templates: compiling a model's Jinja template as Hugging Face `transformers` does, and
//! rendering it within byte, depth and stack budgets.

use std::borrow::Cow;
use std::fmt;
use std::io;

use minijinja::value::Kwargs;
use minijinja::{AutoEscape, Environment, ErrorKind, State, Value};
use serde_json::Value as Json;

use super::python::*;
use super::*;

pub(super) fn compile_template(
    template: ChatTemplateSource,
    limits: &TokenizeLimits,
) -> Result<CompiledTemplate, TokenizeError> {
    let mut env = Environment::new();
    // transformers compiles templates with `trim_blocks=True, lstrip_blocks=True`; everything
    // else in the syntax is Jinja's default, which minijinja shares.
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|err| TokenizeError::TemplateSyntax(err.to_string()))?;
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.set_fuel(Some(limits.template_fuel));
    env.set_recursion_limit(limits.template_recursion);
    let tojson_cap = limits.max_rendered_bytes;
    env.add_filter(
        "tojson",
        move |state: &State, value: &Value, kwargs: Kwargs| {
            tojson_filter(state, value, kwargs, tojson_cap)
        },
    );
    // Python's `str()` / `pprint` of a container is its repr (`['a', None]`); minijinja's
    // versions print JSON-like text (`["a", none]`) through unbounded recursion.
    env.add_filter("string", string_filter);
    env.add_filter("pprint", string_filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    let source = match rewrite_generation_tags(&template.source) {
        Cow::Borrowed(_) => template.source,
        Cow::Owned(rewritten) => rewritten,
    };
    env.add_template_owned(TEMPLATE_NAME, source)
        .map_err(|err| TokenizeError::TemplateSyntax(err.to_string()))?;
    let token = |t: Option<String>| Value::from(t.unwrap_or_default());
    Ok(CompiledTemplate {
        env,
        bos_token: token(template.bos_token),
        eos_token: token(template.eos_token),
    })
}

impl CompiledTemplate {
    pub(super) fn render(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        extra: Option<&Json>,
        limits: &TokenizeLimits,
    ) -> Result<String, TokenizeError> {
        let mut budget = ByteBudget::new(limits.max_prompt_bytes);
        let messages = messages_to_value(messages, &mut budget)?;
        let tools = match tools {
            Some(tools) => json_to_value(tools, 0, &mut budget)?,
            None => Value::from(()),
        };
        // Same precedence as transformers: special tokens first, caller kwargs may override
        // them, and the three request fields always win. `documents` is always defined (as
        // `none` unless given), because transformers passes it and `documents is not none`
        // is true for an undefined name.
        let mut context: Vec<(Value, Value)> = Vec::with_capacity(8);
        context.push((Value::from("bos_token"), self.bos_token.clone()));
        context.push((Value::from("eos_token"), self.eos_token.clone()));
        context.push((Value::from("documents"), Value::from(())));
        if let Some(Json::Object(extra)) = extra {
            for (key, value) in extra {
                budget.charge(key.len())?;
                context.push((
                    Value::from(key.as_str()),
                    json_to_value(value, 1, &mut budget)?,
                ));
            }
        }
        context.push((Value::from("messages"), messages));
        context.push((Value::from("tools"), tools));
        context.push((
            Value::from("add_generation_prompt"),
            Value::from(add_generation_prompt),
        ));
        let context = Value::from_pairs(context);

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|err| TokenizeError::TemplateSyntax(err.to_string()))?;
        let mut out = CappedWriter {
            // Templates add little around the conversation; reserving the input size up front
            // avoids most reallocations of a large prompt.
            buf: Vec::with_capacity((budget.used + 4096).min(limits.max_rendered_bytes)),
            cap: limits.max_rendered_bytes,
            overflowed: false,
        };
        let result = template.render_captured_to(context, &mut out);
        if out.overflowed {
            return Err(TokenizeError::TemplateLimit {
                limit: TemplateLimit::RenderedBytes,
                max: limits.max_rendered_bytes as u64,
            });
        }
        if let Err(err) = result {
            return Err(classify_render_error(&err, limits));
        }
        String::from_utf8(out.buf).map_err(|err| TokenizeError::TemplateRender(err.to_string()))
    }
}

/// Counts the string bytes of the request as it is converted, so an oversized chat is rejected
/// before the template runs.
pub(super) struct ByteBudget {
    used: usize,
    max: usize,
}

impl ByteBudget {
    fn new(max: usize) -> Self {
        Self { used: 0, max }
    }

    fn charge(&mut self, bytes: usize) -> Result<(), TokenizeError> {
        self.used = self.used.saturating_add(bytes);
        if self.used > self.max {
            return Err(TokenizeError::InputLimit {
                limit: InputLimit::PromptBytes,
                actual: self.used,
                max: self.max,
            });
        }
        Ok(())
    }
}

/// Message fields that carry reasoning, in the order `transformers` looks for them.
pub(super) const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// Converts the messages the way `transformers`' `apply_chat_template` (5.x) prepares them:
/// keys whose value is `null` are dropped (OpenAI clients send `"content": null` next to
/// `tool_calls`; a template then sees an undefined field rather than printing `None`), and a
/// message with reasoning under any of its names gets it under both `thinking` and
/// `reasoning_content` (as `{"thinking": r, **message, "reasoning_content": r}`), since
/// templates read one or the other.
pub(super) fn messages_to_value(
    messages: &Json,
    budget: &mut ByteBudget,
) -> Result<Value, TokenizeError> {
    let Json::Array(list) = messages else {
        return json_to_value(messages, 0, budget);
    };
    let mut out = Vec::with_capacity(list.len());
    for message in list {
        let Json::Object(map) = message else {
            out.push(json_to_value(message, 1, budget)?);
            continue;
        };
        let reasoning = REASONING_FIELDS
            .iter()
            .find_map(|&key| map.get(key).filter(|v| !v.is_null()).map(|v| (key, v)));
        let reasoning = match reasoning {
            Some((key, value)) => Some((key, json_to_value(value, 2, budget)?)),
            None => None,
        };
        let mut pairs: Vec<(Value, Value)> = Vec::with_capacity(map.len() + 2);
        if let Some((_, value)) = &reasoning {
            pairs.push((Value::from("thinking"), value.clone()));
        }
        for (key, value) in map {
            if value.is_null() {
                continue;
            }
            budget.charge(key.len())?;
            let value = match &reasoning {
                Some((source, converted)) if source == key => converted.clone(),
                _ => json_to_value(value, 2, budget)?,
            };
            pairs.push((Value::from(key.as_str()), value));
        }
        if let Some((_, value)) = reasoning {
            pairs.push((Value::from("reasoning_content"), value));
        }
        // Later pairs overwrite earlier ones in place, like keys in a Python dict literal.
        out.push(Value::from_pairs(pairs));
    }
    Ok(Value::from(out))
}

/// Converts request JSON to template values, keeping object key order (minijinja's
/// `preserve_order`), as Python dicts do: `tojson` and `.items()` must list keys in the order
/// the client sent them.
pub(super) fn json_to_value(
    json: &Json,
    depth: usize,
    budget: &mut ByteBudget,
) -> Result<Value, TokenizeError> {
    if depth > MAX_JSON_DEPTH {
        return Err(TokenizeError::InvalidChat(format!(
            "JSON nested deeper than {MAX_JSON_DEPTH} levels"
        )));
    }
    Ok(match json {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => {
            budget.charge(s.len())?;
            Value::from(s.as_str())
        }
        Json::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                out.push(json_to_value(item, depth + 1, budget)?);
            }
            Value::from(out)
        }
        Json::Object(map) => {
            let mut out = Vec::with_capacity(map.len());
            for (key, value) in map {
                budget.charge(key.len())?;
                out.push((
                    Value::from(key.as_str()),
                    json_to_value(value, depth + 1, budget)?,
                ));
            }
            Value::from_pairs(out)
        }
    })
}

/// Collects the rendered prompt and refuses to grow past `cap`. minijinja stops rendering on
/// the first write error, so a template that prints without end is cut off at the cap instead
/// of only when the fuel runs out.
pub(super) struct CappedWriter {
    buf: Vec<u8>,
    cap: usize,
    overflowed: bool,
}

impl io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.cap {
            self.overflowed = true;
            return Err(io::Error::other(
                "rendered prompt exceeds max_rendered_bytes",
            ));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The error a template's `raise_exception(...)` call carries, so it can be told apart from
/// engine errors after minijinja wraps it.
#[derive(Debug)]
pub(super) struct RaisedByTemplate(String);

impl fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

/// Stack reserved for one template render. minijinja's value `Drop` and `Display` recurse
/// once per nesting level, and a template can nest a value once per few fuel units
/// (`{% set ns.x = [ns.x] %}` in a loop), far deeper than any thread's default stack holds.
/// The stack is virtual memory: only what a render actually touches is committed, and fuel
/// bounds that. Measured: the deepest nesting the default fuel allows fits with room to spare
/// (`tests::a_template_nesting_values_as_deep_as_fuel_allows_does_not_overflow`).
pub const RENDER_STACK_BYTES: usize = 1 << 30;

/// Runs a render on a fresh stack segment of [`RENDER_STACK_BYTES`] on the calling thread
/// (`stacker` maps it, switches to it, and unmaps it afterwards; no thread is started), so a
/// hostile template ends in an error instead of overflowing the caller's stack, which would
/// abort the process. A panic inside the template engine becomes an error too.
pub(super) fn on_render_stack<F>(render: F) -> Result<String, TokenizeError>
where
    F: FnOnce() -> Result<String, TokenizeError>,
{
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        stacker::grow(RENDER_STACK_BYTES, render)
    }))
    .unwrap_or_else(|_| {
        Err(TokenizeError::TemplateRender(
            "the chat template panicked".into(),
        ))
    })
}

/// Marks an error raised because a filter's output would exceed `max_rendered_bytes`.
#[derive(Debug)]
pub(super) struct RenderedBytesExceeded;

impl fmt::Display for RenderedBytesExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("output exceeds max_rendered_bytes")
    }
}

impl std::error::Error for RenderedBytesExceeded {}

pub(super) fn classify_render_error(
    err: &minijinja::Error,
    limits: &TokenizeLimits,
) -> TokenizeError {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = current {
        if let Some(raised) = e.downcast_ref::<RaisedByTemplate>() {
            return TokenizeError::TemplateRaised(raised.0.clone());
        }
        if e.downcast_ref::<RenderedBytesExceeded>().is_some() {
            return TokenizeError::TemplateLimit {
                limit: TemplateLimit::RenderedBytes,
                max: limits.max_rendered_bytes as u64,
            };
        }
        if let Some(jinja) = e.downcast_ref::<minijinja::Error>() {
            if jinja.kind() == ErrorKind::OutOfFuel {
                return TokenizeError::TemplateLimit {
                    limit: TemplateLimit::Fuel,
                    max: limits.template_fuel,
                };
            }
            // minijinja reports the recursion limit as a generic invalid operation; its
            // message is the only distinguishing mark (pinned by a test).
            if jinja.detail() == Some("recursion limit exceeded") {
                return TokenizeError::TemplateLimit {
                    limit: TemplateLimit::Recursion,
                    max: limits.template_recursion as u64,
                };
            }
        }
        current = e.source();
    }
    TokenizeError::TemplateRender(err.to_string())
}

/// `raise_exception(message)`: templates call it to reject conversations they cannot format.
pub(super) fn raise_exception(message: Value) -> Result<Value, minijinja::Error> {
    let message = match message.as_str() {
        Some(s) => s.to_owned(),
        None => message.to_string(),
    };
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(RaisedByTemplate(message)),
    )
}

/// Rewrites transformers' `{% generation %}...{% endgeneration %}` tags (which only mark
/// assistant spans for training masks and render their body unchanged) into
/// `{% if true %}...{% endif %}`, keeping whitespace-control markers, so templates using them
/// compile in minijinja and render identically.
pub(super) fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len() + 16);
    let mut rest = source;
    let mut changed = false;
    while let Some(pos) = rest.find("{%") {
        let (before, tag) = rest.split_at(pos + 2);
        out.push_str(before);
        rest = tag;
        let control_len = usize::from(tag.starts_with('-') || tag.starts_with('+'));
        let (control, body) = tag.split_at(control_len);
        let keyword_start = body.trim_start();
        let leading_ws = &body[..body.len() - keyword_start.len()];
        let replacement = if let Some(after) = keyword_start.strip_prefix("endgeneration") {
            Some((after, "endif"))
        } else {
            keyword_start
                .strip_prefix("generation")
                .map(|after| (after, "if true"))
        };
        if let Some((after, replacement)) = replacement {
            let closing = after.trim_start();
            let closes = closing.starts_with("%}")
                || closing.starts_with("-%}")
                || closing.starts_with("+%}");
            let separated = after.len() != closing.len() || closes;
            if closes && separated {
                out.push_str(control);
                out.push_str(leading_ws);
                out.push_str(replacement);
                rest = after;
                changed = true;
            }
        }
    }
    if !changed {
        return Cow::Borrowed(source);
    }
    out.push_str(rest);
    Cow::Owned(out)
}
