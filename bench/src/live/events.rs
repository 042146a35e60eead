//! A scenario's timeline in live mode: faults posted to the simulated engines'
//! `/admin/fault` (the same JSON as their `--fault` flag) and restarts of our pickers, each
//! at its simulated time.
//!
//! | item | live |
//! |---|---|
//! | `restart@T:engine=E,down=S` | engine `E` closes (its connections drop mid-response) and comes back on the same ports `S` s later, empty, its event sequence from 0 |
//! | `event-loss@T:fraction=F,for=S` | every engine drops that fraction of its KV-event batches for `S` s, also from its replay buffer |
//! | `picker-restart@T` | the first picker is killed (its requests in flight fail) and started again, empty, without asking for a replay: the window has passed |
//!
//! The other kinds need what a process cannot be asked from outside (a new endpoint in the
//! picker's set, scrapes withheld, events held back) and are offline only.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;

use super::EngineAddrs;
use super::client::SimClock;
use super::pickers::LivePickers;
use crate::scenario::{Action, Scenario};

/// Whether live mode can play `scenario`; `own_pickers`: the run starts its own pickers
/// (not `--router URL`), `sim_engines`: the engines are simulated ones (they take faults).
pub fn check(scenario: &Scenario, own_pickers: bool, sim_engines: bool) -> Result<(), String> {
    for e in &scenario.events {
        match e.action {
            Action::Restart { .. } | Action::EventLoss { .. } if !sim_engines => {
                return Err(format!(
                    "scenario item {:?}: live engine faults need the simulated engines (real \
                     vLLM engines take no faults)",
                    e.text
                ));
            }
            Action::Restart { .. } | Action::EventLoss { .. } => {}
            Action::PickerRestart { replay_ms } if replay_ms > 0.0 => {
                return Err(format!(
                    "scenario item {:?}: in live mode the engines replay what their buffer \
                     holds, not S seconds: give picker-restart without replay (the window has \
                     passed)",
                    e.text
                ));
            }
            Action::PickerRestart { .. } if !own_pickers => {
                return Err(format!(
                    "scenario item {:?}: with --router the picker is not ours to restart",
                    e.text
                ));
            }
            Action::PickerRestart { .. } => {}
            Action::ScaleOut { .. }
            | Action::Replace { .. }
            | Action::StaleMetrics { .. }
            | Action::EventDelay { .. } => {
                return Err(format!(
                    "scenario item {:?}: offline only (live mode plays restart, event-loss and \
                     picker-restart)",
                    e.text
                ));
            }
        }
    }
    Ok(())
}

/// Play `scenario` against `engines` and `pickers` on the replay's clock, until its last
/// item is done. What failed is returned, one line each (the run goes on).
pub async fn play(
    scenario: Scenario,
    engines: Vec<EngineAddrs>,
    pickers: Option<Arc<LivePickers>>,
    clock: SimClock,
    http: reqwest::Client,
) -> Vec<String> {
    let mut failures = Vec::new();
    let mut clears = Vec::new();
    for e in &scenario.events {
        sleep_until(clock, e.at_ms).await;
        tracing::info!(item = %e.text, "scenario item");
        let r = match e.action {
            Action::Restart { engine, down_ms } => match engines.get(engine) {
                Some(a) => {
                    let fault = json!({
                        "kind": "crash",
                        "mode": "close",
                        "restart_after_ms": wall_ms(clock, down_ms),
                    });
                    post_fault(&http, a, &fault).await
                }
                None => Err(anyhow::anyhow!("there is no engine {engine}")),
            },
            Action::EventLoss { fraction, for_ms } => {
                let fault =
                    json!({"kind": "drop_events", "fraction": fraction, "replayable": false});
                let mut r = Ok(());
                for a in &engines {
                    r = r.and(post_fault(&http, a, &fault).await);
                }
                // undone in the background, so that later items keep their times
                let (engines, http, at) = (engines.clone(), http.clone(), e.at_ms + for_ms);
                clears.push(tokio::spawn(async move {
                    sleep_until(clock, at).await;
                    let mut r = Ok(());
                    for a in &engines {
                        r = r.and(post_fault(&http, a, &json!({"kind": "clear"})).await);
                    }
                    r
                }));
                r
            }
            Action::PickerRestart { .. } => match &pickers {
                Some(p) => p.restart(0, false).await,
                None => Err(anyhow::anyhow!("no picker of ours to restart")),
            },
            _ => Err(anyhow::anyhow!("offline only")),
        };
        if let Err(err) = r {
            failures.push(format!("{}: {err:#}", e.text));
        }
    }
    for c in clears {
        match c.await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => failures.push(format!("clearing a fault: {err:#}")),
            Err(err) => failures.push(format!("clearing a fault: {err}")),
        }
    }
    failures
}

/// Wall milliseconds of `sim_ms` simulated ones.
fn wall_ms(clock: SimClock, sim_ms: f64) -> u64 {
    (sim_ms / clock.speedup).round().max(0.0) as u64
}

async fn sleep_until(clock: SimClock, at_ms: f64) {
    let ahead = at_ms - clock.now_ms();
    if ahead > 0.0 {
        tokio::time::sleep(Duration::from_millis(wall_ms(clock, ahead))).await;
    }
}

async fn post_fault(
    http: &reqwest::Client,
    engine: &EngineAddrs,
    fault: &serde_json::Value,
) -> anyhow::Result<()> {
    let url = format!("http://{}/admin/fault", engine.http);
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        http.post(&url)
            .header("content-type", "application/json")
            .body(fault.to_string())
            .send(),
    )
    .await
    .with_context(|| format!("{url}: no answer within 10 s"))?
    .with_context(|| format!("posting to {url}"))?;
    let status = resp.status();
    anyhow::ensure!(
        status.is_success(),
        "{url} answered {status}: {}",
        resp.text().await.unwrap_or_default()
    );
    Ok(())
}
