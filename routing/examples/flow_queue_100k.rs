//! Flow control's queue with 100k waiting requests: time per push and pop, and the memory the
//! queue holds (resident set growth, so run it alone). Figures in `picker/BENCHMARKS.md` §5.
//!
//! `cargo run --release -p kvroute-routing --example flow_queue_100k -- las 1000` (or `las 10`,
//! `rr 1000`)

use std::time::Instant;

use kvroute_routing::flow::{Fairness, FlowQueue, FlowSettings, Order, Waiting};

const N: u64 = 100_000;

/// Resident set size in bytes (Linux).
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn run(fairness: Fairness, flows: u64) {
    let mut q = FlowQueue::new(FlowSettings {
        max_requests: N as usize,
        max_bytes: u64::MAX,
        ttl_ms: 60_000,
        fairness,
        order: Order::Fcfs,
    });
    let before = rss();
    let t = Instant::now();
    for id in 0..N {
        let w = Waiting {
            id,
            band: (id % 4) as i32 - 1,
            flow: id % flows,
            tokens: 1000 + id % 7000,
            bytes: 4096,
            arrival_ms: id / 100,
            deadline_ms: None,
        };
        q.push(w).expect("room");
    }
    let push = t.elapsed();
    let held = rss().saturating_sub(before);
    // a full queue: each newcomer of the top band pushes out a bottom-band request
    let t = Instant::now();
    for id in N..N + 1000 {
        let w = Waiting {
            id,
            band: 2,
            flow: id % flows,
            tokens: 1000,
            bytes: 4096,
            arrival_ms: 1000,
            deadline_ms: None,
        };
        q.push(w).expect("displaces");
    }
    let displace = t.elapsed();
    let t = Instant::now();
    let mut popped = 0u64;
    while q.pop().is_some() {
        popped += 1;
    }
    let pop = t.elapsed();
    println!(
        "{fairness:?}, {flows} flows: push {:.2} µs, push into a full queue {:.2} µs, pop {:.2} µs; {} requests held {:.1} MB ({:.0} B each); {popped} popped",
        push.as_secs_f64() * 1e6 / N as f64,
        displace.as_secs_f64() * 1e6 / 1000.0,
        pop.as_secs_f64() * 1e6 / popped as f64,
        N,
        held as f64 / 1e6,
        held as f64 / N as f64,
    );
}

/// One case per process (the resident set of a second case would reuse the first's freed
/// heap): `las 10`, `las 1000`, `rr 1000` (default `las 1000`).
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let fairness = match args.first().map(String::as_str) {
        Some("rr") => Fairness::RoundRobin,
        _ => Fairness::LeastAttainedService,
    };
    let flows = args.get(1).and_then(|f| f.parse().ok()).unwrap_or(1000);
    run(fairness, flows);
}
