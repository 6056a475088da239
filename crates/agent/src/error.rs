use airlock_proto::{ErrorBody, ErrorCode};

/// Every failure the agent reports, carried to the host as `{code, message}`.
#[derive(Debug)]
pub struct AgentError {
    pub code: ErrorCode,
    pub message: String,
}

impl AgentError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(m: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, m)
    }
    pub fn permission(m: impl Into<String>) -> Self {
        Self::new(ErrorCode::PermissionDenied, m)
    }
    pub fn internal(m: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, m)
    }
    /// An I/O error on `path`, with the path in the message.
    pub fn io(path: &str, e: std::io::Error) -> Self {
        // A symlink where none is followed (a volume's access path: `MS_NOSYMFOLLOW`).
        if e.raw_os_error() == Some(libc::ELOOP) {
            return Self::new(ErrorCode::PermissionDenied, format!("{path}: {e}"));
        }
        let code = match e.kind() {
            std::io::ErrorKind::NotFound => ErrorCode::NotFound,
            std::io::ErrorKind::AlreadyExists => ErrorCode::AlreadyExists,
            std::io::ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
            std::io::ErrorKind::NotADirectory => ErrorCode::NotADirectory,
            std::io::ErrorKind::IsADirectory => ErrorCode::IsADirectory,
            std::io::ErrorKind::InvalidInput => ErrorCode::InvalidArgument,
            _ => ErrorCode::Internal,
        };
        Self::new(code, format!("{path}: {e}"))
    }
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.code,
            message: self.message.clone(),
        }
    }
}

impl From<std::io::Error> for AgentError {
    fn from(e: std::io::Error) -> Self {
        Self::io("io", e)
    }
}
