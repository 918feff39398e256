//! Optional API keys (`--api-keys-file`) on both APIs: `/v1/...` HTTP requests must carry
//! `Authorization: Bearer <key>` with a listed key, else 401 in OpenAI's error shape;
//! `sluice.v1.Generation` calls the same in their `authorization` metadata, else
//! UNAUTHENTICATED. `/health`, `/metrics` and gRPC health stay open for probes and
//! scrapers. Refusals count as `unauthenticated` outcomes. Keys are compared in constant
//! time and never logged.

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use cluster::telemetry::RouterMetrics;
use tonic::Status;

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

/// The keys (none: every request passes) and where refusals are counted.
#[derive(Clone)]
pub struct Guard {
    pub keys: Option<ApiKeys>,
    pub metrics: RouterMetrics,
}

/// What a refused caller is told: whether a key was sent decides.
fn refusal(header: Option<&str>, how: &str) -> String {
    match header {
        None => format!("this server needs an API key: send {how}"),
        Some(_) => "the API key is not valid".into(),
    }
}

impl Guard {
    /// `Err(message)` when keys are required and `header` carries none of them.
    fn check(&self, header: Option<&str>, how: &str) -> Result<(), String> {
        match &self.keys {
            Some(keys) if !keys.accepts(header) => {
                self.metrics.outcome(tonic::Code::Unauthenticated);
                Err(refusal(header, how))
            }
            _ => Ok(()),
        }
    }
}

/// gRPC: every `sluice.v1.Generation` call (health checks are a separate service).
impl tonic::service::Interceptor for Guard {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        let header = req.metadata().get("authorization").and_then(|v| v.to_str().ok());
        self.check(header, "`authorization: Bearer <key>` metadata").map_err(Status::unauthenticated)?;
        Ok(req)
    }
}

/// Middleware: refuse `/v1/...` requests without an accepted key.
pub async fn require_key(State(guard): State<Guard>, req: Request, next: Next) -> Response {
    if !req.uri().path().starts_with("/v1/") {
        return next.run(req).await;
    }
    let header = req.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    match guard.check(header, "`Authorization: Bearer <key>`") {
        Ok(()) => next.run(req).await,
        Err(message) => crate::http::error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            message,
            None,
            Some("invalid_api_key"),
        ),
    }
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

    #[test]
    fn grpc_calls_need_a_key_in_their_metadata_and_refusals_are_counted() {
        use tonic::service::Interceptor;
        let registry = cluster::telemetry::metrics::registry("router");
        let metrics = RouterMetrics::new(&registry);
        let mut guard = Guard { keys: ApiKeys::parse("sk-one\n"), metrics: metrics.clone() };
        let call = |guard: &mut Guard, value: Option<&str>| {
            let mut req = tonic::Request::new(());
            if let Some(v) = value {
                req.metadata_mut().insert("authorization", v.parse().unwrap());
            }
            guard.call(req)
        };
        assert!(call(&mut guard, Some("Bearer sk-one")).is_ok());
        let none = call(&mut guard, None).unwrap_err();
        assert_eq!(none.code(), tonic::Code::Unauthenticated);
        assert!(none.message().contains("authorization: Bearer"), "{}", none.message());
        let wrong = call(&mut guard, Some("Bearer sk-two")).unwrap_err();
        assert_eq!(wrong.code(), tonic::Code::Unauthenticated);
        assert!(!wrong.message().contains("sk-"), "keys are never echoed: {}", wrong.message());
        let text = cluster::telemetry::metrics::encode(&registry);
        assert!(text.contains(r#"sluice_requests_total{status="unauthenticated"} 2"#), "{text}");
        // Without keys, everything passes.
        let mut open = Guard { keys: None, metrics };
        assert!(call(&mut open, None).is_ok());
    }
}
