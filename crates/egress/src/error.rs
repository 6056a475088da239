use std::io;

/// A configuration or policy the server must refuse (at startup, or as a 400 on a create).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{place}: wildcard domain \"{entry}\" is not supported; list each exact name")]
    Wildcard { place: String, entry: String },
    #[error("{place}: {list} entry \"{entry}\" is malformed: {reason}")]
    Malformed {
        place: String,
        list: String,
        entry: String,
        reason: String,
    },
    #[error("{what} is not valid JSON of the expected shape: {reason}")]
    Json { what: String, reason: String },
    #[error("egress profile name \"{0}\" must be 1-64 of a-z, 0-9, '-', '_'")]
    ProfileName(String),
    #[error("unknown egress profile \"{0}\"")]
    UnknownProfile(String),
}

/// Resolving a name through the upstream resolver.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("upstream resolver did not answer within {0:?}")]
    Timeout(std::time::Duration),
    #[error("name does not exist")]
    NxDomain,
    #[error("upstream answered {0}")]
    Upstream(String),
    #[error("upstream answer is malformed: {0}")]
    Malformed(String),
    #[error("upstream i/o: {0}")]
    Io(#[from] io::Error),
}

/// Reading the resolver configuration.
#[derive(Debug, thiserror::Error)]
pub enum ResolvConfError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("{path} names no nameserver")]
    NoNameserver { path: String },
}
