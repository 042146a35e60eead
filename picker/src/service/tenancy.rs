//! Tenancy at run time: which tenant a request belongs to, the keyed salt that isolates its
//! cache (`SaltedCache`), and the endpoints it may use (`DedicatedEndpoints`).

use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::Sha256;

use super::errors::ApiError;
use crate::endpoint::Endpoint;
use crate::error::PickerError;
use crate::pool::{Isolation, TenancySpec};

/// Longest tenant name accepted in the tenant header.
pub const MAX_TENANT_BYTES: usize = 253;

/// Tenancy at run time: the spec plus the salt secret.
#[derive(Default)]
pub struct Tenancy {
    pub spec: TenancySpec,
    secret: Vec<u8>,
}

impl std::fmt::Debug for Tenancy {
    /// Never prints the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenancy")
            .field("spec", &self.spec)
            .field("secret_len", &self.secret.len())
            .finish()
    }
}

impl Tenancy {
    pub fn new(spec: TenancySpec) -> Result<Self, PickerError> {
        let secret = match &spec.salt_secret_file {
            Some(p) => Self::read_secret(p)?,
            None => Vec::new(),
        };
        Ok(Self { spec, secret })
    }

    fn read_secret(p: &str) -> Result<Vec<u8>, PickerError> {
        let s =
            std::fs::read(p).map_err(|e| PickerError::read_file("tenancy.saltSecretFile", p, e))?;
        let trimmed = s.trim_ascii().to_vec();
        if trimmed.len() < 16 {
            return Err(PickerError::Invalid(format!(
                "tenancy.saltSecretFile {p}: the secret must be at least 16 bytes"
            )));
        }
        Ok(trimmed)
    }

    /// Re-read the secret file; `Some` with the new tenancy when its content changed (a
    /// rotated Kubernetes Secret is swapped in place under the mount).
    pub fn reloaded(&self) -> Result<Option<Self>, PickerError> {
        let Some(p) = &self.spec.salt_secret_file else {
            return Ok(None);
        };
        let secret = Self::read_secret(p)?;
        if secret == self.secret {
            return Ok(None);
        }
        Ok(Some(Self {
            spec: self.spec.clone(),
            secret,
        }))
    }

    /// The tenant of a request: its header, else the default, else an error when isolation
    /// needs one. A header sent more than once, or whose value is not a plain tenant name, is
    /// an error rather than a guess: a gateway that appends headers (Envoy's default) would
    /// otherwise let a client-supplied first value choose the tenant.
    pub fn tenant_of(&self, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
        let from_header = match self.spec.header.as_deref() {
            Some(name) => {
                let mut values = headers.get_all(name).iter();
                match (values.next(), values.next()) {
                    (None, _) => None,
                    (Some(_), Some(_)) => {
                        return Err(ApiError::bad_request(
                            "invalid_tenant",
                            format!("the tenant header `{name}` must be sent once"),
                        ));
                    }
                    (Some(v), None) => {
                        let v = v
                            .to_str()
                            .ok()
                            .map(str::trim)
                            .filter(|v| v.len() <= MAX_TENANT_BYTES && !v.contains(','))
                            .ok_or_else(|| {
                                ApiError::bad_request(
                                    "invalid_tenant",
                                    format!(
                                        "the tenant header `{name}` must be visible ASCII without \
                                         commas, at most {MAX_TENANT_BYTES} bytes"
                                    ),
                                )
                            })?;
                        (!v.is_empty()).then(|| v.to_owned())
                    }
                }
            }
            None => None,
        };
        match (from_header, &self.spec.default_tenant) {
            (Some(t), _) => Ok(Some(t)),
            (None, Some(d)) => Ok(Some(d.clone())),
            (None, None) if self.spec.isolation == Isolation::None => Ok(None),
            (None, None) => Err(ApiError::bad_request(
                "missing_tenant",
                format!(
                    "missing tenant header `{}`",
                    self.spec.header.as_deref().unwrap_or_default()
                ),
            )),
        }
    }

    /// The keyed salt of a tenant (`SaltedCache`): HMAC-SHA256(secret, tenant), hex. Stable
    /// across restarts and replicas that share the secret; unguessable without it.
    pub fn salt(&self, tenant: Option<&str>) -> Option<String> {
        if self.spec.isolation != Isolation::SaltedCache {
            return None;
        }
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret).ok()?;
        mac.update(tenant.unwrap_or_default().as_bytes());
        let tag = mac.finalize().into_bytes();
        Some(tag.iter().take(16).map(|b| format!("{b:02x}")).collect())
    }

    /// Whether `tenant` may use `endpoint` (`DedicatedEndpoints`).
    pub fn allows(&self, tenant: Option<&str>, endpoint: &Endpoint) -> bool {
        if self.spec.isolation != Isolation::DedicatedEndpoints {
            return true;
        }
        let Some(t) = tenant else { return false };
        self.spec.tenants.iter().any(|ts| {
            ts.name == t
                && ts
                    .pod_selector
                    .iter()
                    .all(|(k, v)| endpoint.labels.get(k) == Some(v))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn salts_are_keyed_stable_and_distinct() {
        let dir = std::env::temp_dir().join(format!("kvroute-salt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let secret = dir.join("secret");
        std::fs::write(&secret, "0123456789abcdef-secret").expect("write");
        let spec = TenancySpec {
            isolation: Isolation::SaltedCache,
            header: Some("x-tenant".into()),
            salt_secret_file: Some(secret.display().to_string()),
            ..TenancySpec::default()
        };
        let t = Tenancy::new(spec.clone()).expect("tenancy");
        let again = Tenancy::new(spec.clone()).expect("tenancy");
        let (a, b) = (t.salt(Some("acme")), t.salt(Some("globex")));
        assert!(a.is_some() && a != b);
        assert_eq!(
            a,
            again.salt(Some("acme")),
            "stable across restarts and replicas"
        );
        std::fs::write(&secret, "another-secret-of-16+").expect("write");
        let rotated = Tenancy::new(spec).expect("tenancy");
        assert_ne!(
            a,
            rotated.salt(Some("acme")),
            "changes when the secret rotates"
        );
        let mut h = HeaderMap::new();
        assert_eq!(
            t.tenant_of(&h).expect_err("required").code,
            "missing_tenant"
        );
        h.insert("x-tenant", "acme".parse().expect("header"));
        assert_eq!(t.tenant_of(&h).expect("tenant").as_deref(), Some("acme"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
