//! Workload parsers on small inline samples, the hash-id → token mapping, and the session
//! player.

use std::path::Path;

use kvroute_bench::driver::{Driver, Issue};
use kvroute_bench::workload::generated::{GeneratorConfig, generate};
use kvroute_bench::workload::tokens::prompt_tokens;
use kvroute_bench::workload::{
    self, LoadOptions, Node, Plan, WorkloadError, azure, mooncake, weka,
};

fn opts() -> LoadOptions {
    LoadOptions::default()
}

#[test]
fn mooncake_lines_become_timed_requests_sorted_by_timestamp() {
    let text = r#"{"timestamp": 3000, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]}
{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 7]}

{"timestamp": 1000, "input_length": 512, "output_length": 9, "hash_ids": [0], "extra": true}
"#;
    let w = mooncake::parse(text.as_bytes(), Path::new("sample.jsonl"), &opts()).expect("parses");
    assert_eq!(w.block_tokens, 512);
    assert_eq!(w.adjusted_records, 0);
    let Plan::Timed(sessions) = &w.plan else {
        panic!("open loop expected");
    };
    let starts: Vec<f64> = sessions.iter().map(|s| s.start_ms).collect();
    assert_eq!(
        starts,
        [0.0, 0.0, 2000.0],
        "relative to the first, stable order"
    );
    let Node::Request { req, .. } = &sessions[0].nodes[0] else {
        panic!("request");
    };
    assert_eq!(
        (req.input_len, req.output_len, &req.hash_ids[..]),
        (600, 5, &[0u64, 7][..])
    );
    assert_eq!(w.requests_per_pass(), 3);
}

#[test]
fn mooncake_errors_name_the_line() {
    let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": \"soon\"}\n";
    let e =
        mooncake::parse(text.as_bytes(), Path::new("bad.jsonl"), &opts()).expect_err("bad line");
    let msg = e.to_string();
    assert!(msg.contains("bad.jsonl:2"), "{msg}");
    assert!(matches!(e, WorkloadError::Record { line: 2, .. }));
    let e = mooncake::parse(&b""[..], Path::new("empty.jsonl"), &opts()).expect_err("empty");
    assert!(e.to_string().contains("no records"), "{e}");
}

#[test]
fn mooncake_records_with_too_few_ids_are_adjusted_not_fatal() {
    let text = r#"{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [4]}"#;
    let w = mooncake::parse(text.as_bytes(), Path::new("x.jsonl"), &opts()).expect("parses");
    assert_eq!(w.adjusted_records, 1);
    let Plan::Timed(s) = &w.plan else {
        panic!("timed")
    };
    let Node::Request { req, .. } = &s[0].nodes[0] else {
        panic!("request")
    };
    assert_eq!(req.hash_ids.len(), 4);
    assert_eq!(req.hash_ids[0], 4);
}

const SESSION: &str = r#"{
  "id": "trace_x", "block_size": 64, "hash_id_scope": "local",
  "requests": [
    {"t": 0.0, "type": "n", "in": 130, "out": 10, "hash_ids": [1, 2, 3], "think_time": 0.0},
    {"t": 9.0, "type": "n", "in": 200, "out": 12, "hash_ids": [1, 2, 4, 5], "think_time": 5.0},
    {"t": 20.0, "type": "subagent", "requests": [
        {"t": 0.0, "type": "n", "in": 64, "out": 3, "hash_ids": [90], "think_time": 0.0},
        {"t": 4.0, "type": "n", "in": 128, "out": 3, "hash_ids": [90, 91], "think_time": 2.0}
    ]},
    {"t": 90.0, "type": "s", "in": 300, "out": 7, "hash_ids": [1, 2, 4, 5, 6], "think_time": 9000.0}
  ]
}"#;

#[test]
fn session_files_keep_subagents_and_cap_think_times() {
    let o = LoadOptions {
        concurrency: 3,
        think_cap_ms: 60_000.0,
        ..opts()
    };
    let w = weka::from_texts(&[(Path::new("trace_x.json"), SESSION)], &o).expect("parses");
    assert_eq!(w.block_tokens, 64);
    let Plan::Concurrent {
        templates,
        concurrency,
        ..
    } = &w.plan
    else {
        panic!("sessions expected");
    };
    assert_eq!(*concurrency, 3);
    let t = &templates[0];
    assert_eq!(t.len(), 4);
    assert!(matches!(&t[2], Node::Subagent(c) if c.len() == 2));
    let Node::Request { think_ms, req } = &t[3] else {
        panic!("request")
    };
    assert_eq!(*think_ms, 60_000.0, "9000 s think time is capped");
    assert_eq!(req.input_len, 300);
    assert_eq!(w.requests_per_pass(), 5);
}

/// `--token-divisor`: lengths shrink, the hash ids (the prefix structure) stay, and every
/// prompt is still covered by its ids.
#[test]
fn shrinking_tokens_keeps_the_prefix_structure() {
    let o = LoadOptions {
        concurrency: 3,
        ..opts()
    };
    let mut w = weka::from_texts(&[(Path::new("trace_x.json"), SESSION)], &o).expect("parses");
    let before = w.clone();
    w.shrink_tokens(16).expect("16 divides 64");
    assert_eq!(w.block_tokens, 4);
    let (Plan::Concurrent { templates: a, .. }, Plan::Concurrent { templates: b, .. }) =
        (&before.plan, &w.plan)
    else {
        panic!("sessions expected");
    };
    let Node::Request { req: r0, .. } = &a[0][3] else {
        panic!("request")
    };
    let Node::Request { req: r1, .. } = &b[0][3] else {
        panic!("request")
    };
    assert_eq!(r1.hash_ids, r0.hash_ids);
    assert_eq!(r1.input_len, r0.input_len.div_ceil(16));
    assert_eq!(r1.output_len, r0.output_len.div_ceil(16).max(1));
    assert_eq!(
        prompt_tokens(&r1.hash_ids, w.block_tokens, r1.input_len).len(),
        r1.input_len as usize
    );
    assert!(w.clone().shrink_tokens(3).is_err(), "3 does not divide 4");
    let mut same = before.clone();
    same.shrink_tokens(1).expect("1 is a no-op");
    assert_eq!(same, before);
}

#[test]
fn session_file_errors_are_clear() {
    let bad = SESSION.replace("\"in\": 200,", "");
    let e =
        weka::from_texts(&[(Path::new("t.json"), bad.as_str())], &opts()).expect_err("missing in");
    assert!(
        e.to_string().contains("requests[1]") && e.to_string().contains("`in`"),
        "{e}"
    );
    let e = weka::from_texts(&[(Path::new("t.json"), "[]")], &opts()).expect_err("not a session");
    assert!(e.to_string().contains("t.json"), "{e}");
    let mixed = SESSION.replace("\"block_size\": 64", "\"block_size\": 32");
    let e = weka::from_texts(
        &[
            (Path::new("a.json"), SESSION),
            (Path::new("b.json"), mixed.as_str()),
        ],
        &opts(),
    )
    .expect_err("mixed block sizes");
    assert!(e.to_string().contains("block_size"), "{e}");
}

#[test]
fn azure_csv_gives_arrivals_and_unique_prompts() {
    let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
               2023-11-16 18:15:46.6805900,374,44\n\
               2023-11-16 18:15:50.9951690,396,109\n";
    let w = azure::parse(csv.as_bytes(), Path::new("conv.csv"), &opts()).expect("parses");
    let Plan::Timed(s) = &w.plan else {
        panic!("timed")
    };
    assert_eq!(s.len(), 2);
    assert!((s[1].start_ms - 4314.579).abs() < 0.01, "{}", s[1].start_ms);
    let ids = |i: usize| match &s[i].nodes[0] {
        Node::Request { req, .. } => req.hash_ids.clone(),
        Node::Subagent(_) => panic!("request"),
    };
    assert_ne!(ids(0)[0], ids(1)[0], "no prefix reuse in Azure traces");
    let bad = "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,3\n";
    let e = azure::parse(bad.as_bytes(), Path::new("bad.csv"), &opts()).expect_err("column");
    assert!(e.to_string().contains("GeneratedTokens"), "{e}");
    let bad = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,lots,3\n";
    let e = azure::parse(bad.as_bytes(), Path::new("bad.csv"), &opts()).expect_err("number");
    assert!(e.to_string().contains("bad.csv:2"), "{e}");
}

#[test]
fn formats_guess_and_resolve() {
    use workload::Format;
    assert_eq!(Format::guess(Path::new("x.jsonl")), Some(Format::Mooncake));
    assert_eq!(Format::guess(Path::new("x.csv")), Some(Format::Azure));
    assert!(Format::parse("nope").is_err());
    let p = workload::resolve_trace(Format::Generated, None).expect("no file needed");
    assert!(p.is_none());
}

#[test]
fn hash_ids_map_to_tokens_preserving_prefixes() {
    let a = prompt_tokens(&[10, 20, 30], 64, 64 * 3);
    let b = prompt_tokens(&[10, 20, 31], 64, 64 * 2 + 5);
    assert_eq!(a.len(), 192);
    assert_eq!(b.len(), 133);
    assert_eq!(a[..128], b[..128], "shared ids share their tokens exactly");
    assert_ne!(
        a[128..133],
        b[128..133],
        "a different id gives different tokens"
    );
    // the same id gives the same tokens wherever it appears, and a partial block is a prefix
    // of the full one
    let c = prompt_tokens(&[10, 20, 30], 64, 150);
    assert_eq!(c[..], a[..150]);
    // deterministic
    assert_eq!(prompt_tokens(&[5], 16, 16), prompt_tokens(&[5], 16, 16));
}

#[test]
fn generated_turns_extend_their_conversation_and_share_system_prompts() {
    let cfg = GeneratorConfig {
        session_rate: 5.0,
        duration_s: 10.0,
        turns: 4.0,
        ..GeneratorConfig::default()
    };
    let w = generate(&cfg, 7);
    assert_eq!(w, generate(&cfg, 7), "same seed, same workload");
    assert_ne!(w, generate(&cfg, 8));
    let Plan::Timed(sessions) = &w.plan else {
        panic!("timed")
    };
    assert!(sessions.len() > 20);
    let mut multi = 0;
    for s in sessions {
        let reqs: Vec<_> = s
            .nodes
            .iter()
            .filter_map(|n| match n {
                Node::Request { req, .. } => Some(req),
                Node::Subagent(_) => None,
            })
            .collect();
        for pair in reqs.windows(2) {
            let full = (pair[0].input_len / w.block_tokens) as usize;
            assert_eq!(
                pair[0].hash_ids[..full],
                pair[1].hash_ids[..full],
                "turns extend the prefix"
            );
            assert!(pair[1].input_len > pair[0].input_len);
            multi += 1;
        }
    }
    assert!(multi > 10);
    // sessions of one group share the system prompt's blocks
    let first = |i: usize| match &sessions[i].nodes[0] {
        Node::Request { req, .. } => req.hash_ids[0],
        Node::Subagent(_) => 0,
    };
    let distinct: std::collections::BTreeSet<u64> = (0..sessions.len()).map(first).collect();
    assert!(
        distinct.len() <= 8,
        "at most one first block per group: {}",
        distinct.len()
    );
}

fn drain(d: &mut Driver, now: f64) -> Vec<Issue> {
    let mut out = Vec::new();
    d.release_due(now, &mut out);
    out
}

#[test]
fn the_driver_plays_think_times_and_subagents_in_order() {
    let o = LoadOptions {
        concurrency: 1,
        ..opts()
    };
    let w = weka::from_texts(&[(Path::new("trace_x.json"), SESSION)], &o).expect("parses");
    let mut d = Driver::new(&w, Some(5));
    assert_eq!(d.next_due(), Some(0.0));
    let first = drain(&mut d, 0.0);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].input_len, 130);
    // ids live in the copy's own space; a second copy would get different ids
    assert_ne!(first[0].hash_ids[0], 1);
    let mut out = Vec::new();
    d.complete(first[0].id, 100.0, &mut out);
    assert!(out.is_empty());
    assert_eq!(d.next_due(), Some(5_100.0), "response end + think time");
    let second = drain(&mut d, 5_100.0);
    assert_eq!(second[0].input_len, 200);
    assert_eq!(second[0].hash_ids[..2], first[0].hash_ids[..2]);
    // after the second response the sub-agent starts at once; the parent waits for it
    d.complete(second[0].id, 6_000.0, &mut out);
    let sub = drain(&mut d, 6_000.0);
    assert_eq!(sub.len(), 1);
    assert_eq!(sub[0].input_len, 64);
    d.complete(sub[0].id, 6_500.0, &mut out);
    assert_eq!(d.next_due(), Some(8_500.0));
    let sub2 = drain(&mut d, 8_500.0);
    assert_eq!(sub2[0].input_len, 128);
    d.complete(sub2[0].id, 9_000.0, &mut out);
    // the parent's last request (think capped at 60 s) after the sub-agent finished
    assert_eq!(d.next_due(), Some(69_000.0));
    let last = drain(&mut d, 69_000.0);
    assert_eq!(last[0].input_len, 300);
    d.complete(last[0].id, 70_000.0, &mut out);
    assert!(d.finished(), "five requests: the limit");
    assert_eq!(d.released(), 5);
}

#[test]
fn concurrent_sessions_are_distinct_copies() {
    let o = LoadOptions {
        concurrency: 2,
        stagger_ms: 10.0,
        ..opts()
    };
    let w = weka::from_texts(&[(Path::new("trace_x.json"), SESSION)], &o).expect("parses");
    let mut d = Driver::new(&w, None);
    assert_eq!(d.total_requests(), 10, "one pass per slot");
    let a = drain(&mut d, 0.0);
    let b = drain(&mut d, 10.0);
    assert_eq!((a.len(), b.len()), (1, 1));
    assert_ne!(a[0].session, b[0].session);
    assert_ne!(
        a[0].hash_ids[0], b[0].hash_ids[0],
        "fresh hash space per copy"
    );
}
