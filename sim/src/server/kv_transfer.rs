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
//! crashed prefill engine's KV cannot be pulled, and the decode then recomputes the prompt or
//! fails, as configured ([`super::KvLoadFailure`]).

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
            let blocks = match p.get("remote_block_ids") {
                Some(Json::Array(ids)) if ids.iter().all(Json::is_u64) => {
                    u32::try_from(ids.len()).unwrap_or(u32::MAX)
                }
                _ => {
                    return Err(
                        "`kv_transfer_params.remote_block_ids` must be an array of block ids"
                            .into(),
                    );
                }
            };
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
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": rank.engine_id,
        "remote_request_id": request_id,
        "remote_num_tokens": prompt_tokens,
        "remote_block_ids": (0..blocks).collect::<Vec<u32>>(),
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
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
                json!({"do_remote_prefill": true, "do_remote_decode": true}),
                "cannot both",
            ),
        ] {
            let e = parse(Some(&p)).expect_err("refused");
            assert!(e.contains(field), "{e}");
        }
    }
}
