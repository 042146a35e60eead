//! The local control plane's PKI: one CA that signs the API server's serving certificate and
//! the client certificates (admin, controller manager), plus the service-account signing key.
//! ECDSA P-256 throughout: fast to generate, accepted by the API server for both TLS and
//! service-account tokens.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// Paths of the PEM files written by [`Pki::write`].
#[derive(Debug, Clone)]
pub struct Pki {
    pub ca_cert: PathBuf,
    pub serving_cert: PathBuf,
    pub serving_key: PathBuf,
    pub admin_cert: PathBuf,
    pub admin_key: PathBuf,
    pub controller_manager_cert: PathBuf,
    pub controller_manager_key: PathBuf,
    /// The API server's client identity towards aggregated API servers.
    pub front_proxy_cert: PathBuf,
    pub front_proxy_key: PathBuf,
    /// Signs service-account tokens (the API server and the controller manager).
    pub service_account_key: PathBuf,
    /// Verifies them.
    pub service_account_pub: PathBuf,
    pub ca_pem: String,
}

fn write(path: &Path, contents: &str) -> anyhow::Result<()> {
    std::fs::write(path, contents).with_context(|| format!("cannot write {}", path.display()))
}

fn client_cert(
    dir: &Path,
    name: &str,
    common_name: &str,
    organization: Option<&str>,
    ca: &Issuer<'_, KeyPair>,
) -> anyhow::Result<(PathBuf, PathBuf)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    if let Some(o) = organization {
        params.distinguished_name.push(DnType::OrganizationName, o);
    }
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, ca)?;
    let (c, k) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
    );
    write(&c, &cert.pem())?;
    write(&k, &key.serialize_pem())?;
    Ok((c, k))
}

impl Pki {
    /// Generate everything into `dir`. `serving_ips` become IP SANs of the serving cert.
    pub fn write(dir: &Path, serving_ips: &[IpAddr]) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "kvroute-e2e-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let ca_pem = ca_cert.pem();
        let ca = Issuer::new(ca_params, ca_key);

        let serving_key = KeyPair::generate()?;
        let mut names: Vec<String> = [
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ]
        .map(String::from)
        .to_vec();
        names.extend(serving_ips.iter().map(IpAddr::to_string));
        let mut serving = CertificateParams::new(names)?;
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert = serving.signed_by(&serving_key, &ca)?;

        let pki = Self {
            ca_cert: dir.join("ca.crt"),
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            admin_cert: PathBuf::new(),
            admin_key: PathBuf::new(),
            controller_manager_cert: PathBuf::new(),
            controller_manager_key: PathBuf::new(),
            front_proxy_cert: PathBuf::new(),
            front_proxy_key: PathBuf::new(),
            service_account_key: dir.join("service-account.key"),
            service_account_pub: dir.join("service-account.pub"),
            ca_pem: ca_pem.clone(),
        };
        write(&pki.ca_cert, &ca_pem)?;
        write(&pki.serving_cert, &serving_cert.pem())?;
        write(&pki.serving_key, &serving_key.serialize_pem())?;
        let sa_key = KeyPair::generate()?;
        write(&pki.service_account_key, &sa_key.serialize_pem())?;
        write(&pki.service_account_pub, &sa_key.public_key_pem())?;
        // system:masters: the admin bypasses authorization, like kubeadm's admin.conf
        let (admin_cert, admin_key) = client_cert(
            dir,
            "admin",
            "kvroute-e2e-admin",
            Some("system:masters"),
            &ca,
        )?;
        // the controller manager's own identity, which the API server's bootstrap RBAC knows
        let (cm_cert, cm_key) = client_cert(
            dir,
            "controller-manager",
            "system:kube-controller-manager",
            None,
            &ca,
        )?;
        let (front_proxy_cert, front_proxy_key) =
            client_cert(dir, "front-proxy-client", "front-proxy-client", None, &ca)?;
        Ok(Self {
            front_proxy_cert,
            front_proxy_key,
            admin_cert,
            admin_key,
            controller_manager_cert: cm_cert,
            controller_manager_key: cm_key,
            ..pki
        })
    }
}
