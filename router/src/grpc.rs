//! The `sluice.v1.Generation` gRPC service (`Chat` converts in `chat_grpc`).

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use sluice_proto::v1 as pb;
use sluice_proto::v1::generation_server::Generation;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

use crate::orchestrate::{self, Event, RouterCtx};
use crate::validate::{self, Limits};

pub struct GenerationService {
    pub ctx: Arc<RouterCtx>,
    pub limits: Limits,
}

/// The request id: the client's, else the one the request-id layer put in the headers.
pub fn request_id<T>(given: &str, req: &Request<T>) -> String {
    if !given.is_empty() {
        return given.to_string();
    }
    req.metadata().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("unset").to_string()
}

pub fn to_proto(e: Event) -> pb::GenerateEvent {
    let event = match e {
        Event::Token(t) => pb::generate_event::Event::Token(pb::TokenEvent {
            index: t.index,
            token_id: t.token_id,
            text_delta: t.text,
            logprob: t.logprob,
            top_logprobs: t
                .top
                .into_iter()
                .map(|(id, lp, text)| pb::TopLogprob { token_id: id, logprob: lp, text })
                .collect(),
        }),
        Event::Final { finish, prompt_tokens, cached_tokens, completion_tokens, timings } => {
            pb::generate_event::Event::Final(pb::FinalEvent {
                finish_reason: finish as i32,
                usage: Some(pb::Usage { prompt_tokens, cached_tokens, completion_tokens }),
                timings: Some(pb::Timings {
                    queue_ms: timings.queue_ms,
                    prefill_ms: timings.prefill_ms,
                    kv_transfer_ms: timings.kv_transfer_ms,
                    time_to_first_token_ms: timings.ttft_ms,
                    total_ms: timings.total_ms,
                    prefix_restore_ms: timings.restore_ms,
                }),
            })
        }
    };
    pb::GenerateEvent { event: Some(event) }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;
    type ChatStream = crate::chat_grpc::ChatStream;

    async fn chat(&self, request: Request<pb::ChatRequest>) -> Result<Response<Self::ChatStream>, Status> {
        let id = request_id(&request.get_ref().request_id, &request);
        let metadata = request.metadata().clone();
        let refuse = |s: Status| {
            self.ctx.metrics.outcome(s.code());
            s
        };
        let r = crate::chat_grpc::to_request(request.into_inner()).map_err(refuse)?;
        let plan = crate::chat::convert::plan(r).map_err(|e| refuse(Status::invalid_argument(e.to_string())))?;
        let streams = match crate::chat_run::start(&self.ctx, &self.limits, &plan, &id, &metadata) {
            Ok(s) => s,
            Err(crate::chat_run::Refusal::Invalid { message, .. }) => {
                return Err(refuse(Status::invalid_argument(message)));
            }
            Err(crate::chat_run::Refusal::Status(s)) => return Err(s),
        };
        Ok(Response::new(crate::chat_grpc::events(streams, plan.conversation.thinking)))
    }

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let id = request_id(&request.get_ref().request_id, &request);
        let arrival = orchestrate::arrive(&id, request.metadata());
        let r = request.into_inner();
        let v = match validate::from_proto(&self.ctx.model, &self.limits, r, id) {
            Ok(v) => v,
            Err(m) => return Err(orchestrate::refuse(&self.ctx, &arrival, Status::invalid_argument(m))),
        };
        let events = orchestrate::start(self.ctx.clone(), v, arrival)?;
        let stream = tokio_stream::wrappers::ReceiverStream::new(events).map(|e| e.map(to_proto));
        Ok(Response::new(Box::pin(stream)))
    }
}
