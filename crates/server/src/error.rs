//! The error body every door's JSON errors and every failed operation record carry.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Error body of every non-2xx response.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
pub struct ErrorBody {
    /// snake_case error code, stable across versions.
    pub code: String,
    /// Human-readable explanation, naming the field or the fix.
    pub message: String,
}
