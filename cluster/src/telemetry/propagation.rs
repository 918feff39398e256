//! W3C trace context (`traceparent`, `tracestate`) across gRPC hops, so one request is
//! one trace: a client injects the current span's context into the request metadata
//! ([`PropagateContext`] does it for every call of a client), a server extracts it and
//! parents its spans on it ([`set_parent`]).
//!
//! The format is always W3C trace context, whatever global propagator is installed.
//! Without an OTLP exporter, spans carry no OpenTelemetry context and nothing is
//! injected, so a request simply starts no trace.

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{KeyRef, MetadataKey, MetadataMap, MetadataValue};
use tonic::service::Interceptor;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Writes propagation fields into gRPC metadata.
pub struct MetadataInjector<'a>(pub &'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (MetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(value.as_str())) {
            self.0.insert(k, v);
        }
    }
}

/// Reads propagation fields from gRPC metadata.
pub struct MetadataExtractor<'a>(pub &'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                KeyRef::Ascii(k) => Some(k.as_str()),
                KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Write `cx` (its span context) into `metadata`.
pub fn inject(cx: &Context, metadata: &mut MetadataMap) {
    TraceContextPropagator::new().inject_context(cx, &mut MetadataInjector(metadata));
}

/// The context a caller sent in `metadata` (an empty one when it sent none).
pub fn extract(metadata: &MetadataMap) -> Context {
    TraceContextPropagator::new().extract(&MetadataExtractor(metadata))
}

/// Parent `span` on the context a caller sent (before `span` is first entered). A
/// request without a context leaves `span` a root.
pub fn set_parent(span: &tracing::Span, metadata: &MetadataMap) {
    set_parent_context(span, extract(metadata));
}

/// Parent `span` on `cx` (e.g. a context carried to another thread with its job).
pub fn set_parent_context(span: &tracing::Span, cx: Context) {
    // Fails only when tracing is not exported (no layer, or the span is filtered out),
    // and then there is no parent to keep.
    let _ = span.set_parent(cx);
}

/// A client interceptor that sends the current span's context with every call. Calls
/// made outside any span (load polls, health checks) send none and start no trace.
#[derive(Clone, Copy, Debug, Default)]
pub struct PropagateContext;

impl Interceptor for PropagateContext {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        inject(&tracing::Span::current().context(), request.metadata_mut());
        Ok(request)
    }
}

/// A gRPC client channel that propagates trace context.
pub type Traced<T> = tonic::service::interceptor::InterceptedService<T, PropagateContext>;

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider};
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    fn remote(trace: u128, span: u64) -> Context {
        Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from(trace),
            SpanId::from(span),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        ))
    }

    #[test]
    fn inject_then_extract_round_trips() {
        let cx = remote(0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331);
        let mut md = MetadataMap::new();
        inject(&cx, &mut md);
        assert_eq!(
            md.get("traceparent").unwrap().to_str().unwrap(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
        let back = extract(&md);
        let (a, b) = (cx.span().span_context().clone(), back.span().span_context().clone());
        assert_eq!((a.trace_id(), a.span_id(), a.trace_flags()), (b.trace_id(), b.span_id(), b.trace_flags()));
        assert!(b.is_remote());
    }

    #[test]
    fn no_context_sends_and_finds_nothing() {
        let mut md = MetadataMap::new();
        inject(&Context::new(), &mut md);
        assert!(md.get("traceparent").is_none());
        assert!(!extract(&md).span().span_context().is_valid());
        md.insert("traceparent", "garbage".parse().unwrap());
        assert!(!extract(&md).span().span_context().is_valid(), "a malformed header is ignored");
    }

    /// Through tracing: a server span parented on an incoming context continues its
    /// trace, and the interceptor sends that span onwards as the next parent.
    #[test]
    fn spans_continue_the_incoming_trace_and_the_interceptor_passes_it_on() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber =
            tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let mut incoming = MetadataMap::new();
            inject(&remote(42, 7), &mut incoming);
            let span = tracing::info_span!("server");
            set_parent(&span, &incoming);
            let outgoing = span.in_scope(|| PropagateContext.call(tonic::Request::new(())).unwrap());
            let sent = extract(outgoing.metadata());
            let sc = sent.span().span_context().clone();
            assert_eq!(sc.trace_id(), TraceId::from(42u128), "same trace");
            assert_ne!(sc.span_id(), SpanId::from(7u64), "the server span is the next parent");
            assert_eq!(sc.span_id(), span.context().span().span_context().span_id());

            // Outside any span: nothing is sent.
            let bare = PropagateContext.call(tonic::Request::new(())).unwrap();
            assert!(bare.metadata().get("traceparent").is_none());
        });
    }
}
