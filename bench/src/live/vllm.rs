//! Live mode on real vLLM engines: started once, shared by every policy, caches reset between
//! policies.
//!
//! The engines serve the bench's model name ([`MODEL`]) so that the workload's requests need
//! no change; prompts are token-id arrays folded into the model's vocabulary
//! ([`crate::workload::tokens::fold_into_vocab`]), so the picker needs no tokenizer. The
//! engines publish KV events without a replay socket, as in the measured runs of
//! `bench/BENCHMARKS.md` §6 (made before the picker read vLLM 0.32's four-frame replay).

use std::time::{Duration, Instant};

use anyhow::Context as _;

use super::{EngineAddrs, EnginesInfo};
use crate::real_vllm::{self, EngineLaunch, VllmEngine};
use crate::{ClusterConfig, MODEL, VllmOptions};

/// Real engines and what the picker must know about them.
pub struct RealEngines {
    engines: Vec<VllmEngine>,
    pub info: EnginesInfo,
    /// The engines' KV capacity in blocks (`vllm:cache_config_info{num_gpu_blocks}`).
    pub num_blocks: u32,
    /// The model's vocabulary size.
    pub vocab: u32,
    /// The model folder (its tokenizer files too).
    pub model: std::path::PathBuf,
}

impl RealEngines {
    /// Start `cluster.engines` engines at once (engine i pinned to core i mod cores) and wait
    /// until every one is healthy.
    pub async fn start(
        cluster: &ClusterConfig,
        v: &VllmOptions,
        http: &reqwest::Client,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            cluster.dp_size == 1,
            "--backend vllm runs one rank per engine (--dp-size 1)"
        );
        anyhow::ensure!(
            cluster.engine.block_size.is_multiple_of(32),
            "vLLM's CPU backend needs a block size that is a multiple of 32"
        );
        let model = real_vllm::tiny_model(v.model.as_deref())?;
        let vocab = real_vllm::model_vocab(&model)?;
        let cores = v
            .cores
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1);
        let log_dir = super::procs::work_dir()?;
        let mut engines = Vec::with_capacity(cluster.engines);
        for i in 0..cluster.engines {
            let launch = EngineLaunch {
                model: model.clone(),
                served_name: MODEL.into(),
                core: Some((i % cores) as u32),
                block_size: cluster.engine.block_size,
                kv_cache_bytes: v.kv_cache_bytes,
                max_model_len: v.max_model_len,
                max_num_seqs: Some(cluster.engine.max_num_seqs),
                max_batched_tokens: Some(cluster.engine.max_num_batched_tokens),
                replay: false,
                dev_mode: true,
                topic: String::new(),
                log_dir: log_dir.clone(),
            };
            engines.push(VllmEngine::spawn(&launch)?);
        }
        let started = Instant::now();
        for e in &mut engines {
            e.wait_healthy(http, real_vllm::ENGINE_START).await?;
        }
        tracing::info!(
            engines = engines.len(),
            secs = started.elapsed().as_secs_f64(),
            "vLLM engines healthy"
        );
        let mut num_blocks = None;
        for e in &engines {
            let text = super::fetch(http, &format!("http://{}/metrics", e.http))
                .await
                .with_context(|| format!("reading {}/metrics", e.http))?;
            let n = real_vllm::num_gpu_blocks(&text)
                .with_context(|| format!("{} reports no vllm:cache_config_info", e.http))?;
            num_blocks = Some(num_blocks.map_or(n, |m: u32| m.min(n)));
        }
        let info = EnginesInfo {
            engines: engines
                .iter()
                .map(|e| EngineAddrs {
                    http: e.http,
                    http_ranks: vec![e.http],
                    kv_events: vec![e.kv_events],
                    replay: e.replay.into_iter().collect(),
                })
                .collect(),
        };
        Ok(Self {
            engines,
            info,
            num_blocks: num_blocks.unwrap_or(1),
            vocab,
            model,
        })
    }

    /// Empty every engine's prefix cache before a policy's run: wait until no request runs,
    /// `POST /reset_prefix_cache` (dev mode), then one short request straight to each engine so
    /// that the `AllBlocksCleared` event (published with the next scheduler step) goes out
    /// before the next picker subscribes.
    pub async fn reset(&self, http: &reqwest::Client) -> anyhow::Result<()> {
        for e in &self.engines {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let idle = match super::fetch(http, &format!("http://{}/metrics", e.http)).await {
                    Some(t) => super::prom::engine_counters(&t)
                        .values()
                        .all(|c| c.running + c.waiting == 0.0),
                    None => false,
                };
                let reset = idle
                    && http
                        .post(format!("http://{}/reset_prefix_cache", e.http))
                        .timeout(Duration::from_secs(10))
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success());
                if reset {
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "{} did not reset its prefix cache within 60 s (log {})",
                    e.http,
                    e.log.display()
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            // fewer tokens than a block: stores nothing, but runs a step
            let body = serde_json::json!({
                "model": MODEL, "prompt": [1000, 1001, 1002], "max_tokens": 1,
            });
            let r = http
                .post(format!("http://{}/v1/completions", e.http))
                .timeout(Duration::from_secs(30))
                .json(&body)
                .send()
                .await
                .with_context(|| format!("flush request to {}", e.http))?;
            anyhow::ensure!(
                r.status().is_success(),
                "flush request to {}: HTTP {}",
                e.http,
                r.status()
            );
        }
        Ok(())
    }

    /// Stop every engine (each process group).
    pub async fn stop(self) {
        for e in self.engines {
            e.stop().await;
        }
    }
}
