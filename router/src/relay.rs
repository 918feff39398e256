//! What a request has streamed to its client, kept for its whole life: the token ids
//! (what a migration re-prefills), the detokenizer and the stop strings held back, and
//! the latencies. It outlives any one decode worker, so a migrated request's text and
//! accounting continue exactly where they were (`migrate`).

use std::time::{Duration, Instant};

use model_spec::text::{Detokenizer, TextCodec};
use sluice_proto::v1 as pb;
use tonic::Status;

use crate::orchestrate::{Event, Timings, TokenOut};
use crate::stops::{Release, StopMatcher};
use crate::validate::Validated;

pub struct Relay {
    detok: Detokenizer,
    stops: StopMatcher,
    logprobs: bool,
    /// Token ids streamed so far, in order.
    emitted: Vec<u32>,
    /// The first prefill: its timings and cached tokens describe the request.
    prefill: pb::PrefillReply,
    prompt_tokens: u32,
    arrived: Instant,
    ttft: Option<Duration>,
    last: Option<Instant>,
}

/// How long the client waited for a token: the first one, or the gap after the previous.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Latency {
    First(Duration),
    Gap(Duration),
}

/// One decode event as the client gets it.
#[derive(Debug, PartialEq)]
pub struct Relayed {
    pub token: TokenOut,
    pub latency: Latency,
    /// Set when the request is finished (a stop token or string, or its length).
    pub finish: Option<pb::FinishReason>,
}

impl Relay {
    pub fn new(req: &Validated, prefill: pb::PrefillReply, arrived: Instant) -> Self {
        Relay {
            detok: Detokenizer::new(),
            stops: StopMatcher::new(req.stop_strings.clone()),
            logprobs: req.sampling.logprobs,
            emitted: Vec::new(),
            prefill,
            prompt_tokens: req.prompt.len() as u32,
            arrived,
            ttft: None,
            last: None,
        }
    }

    pub fn emitted(&self) -> &[u32] {
        &self.emitted
    }

    pub fn since_arrival(&self) -> Duration {
        self.arrived.elapsed()
    }

    /// Turn a decode worker's event into the client's token. Its index must be the next
    /// one: a decode worker that resumed elsewhere (or a confused one) cannot make the
    /// client see a token twice or skip one.
    pub fn accept(&mut self, codec: Option<&TextCodec>, ev: &pb::DecodeEvent, now: Instant) -> Result<Relayed, Status> {
        let expected = self.emitted.len() as u32;
        if ev.index != expected {
            return Err(Status::internal(format!(
                "the decode worker sent token index {} where {expected} was next; stopping rather than repeat or skip tokens",
                ev.index
            )));
        }
        let latency = match self.last {
            None => Latency::First(now.saturating_duration_since(self.arrived)),
            Some(prev) => Latency::Gap(now.saturating_duration_since(prev)),
        };
        self.last = Some(now);
        self.ttft.get_or_insert(now.saturating_duration_since(self.arrived));
        self.emitted.push(ev.token_id);
        let finished = pb::FinishReason::try_from(ev.finish).unwrap_or(pb::FinishReason::Unspecified);
        let ends = finished != pb::FinishReason::Unspecified;
        let tokenizer = |e: model_spec::text::TextError| Status::internal(e.to_string());
        let mut text = match codec {
            Some(c) => self.detok.push(c, ev.token_id).map_err(tokenizer)?,
            None => String::new(),
        };
        if ends && let Some(c) = codec {
            text.push_str(&self.detok.flush(c).map_err(tokenizer)?);
        }
        let (text, stopped) = match self.stops.push(&text) {
            Release::Text(t) => (t, false),
            Release::Stop(t) => (t, true),
        };
        let text = if ends && !stopped { text + &self.stops.finish() } else { text };
        let top = if self.logprobs {
            ev.top_logprobs
                .iter()
                .map(|t| (t.token_id, t.logprob, codec.map(|c| c.token_text(t.token_id)).unwrap_or_default()))
                .collect()
        } else {
            Vec::new()
        };
        let finish = if stopped { Some(pb::FinishReason::Stop) } else { ends.then_some(finished) };
        let token = TokenOut { index: ev.index, token_id: ev.token_id, text, logprob: ev.logprob, top };
        Ok(Relayed { token, latency, finish })
    }

    /// The final event: usage counts the client's prompt and every streamed token once,
    /// timings are the first prefill's (a migration shows in the total time).
    pub fn final_event(&self, finish: pb::FinishReason) -> Event {
        let timings = Timings {
            queue_ms: self.prefill.queue_ms,
            restore_ms: self.prefill.restore_ms,
            prefill_ms: self.prefill.compute_ms,
            kv_transfer_ms: self.prefill.transfer_ms,
            ttft_ms: self.ttft.unwrap_or_default().as_secs_f64() * 1e3,
            total_ms: self.arrived.elapsed().as_secs_f64() * 1e3,
        };
        Event::Final {
            finish,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.prefill.cached_tokens,
            completion_tokens: self.emitted.len() as u32,
            timings,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::Sampling;

    fn codec() -> TextCodec {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/golden/tiny-init/model");
        TextCodec::load(&dir).unwrap().expect("fixture has a tokenizer")
    }

    fn request(prompt_len: usize, stops: &[&str]) -> Validated {
        Validated {
            request_id: "r".into(),
            prompt: vec![3; prompt_len],
            max_tokens: 100,
            sampling: Sampling { temperature: 0.0, top_p: 1.0, top_k: 0, seed: None, logprobs: true, top_logprobs: 0 },
            stop_ids: vec![],
            stop_strings: stops.iter().map(|s| s.to_string()).collect(),
            constraint: None,
        }
    }

    fn event(index: u32, token_id: u32, last: bool) -> pb::DecodeEvent {
        let finish = if last { pb::FinishReason::Length } else { pb::FinishReason::Unspecified };
        pb::DecodeEvent { index, token_id, logprob: -0.5, top_logprobs: vec![], finish: finish as i32 }
    }

    #[test]
    fn streamed_text_and_usage_count_every_token_once() {
        let c = codec();
        let ids = c.encode("the pages move — naïve café, then decode resumes elsewhere").unwrap();
        let t0 = Instant::now();
        let mut relay = Relay::new(&request(7, &[]), pb::PrefillReply { cached_tokens: 4, ..Default::default() }, t0);
        let mut text = String::new();
        for (i, &id) in ids.iter().enumerate() {
            let r = relay.accept(Some(&c), &event(i as u32, id, i + 1 == ids.len()), Instant::now()).unwrap();
            assert_eq!(matches!(r.latency, Latency::First(_)), i == 0);
            text.push_str(&r.token.text);
            if i == 4 {
                assert_eq!(relay.emitted(), &ids[..5], "what a migration re-prefills after the prompt");
            }
        }
        assert_eq!(text, c.decode(&ids).unwrap());
        match relay.final_event(pb::FinishReason::Length) {
            Event::Final { prompt_tokens, cached_tokens, completion_tokens, .. } => {
                assert_eq!((prompt_tokens, cached_tokens, completion_tokens), (7, 4, ids.len() as u32));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_repeated_or_skipped_index_is_refused() {
        let c = codec();
        let mut relay = Relay::new(&request(3, &[]), pb::PrefillReply::default(), Instant::now());
        for i in 0..3 {
            relay.accept(Some(&c), &event(i, 40 + i, false), Instant::now()).unwrap();
        }
        let again = relay.accept(Some(&c), &event(2, 42, false), Instant::now()).unwrap_err();
        assert_eq!(again.code(), tonic::Code::Internal);
        assert!(again.message().contains("index 2 where 3 was next"), "{}", again.message());
        assert!(relay.accept(Some(&c), &event(4, 44, false), Instant::now()).is_err());
        assert_eq!(relay.emitted(), &[40, 41, 42], "refused events are not counted");
    }

    #[test]
    fn a_stop_string_is_cut_and_ends_the_stream() {
        let c = codec();
        let ids = c.encode("one two END three").unwrap();
        let mut relay = Relay::new(&request(3, &["END"]), pb::PrefillReply::default(), Instant::now());
        let mut text = String::new();
        let mut finish = None;
        for (i, &id) in ids.iter().enumerate() {
            let r = relay.accept(Some(&c), &event(i as u32, id, false), Instant::now()).unwrap();
            text.push_str(&r.token.text);
            if r.finish.is_some() {
                finish = r.finish;
                break;
            }
        }
        assert_eq!(finish, Some(pb::FinishReason::Stop));
        assert_eq!(text, "one two ");
    }
}
