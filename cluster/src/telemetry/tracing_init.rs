//! The process's tracing subscriber: logs to stderr (text, or JSON lines with
//! `SLUICE_LOG_FORMAT=json`) filtered by `RUST_LOG` (default `info`), and — when an OTLP endpoint is
//! configured — spans exported as OpenTelemetry traces over OTLP/gRPC.
//!
//! Export is configured the standard OpenTelemetry way, by environment:
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns it on,
//! `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` name the service, `OTEL_BSP_*` tune
//! batching, `OTEL_TRACES_SAMPLER[_ARG]` sampling, `OTEL_EXPORTER_OTLP_HEADERS` /
//! `_TIMEOUT` / `_COMPRESSION` the exporter; `OTEL_SDK_DISABLED=true` or
//! `OTEL_TRACES_EXPORTER=none` turn it off. `SLUICE_TRACE_FILTER` (RUST_LOG syntax,
//! default `info`) picks the spans exported, independently of what is logged.
//!
//! The batch exporter sends from its own thread through a tonic channel driven by the
//! tokio runtime, so [`init`] must run inside a multi-threaded runtime, and spans still
//! buffered are flushed when the returned [`TracingGuard`] is dropped or shut down.

use std::io::IsTerminal;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use super::TelemetryError;

/// Longest the exit waits for buffered spans to be sent (a collector that does not
/// answer must not hold up a pod's termination).
const FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Keeps trace export alive; dropping it flushes the spans not yet sent.
pub struct TracingGuard {
    provider: Option<SdkTracerProvider>,
}

impl TracingGuard {
    /// Whether spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flush and stop the exporter (also done on drop).
    pub fn shutdown(mut self) {
        self.flush();
    }

    fn flush(&mut self) {
        let Some(provider) = self.provider.take() else { return };
        let stop = move || {
            if let Err(e) = provider.shutdown_with_timeout(FLUSH_TIMEOUT) {
                eprintln!("warning: flushing traces at exit: {e}");
            }
        };
        // The exporter's channel needs the runtime running while this thread waits.
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(stop),
            _ => stop(),
        }
    }
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        self.flush();
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// Whether the environment asks for OTLP trace export.
pub fn export_configured() -> bool {
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return false;
    }
    if env("OTEL_TRACES_EXPORTER").is_some_and(|v| !v.split(',').any(|e| e.trim() == "otlp")) {
        return false;
    }
    env("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() || env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
}

/// The resource every span carries: `service.name` is `service` unless
/// `OTEL_SERVICE_NAME` (or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`) says otherwise.
fn resource(service: &str) -> Resource {
    let named_by_env = env("OTEL_SERVICE_NAME").is_some()
        || env("OTEL_RESOURCE_ATTRIBUTES")
            .is_some_and(|a| a.split(',').any(|kv| kv.trim().starts_with("service.name=")));
    resource_named(service, named_by_env)
}

fn resource_named(service: &str, named_by_env: bool) -> Resource {
    let mut b = Resource::builder().with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    if !named_by_env {
        b = b.with_service_name(service.to_string());
    }
    b.build()
}

fn provider(service: &str) -> Result<SdkTracerProvider, TelemetryError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource(service)).build())
}

/// Install the subscriber for a process named `service` (`router`, `prefill-worker`,
/// `decode-worker`): logs always, OTLP trace export when configured.
pub fn init(service: &str) -> Result<TracingGuard, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let provider = if export_configured() { Some(provider(service)?) } else { None };

    let log_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // JSON lines carry the fields of every enclosing span (the request's `request_id`
    // among them); colours only on a terminal, not in log files or pod logs.
    let logs = match env("SLUICE_LOG_FORMAT").as_deref() {
        Some("json") => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(false)
            .with_span_list(true)
            .with_writer(std::io::stderr)
            .with_filter(log_filter)
            .boxed(),
        _ => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .with_filter(log_filter)
            .boxed(),
    };
    let traces = provider.as_ref().map(|p| {
        let filter = env("SLUICE_TRACE_FILTER").map(EnvFilter::new).unwrap_or_else(|| EnvFilter::new("info"));
        tracing_opentelemetry::layer().with_tracer(p.tracer("sluice")).with_filter(filter)
    });
    tracing_subscriber::registry()
        .with(traces)
        .with(logs)
        .try_init()
        .map_err(|e| TelemetryError::Subscriber(e.to_string()))?;

    if provider.is_some() {
        let protocol = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"));
        if let Some(p) = protocol.filter(|p| p != "grpc") {
            tracing::warn!(protocol = %p, "only OTLP over gRPC is supported; exporting traces with grpc");
        }
        let endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"));
        tracing::info!(endpoint = endpoint.unwrap_or_default(), "exporting traces over OTLP/gRPC");
    }
    Ok(TracingGuard { provider })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_name_is_ours_unless_the_environment_names_it() {
        let get = |r: &Resource, k: &'static str| r.get(&opentelemetry::Key::new(k)).map(|v| v.to_string());
        let ours = resource_named("prefill-worker", false);
        assert_eq!(get(&ours, "service.name").as_deref(), Some("prefill-worker"));
        assert_eq!(get(&ours, "service.version").as_deref(), Some(env!("CARGO_PKG_VERSION")));
        // Named by the environment: the SDK's detectors set it (here: unset, so the default).
        let env_named = resource_named("prefill-worker", true);
        assert_ne!(get(&env_named, "service.name").as_deref(), Some("prefill-worker"));
    }
}
