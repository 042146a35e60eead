//! The built-in workload: multi-tenant, multi-turn conversations.
//!
//! `groups` tenants (applications) each have a long system prompt; sessions arrive as a
//! Poisson process, pick a group by a Zipf-like popularity, and run a number of turns. Every
//! turn's prompt is the system prompt, the whole conversation so far and a new user message;
//! the next turn follows the response after a think time. This is the traffic a KV-aware
//! router exists for: a shared prefix per tenant, a growing private prefix per session.
//!
//! Prompts are described like the traces, by chained hash ids over `block_tokens`-token
//! blocks: a block wholly inside the system prompt has the group's id for that position, any
//! later block the session's, so equal ids mean equal prefixes.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::tokens::mix64;
use super::{Node, Plan, TimedSession, TraceRequest, Workload};

/// Parameters of the generator; every size is a mean (sizes vary uniformly ±50%).
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratorConfig {
    /// Tenants, each with its own system prompt.
    pub groups: u32,
    pub system_tokens: u32,
    /// New sessions per second (Poisson).
    pub session_rate: f64,
    /// Sessions start within this many seconds.
    pub duration_s: f64,
    /// Mean turns per session (geometric, at least 1).
    pub turns: f64,
    /// New user tokens per turn (a message, a pasted file, a tool result).
    pub user_tokens: u32,
    pub output_tokens: u32,
    /// Mean think time between a response and the next turn (exponential).
    pub think_ms: f64,
    /// Zipf exponent of group popularity (0 = uniform).
    pub zipf: f64,
    /// Tokens per hash id.
    pub block_tokens: u32,
}

impl Default for GeneratorConfig {
    fn default() -> Self {
        Self {
            groups: 8,
            system_tokens: 8_000,
            session_rate: 6.0,
            duration_s: 20.0,
            turns: 6.0,
            user_tokens: 3_000,
            output_tokens: 32,
            think_ms: 2_000.0,
            zipf: 1.0,
            block_tokens: 16,
        }
    }
}

const GROUP_TAG: u64 = 0x6772_6f75_7000_0000;
const SESSION_TAG: u64 = 0x7365_7373_0000_0000;

fn around(rng: &mut ChaCha8Rng, mean: u32) -> u32 {
    if mean == 0 {
        return 0;
    }
    let lo = (f64::from(mean) * 0.5).max(1.0);
    let hi = f64::from(mean) * 1.5;
    rng.random_range(lo..=hi).round() as u32
}

fn exp(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    if mean <= 0.0 {
        return 0.0;
    }
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    -u.ln() * mean
}

/// Generate the workload (deterministic in `seed`).
pub fn generate(cfg: &GeneratorConfig, seed: u64) -> Workload {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6b76_726f_7574_6567);
    let groups = cfg.groups.max(1);
    let block = cfg.block_tokens.max(1);
    let system: Vec<u32> = (0..groups)
        .map(|_| around(&mut rng, cfg.system_tokens))
        .collect();
    // Zipf-like popularity
    let weights: Vec<f64> = (0..groups)
        .map(|g| 1.0 / f64::from(g + 1).powf(cfg.zipf.max(0.0)))
        .collect();
    let total_w: f64 = weights.iter().sum();
    let rate = cfg.session_rate.max(1e-9);
    let horizon_ms = cfg.duration_s.max(0.0) * 1000.0;
    let p_continue = if cfg.turns > 1.0 {
        1.0 - 1.0 / cfg.turns
    } else {
        0.0
    };

    let mut sessions = Vec::new();
    let mut t = 0.0;
    let mut sid: u64 = 0;
    loop {
        t += exp(&mut rng, 1000.0 / rate);
        if t > horizon_ms {
            break;
        }
        sid += 1;
        let mut pick = rng.random_range(0.0..total_w);
        let mut group = 0;
        for (g, w) in weights.iter().enumerate() {
            if pick < *w {
                group = g as u32;
                break;
            }
            pick -= w;
        }
        let sys = system[group as usize];
        let id_of = |j: u64| -> u64 {
            if (j + 1) * u64::from(block) <= u64::from(sys) {
                mix64(seed ^ GROUP_TAG ^ (u64::from(group) << 24) ^ mix64(j))
            } else {
                mix64(seed ^ SESSION_TAG ^ mix64(sid) ^ mix64(j.wrapping_add(1 << 40)))
            }
        };
        let mut nodes = Vec::new();
        let mut history = u64::from(sys);
        loop {
            let user = u64::from(around(&mut rng, cfg.user_tokens).max(1));
            let output = around(&mut rng, cfg.output_tokens).max(1);
            let input = (history + user).min(u64::from(super::MAX_INPUT_TOKENS)) as u32;
            let ids: Vec<u64> = (0..u64::from(input.div_ceil(block))).map(id_of).collect();
            let think_ms = if nodes.is_empty() {
                0.0
            } else {
                exp(&mut rng, cfg.think_ms)
            };
            let (req, _) = TraceRequest::normalized(ids, block, input, output, sid);
            nodes.push(Node::Request { think_ms, req });
            history = u64::from(input) + u64::from(output);
            if !rng.random_bool(p_continue) || history >= u64::from(super::MAX_INPUT_TOKENS) {
                break;
            }
        }
        sessions.push(TimedSession {
            start_ms: t,
            nodes: Arc::from(nodes),
        });
    }
    Workload {
        name: format!(
            "generated: {groups} groups × {} system tokens, {:.1} sessions/s for {:.0} s, \
             {:.1} turns of {} user + {} output tokens, think {:.1} s",
            cfg.system_tokens,
            cfg.session_rate,
            cfg.duration_s,
            cfg.turns,
            cfg.user_tokens,
            cfg.output_tokens,
            cfg.think_ms / 1000.0
        ),
        block_tokens: block,
        plan: Plan::Timed(sessions),
        adjusted_records: 0,
    }
}
