//! Python compatibility for templates: `strftime_now`, Python reprs of values, `|string`,
//! and Hugging Face's `tojson`, which templates print into prompts.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{ErrorKind, Output, State, Value};

use super::*;

/// `strftime_now(format)`: the current time, formatted like Python's `strftime`. Llama 3.x
/// templates print today's date with it. The time is UTC (Python uses local time, which is UTC
/// in typical serving containers).
pub(super) fn strftime_now(format: &str) -> Result<Value, minijinja::Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    Ok(Value::from(format_strftime(format, secs)))
}

pub(super) const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
pub(super) const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Formats a UTC Unix timestamp with the C-locale `strftime` directives templates use
/// (`%a %A %b %B %h %d %e %m %y %Y %H %I %M %S %p %j %F %T %D %Z %z %n %t %%`, and glibc's `-`
/// flag to drop padding). Unknown directives are copied through, as glibc does.
pub(super) fn format_strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let hour = secs_of_day / 3600;
    let minute = secs_of_day % 3600 / 60;
    let second = secs_of_day % 60;
    // 1970-01-01 was a Thursday (index 4 with Sunday = 0).
    let weekday = usize::try_from((days + 4).rem_euclid(7)).unwrap_or(0);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS
        .get(usize::try_from(month - 1).unwrap_or(0))
        .copied()
        .unwrap_or("");
    let weekday_name = WEEKDAYS.get(weekday).copied().unwrap_or("");
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |out: &mut String, value: i64, width: usize, pad: char| {
            if no_pad {
                let _ = write!(out, "{value}");
            } else if pad == ' ' {
                let _ = write!(out, "{value:>width$}");
            } else {
                let _ = write!(out, "{value:0width$}");
            }
        };
        match chars.next() {
            Some('a') => out.push_str(weekday_name.get(..3).unwrap_or("")),
            Some('A') => out.push_str(weekday_name),
            Some('b' | 'h') => out.push_str(month_name.get(..3).unwrap_or("")),
            Some('B') => out.push_str(month_name),
            Some('d') => num(&mut out, day, 2, '0'),
            Some('e') => num(&mut out, day, 2, ' '),
            Some('m') => num(&mut out, month, 2, '0'),
            Some('y') => num(&mut out, year.rem_euclid(100), 2, '0'),
            Some('Y') => num(&mut out, year, 1, '0'),
            Some('H') => num(&mut out, hour, 2, '0'),
            Some('I') => num(&mut out, hour12, 2, '0'),
            Some('M') => num(&mut out, minute, 2, '0'),
            Some('S') => num(&mut out, second, 2, '0'),
            Some('j') => num(&mut out, day_of_year, 3, '0'),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('F') => {
                let _ = write!(out, "{year}-{month:02}-{day:02}");
            }
            Some('T') => {
                let _ = write!(out, "{hour:02}:{minute:02}:{second:02}");
            }
            Some('D') => {
                let _ = write!(out, "{month:02}/{day:02}/{:02}", year.rem_euclid(100));
            }
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
            }
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar (Howard
/// Hinnant's `civil_from_days`).
pub(super) fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Inverse of [`civil_from_days`].
pub(super) fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Prints values the way Jinja2 under Python does: `None`, `True`, `False`, Python float and
/// container reprs. minijinja would print `none`, `true`, `[1, 2]` differs in quoting, and so
/// on; any such difference changes the token ids.
pub(super) fn python_formatter(
    out: &mut Output,
    state: &mut State,
    value: &Value,
) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::String => out.write_str(value.as_str().unwrap_or_default())?,
        ValueKind::Undefined => {}
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            write_python_repr(&mut text, value, 0)?;
            out.write_str(&text)?;
        }
        _ => minijinja::escape_formatter(out, state, value)?,
    }
    Ok(())
}

/// `|string` (and `|pprint`): Python's `str()`. Strings pass through, everything else gets its
/// Python repr. (`pprint` wraps values longer than 80 characters over several lines in
/// Python; chat templates do not use it for prompt text.)
pub(super) fn string_filter(value: &Value) -> Result<Value, minijinja::Error> {
    match value.kind() {
        ValueKind::String => Ok(value.clone()),
        ValueKind::Undefined => Ok(Value::from("")),
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            write_python_repr(&mut text, value, 0)?;
            Ok(Value::from(text))
        }
        _ => Ok(Value::from(value.to_string())),
    }
}

pub(super) fn too_deep() -> minijinja::Error {
    minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("value nested deeper than {MAX_RENDER_DEPTH} levels"),
    )
}

/// Python's `repr` for template values (`str()` of containers uses the items' `repr`).
pub(super) fn write_python_repr(
    out: &mut String,
    value: &Value,
    depth: usize,
) -> Result<(), minijinja::Error> {
    if depth > MAX_RENDER_DEPTH {
        return Err(too_deep());
    }
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_python_number(out, value),
        ValueKind::String => write_python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_repr(out, &item, depth + 1)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                let item = value.get_item(&key)?;
                write_python_repr(out, &key, depth + 1)?;
                out.push_str(": ");
                write_python_repr(out, &item, depth + 1)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

pub(super) fn write_python_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
    } else {
        match f64::try_from(value.clone()) {
            Ok(f) => push_python_float(out, f, "nan", "inf"),
            Err(_) => {
                let _ = write!(out, "{value}");
            }
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has a single quote and no double quote,
/// C escapes for control characters. (Python also escapes other non-printable code points; they
/// do not occur in real prompts.)
pub(super) fn write_python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for exponents -4..=15
/// (always with a fractional part), scientific (`1e+16`, `1.5e-05`) otherwise.
pub(crate) fn push_python_float(out: &mut String, f: f64, nan: &str, inf: &str) {
    if f.is_nan() {
        out.push_str(nan);
        return;
    }
    if f.is_infinite() {
        if f < 0.0 {
            out.push('-');
        }
        out.push_str(inf);
        return;
    }
    // `{:e}` gives the shortest round-trip digits as `d.ddde±x` without padding.
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    out.push_str(sign);
    if (-4..16).contains(&exponent) {
        let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
        if exponent >= 0 {
            let int_len = usize::try_from(exponent).unwrap_or(0) + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                let (int_part, frac_part) = digits.split_at(int_len);
                out.push_str(int_part);
                out.push('.');
                out.push_str(frac_part);
            }
        } else {
            out.push_str("0.");
            let zeros = usize::try_from(-exponent - 1).unwrap_or(0);
            out.extend(std::iter::repeat_n('0', zeros));
            out.push_str(&digits);
        }
    } else {
        out.push_str(mantissa);
        let _ = write!(
            out,
            "e{}{:02}",
            if exponent < 0 { '-' } else { '+' },
            exponent.unsigned_abs()
        );
    }
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`. Unlike Jinja's and minijinja's built-in `tojson` it does
/// not HTML-escape, keeps key order, and puts a space after `,` and `:` (no space after `,`
/// when indenting), and the keyword arguments mean what they mean for `json.dumps`.
pub(super) fn tojson_filter(
    state: &State,
    value: &Value,
    kwargs: Kwargs,
    cap: usize,
) -> Result<Value, minijinja::Error> {
    let indent: Option<String> = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => {
                let n = v.as_i64().ok_or_else(|| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "indent must be an int or a string",
                    )
                })?;
                " ".repeat(usize::try_from(n).unwrap_or(0).min(64))
            }
        }),
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let mut parts = v.try_iter()?;
            match (parts.next(), parts.next(), parts.next()) {
                (Some(a), Some(b), None) if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_owned(),
                    b.as_str().unwrap_or_default().to_owned(),
                ),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "separators must be a pair of strings",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let options = JsonDumps {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    let mut meter = OutputMeter {
        state,
        charged: 0,
        cap,
    };
    options.write(&mut out, &mut meter, value, 0)?;
    meter.finish(out.len())?;
    Ok(Value::from(out))
}

/// Charges fuel while `tojson` output grows and caps it at `max_rendered_bytes`.
///
/// minijinja charges a filter's result only once it is returned. Indentation multiplies the
/// input (every line repeats the indent once per nesting level), so a request with deeply
/// nested tool schemas under `tojson(indent=4)` could otherwise allocate hundreds of times its
/// own size before any limit applied.
pub(super) struct OutputMeter<'s, 't, 'e> {
    state: &'s State<'t, 'e>,
    charged: usize,
    cap: usize,
}

impl OutputMeter<'_, '_, '_> {
    fn check(&mut self, len: usize) -> Result<(), minijinja::Error> {
        if len > self.cap {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson output exceeds max_rendered_bytes",
            )
            .with_source(RenderedBytesExceeded));
        }
        if len - self.charged.min(len) >= 4096 {
            self.finish(len)?;
        }
        Ok(())
    }

    fn finish(&mut self, len: usize) -> Result<(), minijinja::Error> {
        let units = len.saturating_sub(self.charged) / 64;
        self.charged += units * 64;
        self.state.consume_fuel(units as u64)
    }
}

pub(super) struct JsonDumps {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl JsonDumps {
    fn newline(
        &self,
        out: &mut String,
        meter: &mut OutputMeter,
        depth: usize,
    ) -> Result<(), minijinja::Error> {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
                meter.check(out.len())?;
            }
        }
        Ok(())
    }

    fn write(
        &self,
        out: &mut String,
        meter: &mut OutputMeter,
        value: &Value,
        depth: usize,
    ) -> Result<(), minijinja::Error> {
        meter.check(out.len())?;
        if depth > MAX_RENDER_DEPTH {
            return Err(too_deep());
        }
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if value.is_integer() {
                    let _ = write!(out, "{value}");
                } else {
                    let f = f64::try_from(value.clone())?;
                    push_python_float(out, f, "NaN", "Infinity");
                }
            }
            ValueKind::String => self.write_str(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, meter, depth + 1)?;
                    self.write(out, meter, item, depth + 1)?;
                }
                self.newline(out, meter, depth)?;
                out.push(']');
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((json_key(&key)?, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if entries.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, (key, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, meter, depth + 1)?;
                    self.write_str(out, key);
                    out.push_str(&self.key_sep);
                    self.write(out, meter, item, depth + 1)?;
                }
                self.newline(out, meter, depth)?;
                out.push('}');
            }
            kind => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("object of type {kind} is not JSON serializable"),
                ));
            }
        }
        Ok(())
    }

    /// JSON string escaping as Python's `json` module does it.
    fn write_str(&self, out: &mut String, s: &str) {
        write_python_json_str(out, s, self.ensure_ascii);
    }
}

/// `s` as Python's `json` module writes a string: quoted, the usual escapes, other control
/// characters as `\uXXXX`, and with `ensure_ascii` every non-ASCII character as UTF-16
/// `\uXXXX` units.
pub(crate) fn write_python_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `json.dumps` converts non-string keys: numbers via `str()`, booleans and `None` to
/// their JSON spelling; anything else is an error.
pub(super) fn json_key(key: &Value) -> Result<String, minijinja::Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number => {
            let mut s = String::new();
            write_python_number(&mut s, key);
            Ok(s)
        }
        kind => Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}
