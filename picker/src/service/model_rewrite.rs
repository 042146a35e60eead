//! The response of a request a `routing.modelRewrites` rule sent to another model, written
//! back to the model the client named: every `"model":"<target>"` (or `"model": "<target>"`)
//! of the JSON body or SSE stream becomes `"model":"<asked>"`, as the body streams through,
//! matches split across chunks included. Escaped text inside strings (`\"model\"`) never
//! matches, so content that quotes the model is left alone.

use bytes::Bytes;

/// Rewrites a response body chunk by chunk.
#[derive(Debug)]
pub struct ResponseModelRewrite {
    /// `(what, with)` pairs; no `what` is a prefix of another's start.
    patterns: Vec<(Vec<u8>, Vec<u8>)>,
    longest: usize,
    /// The tail of the input that may start a match the next chunk completes.
    carry: Vec<u8>,
}

/// `s` as the inside of a JSON string.
fn json_inner(s: &str) -> Vec<u8> {
    let quoted = serde_json::to_string(s).unwrap_or_default();
    quoted.as_bytes()[1..quoted.len().saturating_sub(1).max(1)].to_vec()
}

impl ResponseModelRewrite {
    pub fn new(target: &str, asked: &str) -> Self {
        let (t, a) = (json_inner(target), json_inner(asked));
        let patterns: Vec<(Vec<u8>, Vec<u8>)> = [&b"\"model\":\""[..], &b"\"model\": \""[..]]
            .iter()
            .map(|key| {
                let what = [*key, &t, b"\""].concat();
                let with = [*key, &a, b"\""].concat();
                (what, with)
            })
            .collect();
        let longest = patterns.iter().map(|(w, _)| w.len()).max().unwrap_or(1);
        Self {
            patterns,
            longest,
            carry: Vec::new(),
        }
    }

    /// The next chunk, rewritten; a tail that may begin a match (`"mod`, say) is held back
    /// until the next chunk (or [`Self::finish`]).
    pub fn chunk(&mut self, chunk: &[u8]) -> Bytes {
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(buf.len());
        let mut i = 0;
        while let Some((at, p)) = self.next_match(&buf, i) {
            let (what, with) = &self.patterns[p];
            out.extend_from_slice(&buf[i..at]);
            out.extend_from_slice(with);
            i = at + what.len();
        }
        // an incomplete match can only start in the last `longest - 1` bytes, where the rest
        // of the buffer is the beginning of a pattern
        let from = i.max(buf.len().saturating_sub(self.longest - 1));
        let cut = (from..buf.len())
            .find(|&p| {
                self.patterns
                    .iter()
                    .any(|(what, _)| what.starts_with(&buf[p..]))
            })
            .unwrap_or(buf.len());
        out.extend_from_slice(&buf[i..cut]);
        self.carry = buf[cut..].to_vec();
        Bytes::from(out)
    }

    /// What is still held back, at the end of the body.
    pub fn finish(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.carry))
    }

    fn next_match(&self, buf: &[u8], from: usize) -> Option<(usize, usize)> {
        self.patterns
            .iter()
            .enumerate()
            .filter_map(|(p, (what, _))| {
                buf.get(from..)?
                    .windows(what.len())
                    .position(|w| w == what.as_slice())
                    .map(|at| (from + at, p))
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(r: &mut ResponseModelRewrite, chunks: &[&str]) -> String {
        let mut out = Vec::new();
        for c in chunks {
            out.extend_from_slice(&r.chunk(c.as_bytes()));
        }
        out.extend_from_slice(&r.finish());
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn the_model_is_written_back_across_chunk_boundaries() {
        let body = r#"data: {"id":"1","model":"sql-v2","choices":[{"text":"\"model\":\"sql-v2\""}]}

data: {"id":"1", "model": "sql-v2"}

"#;
        let want = body
            .replace(
                r#""model":"sql-v2","choices""#,
                r#""model":"sql","choices""#,
            )
            .replace(r#""model": "sql-v2"}"#, r#""model": "sql"}"#);
        // every split of the body into two chunks, and byte by byte
        for cut in 0..body.len() {
            let mut r = ResponseModelRewrite::new("sql-v2", "sql");
            assert_eq!(
                run(&mut r, &[&body[..cut], &body[cut..]]),
                want,
                "cut at {cut}"
            );
        }
        let bytes: Vec<String> = body.chars().map(String::from).collect();
        let parts: Vec<&str> = bytes.iter().map(String::as_str).collect();
        assert_eq!(
            run(&mut ResponseModelRewrite::new("sql-v2", "sql"), &parts),
            want
        );
        // another model, and text that only looks like it, pass unchanged
        let other = r#"{"model":"sql-v20","x":"model"}"#;
        assert_eq!(
            run(&mut ResponseModelRewrite::new("sql-v2", "sql"), &[other]),
            other
        );
        // only a tail that may begin a match is held back
        let mut r = ResponseModelRewrite::new("sql-v2", "sql");
        assert_eq!(&r.chunk(br#"{"id":1}"#)[..], br#"{"id":1}"#);
        assert_eq!(&r.chunk(br#"{"mo"#)[..], b"{");
        assert_eq!(&r.chunk(br#"del":"sql-v2"}"#)[..], br#""model":"sql"}"#);
    }
}
