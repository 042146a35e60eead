pub mod kv_subscriber;
pub mod zmtp_guard;
