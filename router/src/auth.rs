//! Optional API keys on the HTTP API (`--api-keys-file`): `/v1/...` requests must carry
//! `Authorization: Bearer <key>` with a listed key, else 401 in OpenAI's error shape.
//! `/health` and `/metrics` stay open for probes and scrapers. Keys are compared in
//! constant time and never logged.

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;

/// The accepted keys.
#[derive(Clone)]
pub struct ApiKeys(Arc<Vec<Vec<u8>>>);

impl ApiKeys {
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("--api-keys-file {}: {e}", path.display()))?;
        Self::parse(&text).ok_or_else(|| format!("--api-keys-file {}: no keys in it", path.display()))
    }

    pub fn parse(text: &str) -> Option<Self> {
        let keys: Vec<Vec<u8>> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| l.as_bytes().to_vec())
            .collect();
        (!keys.is_empty()).then(|| ApiKeys(Arc::new(keys)))
    }

    /// Whether `header` (the `Authorization` value) carries an accepted key.
    pub fn accepts(&self, header: Option<&str>) -> bool {
        let Some(given) = header.and_then(|h| h.strip_prefix("Bearer ")).map(str::trim) else {
            return false;
        };
        // Every key is compared whole, so timing does not reveal how much of one matched.
        self.0.iter().fold(false, |hit, k| hit | constant_time_eq(k, given.as_bytes()))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Middleware: refuse `/v1/...` requests without an accepted key.
pub async fn require_key(State(keys): State<ApiKeys>, req: Request, next: Next) -> Response {
    if !req.uri().path().starts_with("/v1/") {
        return next.run(req).await;
    }
    let header = req.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    if keys.accepts(header) {
        return next.run(req).await;
    }
    let message = if header.is_none() {
        "this server needs an API key: send `Authorization: Bearer <key>`"
    } else {
        "the API key is not valid"
    };
    crate::http::error(StatusCode::UNAUTHORIZED, "invalid_request_error", message, None, Some("invalid_api_key"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listed_bearer_keys_pass() {
        let keys = ApiKeys::parse("# team keys\nsk-one\n\n  sk-two  \n").unwrap();
        assert!(keys.accepts(Some("Bearer sk-one")));
        assert!(keys.accepts(Some("Bearer sk-two")));
        for bad in
            [None, Some("sk-one"), Some("Bearer sk-on"), Some("Bearer sk-one1"), Some("Basic sk-one"), Some("Bearer ")]
        {
            assert!(!keys.accepts(bad), "{bad:?}");
        }
        assert!(ApiKeys::parse("# nothing\n\n").is_none());
    }
}
