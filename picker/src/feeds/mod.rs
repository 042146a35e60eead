pub mod kv_subscriber;
