//! The engine: a model on a backend plus the KV memory of the sequences it serves.
//! One [`Engine::step`] runs any mix of prefill chunks and decode tokens as one batch.

use std::path::Path;

use kernels::{Backend, BatchPlan, EntryDtype, KvState};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::fingerprint::Fingerprint;
use crate::kv::{KvCache, PoolStats, Sequence};
use crate::model::{LaunchedReadout, Model, ModelWeights, Readout};

#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub kv_dtype: EntryDtype,
    /// Pages (128-token blocks of compressed KV) in the pool.
    pub max_pages: usize,
    /// State-cache slots: sequences that can be open at once.
    pub max_sequences: usize,
    /// Longest prefill chunk one step runs (bounds activation memory).
    pub max_chunk_tokens: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { kv_dtype: EntryDtype::F32, max_pages: 512, max_sequences: 16, max_chunk_tokens: 2048 }
    }
}

/// Which logits a step returns for one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    /// The last token's (what sampling needs).
    Last,
    /// Every token's (conformance checks, scoring).
    All,
}

/// One sequence's part of a step.
pub struct StepInput<'a> {
    pub seq: &'a mut Sequence,
    pub tokens: &'a [u32],
    pub logits: Logits,
}

/// KV memory the caller allocated (see [`Engine::load_with_state`]).
pub struct ProvidedKv<B: Backend> {
    pub state: KvState<B>,
    /// f32 × vocab per state slot, for logits written by another process.
    pub slot_logits: Option<B::Kv>,
}

pub struct Engine<B: Backend> {
    pub model: Model<B>,
    pub cache: KvCache<B>,
    pub fingerprint: Fingerprint,
    pub options: EngineOptions,
    /// How loading the weights went (bytes, time, peak host memory).
    pub load: crate::model::load_progress::LoadStats,
    /// The mirror's regions pinned for device copies (declared before `mirror`, so they
    /// are unpinned before its memory goes).
    pub(crate) mirror_pins: Vec<Box<dyn kernels::backend::HostPin>>,
    /// Host memory transports use for this engine's KV when its own is out of their
    /// reach (see [`crate::mirror`]); `None` when the KV is host memory already.
    pub mirror: Option<crate::mirror::HostMirror>,
    /// Set when transports reach the KV in device memory in place
    /// ([`crate::device_kv`]).
    pub(crate) direct: Option<crate::device_kv::DirectKv>,
    /// Set from [`Engine::decode_launch`] to [`Engine::decode_collect`].
    in_flight: bool,
}

/// A decode step [`Engine::decode_launch`] issued, for [`Engine::decode_collect`].
#[must_use = "collect the step (Engine::decode_collect) before the engine runs another"]
pub struct LaunchedDecode<B: Backend>(LaunchedReadout<B>);

impl<B: Backend> Engine<B> {
    /// Load a model directory (config.json + safetensors) onto `backend`.
    pub fn load(dir: &Path, backend: B, options: EngineOptions) -> Result<Self, EngineError> {
        Self::load_with_state(dir, backend, options, None)
    }

    /// Like [`Self::load`], with the KV memory provided by the caller (sized by
    /// [`KvCache::region_elems`] for the model's layout), e.g. regions a transport
    /// registered so that peers can write pages straight into them.
    pub fn load_with_state(
        dir: &Path,
        backend: B,
        options: EngineOptions,
        provided: Option<ProvidedKv<B>>,
    ) -> Result<Self, EngineError> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        // A backend over several devices splits the pools between them; refuse before
        // loading anything when they do not divide.
        backend.set_kv_pools(options.max_pages, options.max_sequences).map_err(EngineError::Pools)?;
        let ck = Checkpoint::open(dir)?;
        let (weights, load) = ModelWeights::load(&ck, &config, &backend)?;
        let fingerprint = crate::fingerprint::compute(&config, ck.files(), options.kv_dtype);
        let model = Model::new(config, weights, backend, options.kv_dtype);
        let cache = match provided {
            Some(p) => KvCache::with_state(
                model.layout.clone(),
                p.state,
                p.slot_logits,
                options.max_pages,
                options.max_sequences,
            ),
            None => KvCache::new(&model.backend, model.layout.clone(), options.max_pages, options.max_sequences),
        };
        tracing::info!(
            model = %dir.display(),
            naming = ck.naming().name(),
            fingerprint = %fingerprint.short(),
            device = %model.backend.describe(),
            "model loaded"
        );
        Ok(Engine {
            model,
            cache,
            fingerprint,
            options,
            load,
            mirror_pins: Vec::new(),
            mirror: None,
            direct: None,
            in_flight: false,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    pub fn open_sequence(&mut self) -> Result<Sequence, EngineError> {
        Ok(self.cache.open()?)
    }

    pub fn release(&mut self, seq: Sequence) {
        self.cache.release(seq);
    }

    /// Whether decode steps replay as CUDA graphs (None on the CPU): workers export it.
    pub fn graph_health(&self) -> Option<kernels::GraphHealth> {
        self.model.backend.graph_health()
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.cache.stats()
    }

    /// Check a request's tokens against the vocabulary and context limit.
    pub fn validate(&self, already: usize, tokens: &[u32]) -> Result<(), EngineError> {
        let c = &self.model.config;
        if tokens.is_empty() {
            return Err(EngineError::EmptyInput);
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(EngineError::TokenOutOfRange { token: t, vocab: c.vocab_size });
        }
        let total = already + tokens.len();
        if total > c.max_position {
            return Err(EngineError::ContextTooLong { tokens: total, limit: c.max_position });
        }
        Ok(())
    }

    /// Run one batched step. Returns, per input, its requested logits flattened
    /// (`[n, vocab]`). On error nothing has changed: no state, no pages.
    pub fn step(&mut self, inputs: &mut [StepInput<'_>]) -> Result<Vec<Vec<f32>>, EngineError> {
        let (plan, logit_rows, counts) = self.plan_step(inputs)?;
        let (model, state) = (&self.model, &mut self.cache.state);
        let out = model.backend.enter(|| model.forward(state, &plan, &logit_rows, &counts));
        for inp in inputs.iter_mut() {
            inp.seq.len += inp.tokens.len();
        }
        Ok(out)
    }

    /// Validate a step's inputs, reserve their pages and lay out the batch: the plan,
    /// the rows whose logits are wanted and how many belong to each input. On error
    /// nothing has changed.
    fn plan_step(&mut self, inputs: &mut [StepInput<'_>]) -> Result<(BatchPlan, Vec<usize>, Vec<usize>), EngineError> {
        // A launched step's device buffers are the next step's memory (the step arena).
        assert!(!self.in_flight, "a decode step is in flight: Engine::decode_collect it before the next step");
        for inp in inputs.iter() {
            self.validate(inp.seq.len(), inp.tokens)?;
        }
        for i in 0..inputs.len() {
            let target = inputs[i].seq.len() + inputs[i].tokens.len();
            if let Err(e) = self.cache.reserve(inputs[i].seq, target) {
                for done in inputs[..i].iter_mut() {
                    let len = done.seq.len();
                    self.cache.trim(done.seq, len);
                }
                return Err(e.into());
            }
        }
        let plan = BatchPlan::new(
            inputs.iter().map(|i| (i.seq.slot(), i.seq.pages().to_vec(), i.seq.len(), i.tokens)).collect(),
        );
        let mut logit_rows = Vec::new();
        let mut counts = Vec::with_capacity(inputs.len());
        for (inp, s) in inputs.iter().zip(&plan.seqs) {
            let rows: Vec<usize> = match inp.logits {
                Logits::None => vec![],
                Logits::Last => vec![s.first_row + s.rows - 1],
                Logits::All => s.row_range().collect(),
            };
            counts.push(rows.len());
            logit_rows.extend(rows);
        }
        Ok((plan, logit_rows, counts))
    }

    /// Prefill `tokens` into one sequence in chunks of at most `max_chunk_tokens`.
    pub fn prefill(&mut self, seq: &mut Sequence, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, EngineError> {
        self.validate(seq.len(), tokens)?;
        let chunks: Vec<&[u32]> = tokens.chunks(self.options.max_chunk_tokens.max(1)).collect();
        let mut out = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            let want = match logits {
                Logits::Last if i + 1 < chunks.len() => Logits::None,
                other => other,
            };
            let mut r = self.step(&mut [StepInput { seq, tokens: chunk, logits: want }])?;
            out.append(&mut r[0]);
        }
        Ok(out)
    }

    /// One decode token for each sequence, batched; returns each one's logits.
    pub fn decode(&mut self, seqs: &mut [&mut Sequence], tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.step(&mut decode_inputs(seqs, tokens))
    }

    /// [`Engine::decode`] read out as each sequence's greedy token and its log-probability,
    /// with the logits only where `with_logits[i]` (a sequence that samples, constrains or
    /// reports top logprobs): a GPU engine picks the greedy tokens on the device, so a
    /// greedy batch reads back 8 bytes a sequence instead of its logits.
    pub fn decode_readout(
        &mut self,
        seqs: &mut [&mut Sequence],
        tokens: &[u32],
        with_logits: &[bool],
    ) -> Result<Vec<Readout>, EngineError> {
        let launched = self.decode_launch(seqs, tokens, with_logits)?;
        Ok(self.decode_collect(launched))
    }

    /// [`Engine::decode_readout`] in two halves, so the caller can do its own work while
    /// the device computes: this one issues the step (the sequences' lengths advance) and
    /// returns without waiting for a GPU engine's device, unless some sequence wants its
    /// logits; [`Engine::decode_collect`] waits and reads the picks (8 bytes a
    /// sequence). Until then the engine runs no other step (each would panic), but its
    /// pages, reservations and transports may be used.
    pub fn decode_launch(
        &mut self,
        seqs: &mut [&mut Sequence],
        tokens: &[u32],
        with_logits: &[bool],
    ) -> Result<LaunchedDecode<B>, EngineError> {
        assert_eq!(seqs.len(), with_logits.len(), "one logits flag per sequence");
        let mut inputs = decode_inputs(seqs, tokens);
        let (plan, logit_rows, _) = self.plan_step(&mut inputs)?;
        let (model, state) = (&self.model, &mut self.cache.state);
        let launched = model.backend.enter(|| model.launch_readout(state, &plan, &logit_rows, with_logits));
        for inp in inputs.iter_mut() {
            inp.seq.len += inp.tokens.len();
        }
        self.in_flight = true;
        Ok(LaunchedDecode(launched))
    }

    /// The read-out of the step [`Engine::decode_launch`] issued, one per sequence in its
    /// order.
    pub fn decode_collect(&mut self, launched: LaunchedDecode<B>) -> Vec<Readout> {
        let model = &self.model;
        let out = model.backend.enter(|| model.collect_readout(launched.0));
        self.in_flight = false;
        out
    }

    /// A sequence's KV state as bytes (see [`crate::kv::ExportHeader`]).
    pub fn export(&self, seq: &Sequence) -> Vec<u8> {
        self.cache.export(&self.model.backend, seq, &self.fingerprint)
    }

    /// Recreate an exported sequence in this engine's memory.
    pub fn import(&mut self, bytes: &[u8]) -> Result<Sequence, EngineError> {
        Ok(self.cache.import(&self.model.backend, bytes, &self.fingerprint)?)
    }
}

/// One decode input per sequence: its one token, its last (only) row's logits wanted.
fn decode_inputs<'a>(seqs: &'a mut [&mut Sequence], tokens: &'a [u32]) -> Vec<StepInput<'a>> {
    assert_eq!(seqs.len(), tokens.len(), "one token per sequence");
    seqs.iter_mut().zip(tokens.chunks(1)).map(|(s, t)| StepInput { seq: s, tokens: t, logits: Logits::Last }).collect()
}
