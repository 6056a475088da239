//! TLS on the node face, mutual: a node (`airlock node --tls-cert --tls-key --tls-ca`) serves
//! with a certificate of the cluster's CA and takes only callers presenting one; a replica
//! (`serve --node-tls-cert --node-tls-key --node-tls-ca`) presents its own and takes only a node
//! whose certificate is of that CA.
//!
//! Replicas reach nodes by address (a pod's IP changes with every restart), so a node's
//! certificate is checked for one fixed name, [`NODE_TLS_NAME`], not for its address: the CA
//! says "a node of this cluster", and which node is the signatures' business (every call is
//! signed for the node's name, `wire.rs`). The usual key usages keep the two kinds apart: a
//! node's certificate must allow `serverAuth`, a caller's `clientAuth`, so a node's own
//! certificate does not make it a caller of the other nodes unless the CA says so.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The name every node's certificate carries (a DNS SAN), and replicas check it for.
pub const NODE_TLS_NAME: &str = "airlock-node";

/// A side's certificate chain and key, and the cluster CA it checks the other side against
/// (PEM files).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        anyhow::bail!("{}: no PEM certificate in it", path.display());
    }
    Ok(certs)
}

fn key(path: &Path) -> anyhow::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

fn roots(ca: &Path) -> anyhow::Result<Arc<rustls::RootCertStore>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs(ca)? {
        roots
            .add(cert)
            .map_err(|e| anyhow::anyhow!("{}: not a CA certificate: {e}", ca.display()))?;
    }
    Ok(Arc::new(roots))
}

/// A node's: its certificate, and a caller's required, of the CA.
pub fn server_config(files: &TlsFiles) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots(&files.ca)?, provider())
        .build()
        .map_err(|e| anyhow::anyhow!("--tls-ca {}: {e}", files.ca.display()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(&files.cert)?, key(&files.key)?)
        .map_err(|e| {
            anyhow::anyhow!(
                "--tls-cert {} with --tls-key {}: {e}",
                files.cert.display(),
                files.key.display()
            )
        })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// A replica's: its certificate presented, the node's checked against the CA for
/// [`NODE_TLS_NAME`].
pub fn client_config(files: &TlsFiles) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(&files.ca)?)
        .with_client_auth_cert(certs(&files.cert)?, key(&files.key)?)
        .map_err(|e| {
            anyhow::anyhow!(
                "--node-tls-cert {} with --node-tls-key {}: {e}",
                files.cert.display(),
                files.key.display()
            )
        })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// The name a node's certificate is checked for.
pub fn node_server_name() -> ServerName<'static> {
    ServerName::try_from(NODE_TLS_NAME).expect("a valid DNS name")
}

/// What a replica reaches nodes with: the cluster secret its calls are signed with, and its
/// TLS (None: plain HTTP, for one host and tests).
#[derive(Clone)]
pub struct NodeLink {
    pub secret: Arc<[u8]>,
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl NodeLink {
    pub fn new(secret: &[u8], tls: Option<Arc<rustls::ClientConfig>>) -> Self {
        NodeLink {
            secret: Arc::from(secret),
            tls,
        }
    }
}

impl From<&[u8]> for NodeLink {
    fn from(secret: &[u8]) -> Self {
        NodeLink::new(secret, None)
    }
}

impl From<&NodeLink> for NodeLink {
    fn from(link: &NodeLink) -> Self {
        link.clone()
    }
}

impl<const N: usize> From<&[u8; N]> for NodeLink {
    fn from(secret: &[u8; N]) -> Self {
        NodeLink::new(secret, None)
    }
}
