//! The `sluice.v1.Decode` gRPC service: a thin adapter that forwards each call to the
//! engine thread and maps the answer to a gRPC status. Reserve, commit and decode
//! continue their caller's trace (`decode.reserve`, `decode.commit`, `decode` spans; a
//! migrated request's `decode` span says how many tokens it resumed after).

use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use cluster::telemetry::propagation;
use sluice_proto::v1 as pb;
use sluice_proto::v1::decode_server::Decode;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use tracing::field::Empty;
use transfer::Target;

use crate::engine_loop::Command;
use crate::memory::TargetTemplate;

/// Longest an RPC waits for the engine thread (it answers between decode steps).
const ENGINE_REPLY_TIMEOUT: Duration = Duration::from_secs(10);

pub struct DecodeService {
    pub engine: std_mpsc::Sender<Command>,
    pub template: TargetTemplate,
    pub lease: Duration,
    pub debug_hooks: bool,
    /// Most tokens one request may ask for (prompt + completion ≤ context).
    pub max_position: usize,
}

impl DecodeService {
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (tx, rx) = oneshot::channel();
        self.engine.send(make(tx)).map_err(|_| Status::unavailable("decode engine stopped"))?;
        match tokio::time::timeout(ENGINE_REPLY_TIMEOUT, rx).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(_)) => Err(Status::unavailable("decode engine stopped")),
            Err(_) => Err(Status::unavailable("decode engine did not answer in time")),
        }
    }

    /// Check a reservation request and take pages and a slot for it.
    async fn do_reserve(&self, r: pb::ReserveRequest) -> Result<Response<pb::Reservation>, Status> {
        let ours = self.template.geometry.fingerprint.hex();
        if !r.fingerprint.is_empty() && r.fingerprint != ours {
            return Err(Status::failed_precondition(format!(
                "this decode worker serves model fingerprint {}, the request expects {}",
                &ours[..12],
                r.fingerprint.get(..12).unwrap_or(&r.fingerprint)
            )));
        }
        let (prompt, max) = (r.prompt_tokens as usize, r.max_tokens as usize);
        if prompt == 0 || max == 0 || prompt + max > self.max_position {
            return Err(Status::invalid_argument(format!(
                "cannot reserve {prompt} prompt + {max} new tokens (each at least 1, together at most {})",
                self.max_position
            )));
        }
        let reserved = self
            .ask(|reply| Command::Reserve {
                request_id: r.request_id.clone(),
                prompt_tokens: prompt,
                max_tokens: max,
                reply,
            })
            .await??;
        let t = &self.template;
        // The regions of the device holding the reservation; ids relative to them (the
        // same as the global ids when one region holds every page).
        let part = t.part(reserved.device as usize);
        let target = Target {
            geometry: t.geometry.clone(),
            ucx_address: t.ucx_address.clone(),
            pages: part.pages.clone(),
            rings: part.rings.clone(),
            comp: part.comp.clone(),
            logits: t.logits_for(part),
            page_ids: reserved.page_ids.iter().map(|&p| p - part.first_page).collect(),
            slot: reserved.slot - part.first_slot,
        };
        Ok(Response::new(pb::Reservation {
            reservation_id: reserved.id,
            lease_ms: self.lease.as_millis() as u64,
            target: Some(target.to_proto()),
            device: reserved.device,
        }))
    }
}

#[tonic::async_trait]
impl Decode for DecodeService {
    async fn reserve(&self, request: Request<pb::ReserveRequest>) -> Result<Response<pb::Reservation>, Status> {
        let span = tracing::info_span!(
            "decode.reserve",
            request_id = %request.get_ref().request_id,
            prompt_tokens = request.get_ref().prompt_tokens,
            max_tokens = request.get_ref().max_tokens,
        );
        propagation::set_parent(&span, request.metadata());
        self.do_reserve(request.into_inner()).instrument(span).await
    }

    async fn commit(&self, request: Request<pb::CommitRequest>) -> Result<Response<pb::CommitReply>, Status> {
        let span = tracing::info_span!(
            "decode.commit",
            reservation_id = %request.get_ref().reservation_id,
            tokens = request.get_ref().tokens,
        );
        propagation::set_parent(&span, request.metadata());
        let req = request.into_inner();
        self.ask(|reply| Command::Commit { req, reply }).instrument(span).await??;
        Ok(Response::new(pb::CommitReply {}))
    }

    async fn release(&self, request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseReply>, Status> {
        let r = request.into_inner();
        self.ask(|reply| Command::Release { id: r.reservation_id, writer_done: r.writer_done, reply }).await??;
        Ok(Response::new(pb::ReleaseReply {}))
    }

    type DecodeStream = UnboundedReceiverStream<Result<pb::DecodeEvent, Status>>;

    async fn decode(&self, request: Request<pb::DecodeRequest>) -> Result<Response<Self::DecodeStream>, Status> {
        // Open until the request's last token is sent (or it fails, or the client goes).
        let span = tracing::info_span!(
            "decode",
            request_id = %request.get_ref().request_id,
            resumed_tokens = request.get_ref().resumed_tokens.len(),
            completion_tokens = Empty,
            finish = Empty,
            otel.status_code = Empty,
            otel.status_message = Empty,
        );
        propagation::set_parent(&span, request.metadata());
        let (tx, rx) = mpsc::unbounded_channel();
        self.engine
            .send(Command::Decode { req: request.into_inner(), events: tx, span })
            .map_err(|_| Status::unavailable("decode engine stopped"))?;
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn load(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::DecodeLoad>, Status> {
        Ok(Response::new(self.ask(|reply| Command::Load { reply }).await?))
    }

    async fn dump_kv(&self, request: Request<pb::DumpKvRequest>) -> Result<Response<pb::KvDump>, Status> {
        if !self.debug_hooks {
            return Err(Status::permission_denied("DumpKv is a test hook; start the worker with --debug-hooks"));
        }
        let id = request.into_inner().reservation_id;
        Ok(Response::new(self.ask(|reply| Command::Dump { id, reply }).await??))
    }
}
