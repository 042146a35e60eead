//! A NIXL-style KV connector between the engines of one simulator process, speaking vLLM's
//! `kv_transfer_params` handshake:
//!
//! 1. A request whose `kv_transfer_params` say `do_remote_decode: true` (the prefill step,
//!    sent with one output token, not streamed) runs as usual; its answer carries
//!    `kv_transfer_params` naming this rank (`remote_engine_id`, `remote_host`, `remote_port`)
//!    and the prompt's blocks (`remote_block_ids`), with `do_remote_prefill: true`.
//! 2. A request carrying those (the decode step) pulls the prompt's KV from that rank
//!    instead of prefilling it: the leading blocks the remote rank still holds, minus those
//!    this rank's own cache holds, at the configured transfer cost
//!    ([`crate::engine::Request::remote_blocks`]).
//!
//! A rank is found by its engine id, which is new for every incarnation: a restarted or
//! crashed prefill engine's KV cannot be pulled, and the decode then fails (vLLM 0.32's
//! default `kv_load_failure_policy`) or recomputes the prompt, as configured
//! ([`super::KvLoadFailure`]). The answer's fields and shapes are those a real vLLM 0.32 CPU
//! engine with the NixlConnector sends (checked on one: docs/real-engines.md).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};

use parking_lot::Mutex;
use serde_json::{Value as Json, json};

use super::rank::RankState;

/// The ranks of this process by engine id (dead ones pruned as new ones register).
static PEERS: LazyLock<Mutex<HashMap<String, Weak<RankState>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
static NEXT_ENGINE: AtomicU64 = AtomicU64::new(0);

/// A new engine id for rank `rank` of engine `index`, unique in this process.
pub(crate) fn new_engine_id(index: usize, rank: u32) -> String {
    let n = NEXT_ENGINE.fetch_add(1, Ordering::Relaxed);
    format!("sim-{}-{n}-e{index}-dp{rank}", std::process::id())
}

/// Make `rank` reachable under its engine id.
pub(crate) fn register(rank: &Arc<RankState>) {
    let mut peers = PEERS.lock();
    peers.retain(|_, w| w.strong_count() > 0);
    peers.insert(rank.engine_id.clone(), Arc::downgrade(rank));
}

/// The rank with engine id `id`, while it runs.
pub(crate) fn peer(id: &str) -> Option<Arc<RankState>> {
    PEERS.lock().get(id).and_then(Weak::upgrade)
}

/// What a request's `kv_transfer_params` ask of this engine.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) enum KvTransfer {
    /// No parameters (or no connector): an ordinary request.
    #[default]
    None,
    /// The prefill step of a split request: answer with the parameters to pull its KV.
    RemoteDecode,
    /// The decode step: pull the prompt's KV from `engine_id`, at most `blocks` blocks.
    RemotePrefill { engine_id: String, blocks: u32 },
}

/// Read a request's `kv_transfer_params` (`None`/`null`: none).
///
/// # Errors
/// A message naming the field that is not what vLLM's connector expects.
pub(crate) fn parse(params: Option<&Json>) -> Result<KvTransfer, String> {
    let p = match params {
        None | Some(Json::Null) => return Ok(KvTransfer::None),
        Some(Json::Object(p)) => p,
        Some(_) => return Err("`kv_transfer_params` must be an object".into()),
    };
    let flag = |k: &str| match p.get(k) {
        None | Some(Json::Null) => Ok(false),
        Some(Json::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("`kv_transfer_params.{k}` must be a boolean")),
    };
    let (decode, prefill) = (flag("do_remote_decode")?, flag("do_remote_prefill")?);
    match (decode, prefill) {
        (true, true) => Err(
            "`kv_transfer_params`: do_remote_decode and do_remote_prefill cannot both be true"
                .into(),
        ),
        (true, false) => Ok(KvTransfer::RemoteDecode),
        (false, false) => Ok(KvTransfer::None),
        (false, true) => {
            let engine_id = match p.get("remote_engine_id") {
                Some(Json::String(s)) if !s.is_empty() => s.clone(),
                _ => {
                    return Err(
                        "`kv_transfer_params.remote_engine_id` must be a non-empty string".into(),
                    );
                }
            };
            // vLLM 0.32 sends one list per KV-cache group (`[[1, 2, 3]]`); earlier versions
            // one flat list
            let blocks = match p.get("remote_block_ids") {
                Some(Json::Array(ids)) if ids.iter().all(Json::is_u64) => ids.len(),
                Some(Json::Array(groups))
                    if !groups.is_empty()
                        && groups
                            .iter()
                            .all(|g| g.as_array().is_some_and(|g| g.iter().all(Json::is_u64))) =>
                {
                    groups
                        .iter()
                        .filter_map(Json::as_array)
                        .map(Vec::len)
                        .max()
                        .unwrap_or(0)
                }
                _ => {
                    return Err(
                        "`kv_transfer_params.remote_block_ids` must be a list of block ids, or \
                         one per KV-cache group"
                            .into(),
                    );
                }
            };
            let blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
            Ok(KvTransfer::RemotePrefill { engine_id, blocks })
        }
    }
}

/// The `kv_transfer_params` a prefill step answers with: `rank`'s engine id and address, and
/// one id per block of a `prompt_tokens`-token prompt in blocks of `block_size`.
pub(crate) fn answer(
    rank: &RankState,
    request_id: &str,
    (host, port): (&str, u16),
    prompt_tokens: u32,
    block_size: u32,
) -> Json {
    let blocks = prompt_tokens.div_ceil(block_size.max(1));
    // the fields and shapes of vLLM 0.32's NIXL connector (pull mode), block ids per
    // KV-cache group
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": [(1..=blocks).collect::<Vec<u32>>()],
        "remote_engine_id": rank.engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt_tokens,
        "remote_blocks_expiry_time": null,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_parse_into_the_step_they_ask_for() {
        assert_eq!(parse(None), Ok(KvTransfer::None));
        assert_eq!(parse(Some(&Json::Null)), Ok(KvTransfer::None));
        assert_eq!(
            parse(Some(
                &json!({"do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null})
            )),
            Ok(KvTransfer::RemoteDecode)
        );
        assert_eq!(
            parse(Some(
                &json!({"do_remote_prefill": true, "remote_engine_id": "e",
                "remote_block_ids": [3, 4, 5], "remote_host": "h", "remote_port": 1})
            )),
            Ok(KvTransfer::RemotePrefill {
                engine_id: "e".into(),
                blocks: 3
            })
        );
        // vLLM 0.32's answer, as a real engine sent it (one list per KV-cache group)
        let real = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]],
            "remote_engine_id": "5cfb54a9-9037-4765-8c88-53171304b4c1",
            "remote_request_id": "cmpl-9174d78096002899-0-990a1f12", "remote_host": "127.0.0.1",
            "remote_port": 5601, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": 300, "remote_blocks_expiry_time": null,
            "transfer_mode": "pull", "remote_prefill_cached_tokens": 0});
        assert_eq!(
            parse(Some(&real)),
            Ok(KvTransfer::RemotePrefill {
                engine_id: "5cfb54a9-9037-4765-8c88-53171304b4c1".into(),
                blocks: 10
            })
        );
    }

    #[test]
    fn bad_parameters_name_the_field() {
        for (p, field) in [
            (json!([1]), "kv_transfer_params"),
            (json!({"do_remote_decode": "yes"}), "do_remote_decode"),
            (
                json!({"do_remote_prefill": true, "remote_block_ids": []}),
                "remote_engine_id",
            ),
            (
                json!({"do_remote_prefill": true, "remote_engine_id": "e"}),
                "remote_block_ids",
            ),
            (
                json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_block_ids": [[1], "x"]}),
                "remote_block_ids",
            ),
            (
                json!({"do_remote_prefill": true, "do_remote_decode": true}),
                "cannot both",
            ),
        ] {
            let e = parse(Some(&p)).expect_err("refused");
            assert!(e.contains(field), "{e}");
        }
    }
}
