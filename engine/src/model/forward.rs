//! One forward step of the whole model over a batch (prefill chunks and decode tokens
//! of any number of sequences), written against the `kernels` backend.
//!
//! Per layer: mHC pre-mix → attention (q low-rank path, shared K=V head, compressor and
//! indexer for CSA/HCA layers, one softmax over window + compressed entries with a
//! sink, inverse RoPE, grouped output projection) → mHC post-mix, then the same around
//! the MoE block. After the last layer the `hc_head` collapse, final norm and LM head
//! run only on the rows whose logits the caller wants.

use kernels::backend::{
    AttentionIo, CompressorParams, GreedyPicks, HeadNormJob, HeadNormShared, OutputProjection, QueryPrep, Selection,
    StreamCopies,
};
use kernels::{AttnKind, Backend, BatchPlan, Branch, KvState};

use super::weights::{CompressorWeights, LayerWeights};
use super::{Model, Readout};

/// A step's read-out as [`Model::launch_readout`] leaves it: read already, or greedy picks
/// a GPU backend is still computing.
#[must_use = "collect the read-out (Model::collect_readout) before the next step"]
pub enum LaunchedReadout<B: Backend> {
    Read(Vec<Readout>),
    Picks(GreedyPicks<B::Buf>),
}

impl<B: Backend> Model<B> {
    /// Run `plan` through the model, updating the KV state, and return the logits of
    /// `logit_rows` (batch row indices) in parts of `parts[i]` rows each (`[n, vocab]`
    /// flattened; the parts' rows sum to `logit_rows.len()`).
    pub fn forward(
        &self,
        kv: &mut KvState<B>,
        plan: &BatchPlan,
        logit_rows: &[usize],
        parts: &[usize],
    ) -> Vec<Vec<f32>> {
        self.backend.begin_step(plan);
        let out = match self.step(kv, plan, logit_rows) {
            Some(logits) => {
                let lens: Vec<usize> = parts.iter().map(|&n| n * self.config.vocab_size).collect();
                self.backend.download_parts(&logits, &lens)
            }
            None => parts.iter().map(|_| Vec::new()).collect(),
        };
        self.backend.end_step();
        out
    }

    /// [`Model::forward`] with one logit row per entry of `logit_rows`, read out as its
    /// greedy token and log-probability (picked where the logits are: on the device for
    /// a GPU backend) and, where `with_logits[i]`, the row's logits too.
    pub fn forward_readout(
        &self,
        kv: &mut KvState<B>,
        plan: &BatchPlan,
        logit_rows: &[usize],
        with_logits: &[bool],
    ) -> Vec<Readout> {
        let launched = self.launch_readout(kv, plan, logit_rows, with_logits);
        self.collect_readout(launched)
    }

    /// [`Model::forward_readout`] up to the point where the host must wait for the
    /// device: every op of the step is issued (a GPU backend's greedy picks included) and
    /// the step ended, and [`Model::collect_readout`] reads the picks back. A step where
    /// some row wants its logits reads them here, before the step ends (the host needs
    /// them to sample, so there is nothing to overlap).
    pub fn launch_readout(
        &self,
        kv: &mut KvState<B>,
        plan: &BatchPlan,
        logit_rows: &[usize],
        with_logits: &[bool],
    ) -> LaunchedReadout<B> {
        assert_eq!(logit_rows.len(), with_logits.len(), "one logits flag per read-out row");
        let b = &self.backend;
        let vocab = self.config.vocab_size;
        b.begin_step(plan);
        let out = match self.step(kv, plan, logit_rows) {
            Some(logits) if with_logits.iter().any(|&w| w) => {
                let picks = b.greedy_rows(&logits, logit_rows.len(), vocab);
                let wanted: Vec<usize> = (0..logit_rows.len()).filter(|&i| with_logits[i]).collect();
                let mut rows = if wanted.len() == logit_rows.len() {
                    b.download_parts(&logits, &vec![vocab; wanted.len()])
                } else {
                    b.download_parts(&b.gather_rows(&logits, vocab, &wanted), &vec![vocab; wanted.len()])
                }
                .into_iter();
                let read = picks
                    .into_iter()
                    .zip(with_logits)
                    .map(|((token, logprob), &w)| Readout {
                        token,
                        logprob,
                        logits: if w { rows.next() } else { None },
                    })
                    .collect();
                LaunchedReadout::Read(read)
            }
            Some(logits) => LaunchedReadout::Picks(b.greedy_rows_start(&logits, logit_rows.len(), vocab)),
            None => LaunchedReadout::Read(Vec::new()),
        };
        b.end_step();
        out
    }

    /// The read-out of a step [`Model::launch_readout`] issued: waits for the device where
    /// the picks are still there (8 bytes a row).
    pub fn collect_readout(&self, launched: LaunchedReadout<B>) -> Vec<Readout> {
        match launched {
            LaunchedReadout::Read(out) => out,
            LaunchedReadout::Picks(picks) => self
                .backend
                .greedy_rows_finish(picks)
                .into_iter()
                .map(|(token, logprob)| Readout { token, logprob, logits: None })
                .collect(),
        }
    }

    /// The layers over `plan`, then the logits of `logit_rows` (`[n, vocab]`, None when
    /// no row wants them).
    fn step(&self, kv: &mut KvState<B>, plan: &BatchPlan, logit_rows: &[usize]) -> Option<B::Buf> {
        let b = &self.backend;
        let c = &self.config;
        let rows = plan.rows();
        let (d, hc) = (c.hidden_size, c.hc_mult);
        let mut x = b.output(rows * d);
        b.embed(&self.weights.embed, plan, &mut x);
        // Every residual stream starts as the embedding (`[rows, hc, d]` once the first
        // residual update writes them).
        let mut streams = Streams::Copies(x);

        let layers = &self.weights.layers;
        let mut input = layers.first().map(|lw| self.attention_input(lw, &streams, rows));
        for (l, lw) in layers.iter().enumerate() {
            let entry = input.take().expect("each layer starts from its attention input");
            // After the last layer only the logit rows' streams are read: its residual
            // update is made for those rows alone (`streams` then holds them, in order).
            let next = match layers.get(l + 1) {
                Some(nl) => Next::Layer(nl),
                None => Next::Rows(logit_rows),
            };
            input = self.layer_from(l, lw, &mut streams, kv, plan, entry, next);
        }

        if logit_rows.is_empty() {
            return None;
        }
        let picked = match streams {
            Streams::Copies(x) => StreamCopies { x: &x, rows, hc, hidden: d }.make_rows(b, logit_rows),
            Streams::Made(made) => made,
        };
        let mut h = b.output(logit_rows.len() * d);
        b.hc_head(&picked, logit_rows.len(), &self.weights.hc_head, &mut h);
        b.rms_norm(&mut h, d, Some(&self.weights.norm), c.rms_norm_eps as f32);
        let mut logits = b.output(logit_rows.len() * c.vocab_size);
        b.matmul(&h, logit_rows.len(), &self.weights.head, &mut logits);
        Some(logits)
    }

    /// One layer on `streams`, whose updated streams it returns (its attention input
    /// mixed from them first).
    pub(super) fn layer(
        &self,
        l: usize,
        lw: &LayerWeights<B>,
        mut streams: Streams<B>,
        kv: &mut KvState<B>,
        plan: &BatchPlan,
    ) -> B::Buf {
        let input = self.attention_input(lw, &streams, plan.rows());
        self.layer_from(l, lw, &mut streams, kv, plan, input, Next::Update);
        streams.made()
    }

    /// The pre-mix of `lw`'s attention: its input and the mixing it leaves for hc_post.
    fn attention_input(&self, lw: &LayerWeights<B>, streams: &Streams<B>, rows: usize) -> SubBlockInput<B> {
        let b = &self.backend;
        let c = &self.config;
        let (d, hc, eps) = (c.hidden_size, c.hc_mult, c.rms_norm_eps as f32);
        let mut input =
            SubBlockInput { x: b.output(rows * d), post: b.output(rows * hc), comb: b.output(rows * hc * hc) };
        let norm = Some((&lw.attn_norm, eps));
        let SubBlockInput { x: collapsed, post, comb } = &mut input;
        match streams {
            Streams::Made(made) => b.hc_pre(made, rows, &lw.hc_attn, norm, collapsed, post, comb),
            Streams::Copies(x) => {
                let copies = StreamCopies { x, rows, hc, hidden: d };
                b.hc_pre_copies(&copies, &lw.hc_attn, norm, collapsed, post, comb)
            }
        }
        input
    }

    /// [`Backend::hc_post_pre`] on the streams, which an update of their copies makes.
    #[allow(clippy::too_many_arguments)]
    fn post_pre(
        &self,
        streams: &mut Streams<B>,
        rows: usize,
        out: &B::Buf,
        w: &B::Hc,
        norm: Option<(&B::Buf, f32)>,
        input: &mut SubBlockInput<B>,
    ) {
        let b = &self.backend;
        let (d, hc) = (self.config.hidden_size, self.config.hc_mult);
        let SubBlockInput { x, post, comb } = input;
        match streams {
            Streams::Made(made) => b.hc_post_pre(made, rows, hc, out, w, norm, x, post, comb),
            Streams::Copies(e) => {
                let copies = StreamCopies { x: e, rows, hc, hidden: d };
                let made = b.hc_post_pre_copies(&copies, out, w, norm, x, post, comb);
                *streams = Streams::Made(made);
            }
        }
    }

    /// Layer `l` from its attention input on, ending as `next` says: with the next layer's
    /// attention input (its pre-mix taken as this layer's last residual update is written,
    /// which a backend may fuse), with the residual update alone, or with the update of
    /// some rows alone (`streams` then holds those rows' streams, in the order given).
    #[allow(clippy::too_many_arguments)]
    fn layer_from(
        &self,
        l: usize,
        lw: &LayerWeights<B>,
        streams: &mut Streams<B>,
        kv: &mut KvState<B>,
        plan: &BatchPlan,
        mut input: SubBlockInput<B>,
        next: Next<'_, B>,
    ) -> Option<SubBlockInput<B>> {
        let b = &self.backend;
        let c = &self.config;
        let rows = plan.rows();
        let (d, hc, eps) = (c.hidden_size, c.hc_mult, c.rms_norm_eps as f32);

        let attn = self.attention(l, lw, &input.x, kv, plan);
        self.post_pre(streams, rows, &attn, &lw.hc_ffn, Some((&lw.ffn_norm, eps)), &mut input);
        let mut y = b.output(rows * d);
        b.moe(&input.x, rows, &plan.tokens, &lw.moe, 0..rows, &mut y);
        let kept = match next {
            Next::Layer(nl) => {
                self.post_pre(streams, rows, &y, &nl.hc_attn, Some((&nl.attn_norm, eps)), &mut input);
                return Some(input);
            }
            Next::Update => None,
            Next::Rows(kept) => Some(kept),
        };
        let SubBlockInput { post, comb, .. } = &input;
        let streams = streams.made_mut();
        match kept {
            // Every row in order (a decode step's logits: the update in place) or all of them.
            None => b.hc_post(streams, rows, hc, &y, post, comb),
            Some(kept) if kept.iter().copied().eq(0..rows) => b.hc_post(streams, rows, hc, &y, post, comb),
            // Each row's update reads only that row: the kept rows gathered first.
            Some(kept) => {
                if !kept.is_empty() {
                    let mut s = b.gather_rows(streams, hc * d, kept);
                    let y = b.gather_rows(&y, d, kept);
                    let (post, comb) = (b.gather_rows(post, hc, kept), b.gather_rows(comb, hc * hc, kept));
                    b.hc_post(&mut s, kept.len(), hc, &y, &post, &comb);
                    *streams = s;
                }
            }
        }
        None
    }

    fn project(&self, x: &B::Buf, rows: usize, w: &B::Weight) -> B::Buf {
        let mut out = self.backend.output(rows * self.backend.weight_shape(w).0);
        self.backend.matmul(x, rows, w, &mut out);
        out
    }

    /// Products of the same activations, in the order of `ws` (one launch on a GPU for
    /// few rows: `Backend::matmul_many`).
    fn project_many(&self, x: &B::Buf, rows: usize, ws: &[&B::Weight]) -> Vec<B::Buf> {
        let mut outs: Vec<B::Buf> =
            ws.iter().map(|w| self.backend.output(rows * self.backend.weight_shape(w).0)).collect();
        self.backend.matmul_many(x, rows, ws, &mut outs.iter_mut().collect::<Vec<_>>());
        outs
    }

    /// The compressor's step on its two projections of the layer input (`wkv`, `wgate`).
    fn run_compressor(
        &self,
        l: usize,
        branch: Branch,
        cw: &CompressorWeights<B>,
        (proj_kv, proj_score): (B::Buf, B::Buf),
        kv: &mut KvState<B>,
        plan: &BatchPlan,
    ) {
        let p = CompressorParams {
            ape: &cw.ape,
            norm: &cw.norm,
            eps: self.config.rms_norm_eps as f32,
            rope: &self.compress_rope,
        };
        self.backend.compress(&mut kv.view_mut(), &self.layout, l, branch, plan, &proj_kv, &proj_score, &p);
    }

    fn attention(&self, l: usize, lw: &LayerWeights<B>, x: &B::Buf, kv: &mut KvState<B>, plan: &BatchPlan) -> B::Buf {
        let b = &self.backend;
        let c = &self.config;
        let a = &lw.attn;
        let rows = plan.rows();
        let (h, hd, eps) = (c.num_heads, c.head_dim, c.rms_norm_eps as f32);
        let kind = c.attn_kinds[l];
        let rope = if kind == AttnKind::Window { &self.main_rope } else { &self.compress_rope };
        let pos = &plan.positions;

        // Every projection of the layer input at once: wq_a, wkv, then the compressors'
        // wkv and wgate and the indexer's weights_proj where the layer has them.
        let mut ws = vec![&a.wq_a, &a.wkv];
        if let Some(cw) = &a.compressor {
            ws.extend([&cw.wkv, &cw.wgate]);
        }
        if let Some(ix) = &a.indexer {
            ws.extend([&ix.compressor.wkv, &ix.compressor.wgate, &ix.weights_proj]);
        }
        let mut projections = self.project_many(x, rows, &ws).into_iter();
        let mut next = || projections.next().expect("one projection per weight");
        let (mut qr, mut new_kv) = (next(), next());
        let main_compressed = a.compressor.as_ref().map(|_| (next(), next()));
        let indexer_projections = a.indexer.as_ref().map(|_| ((next(), next()), next()));

        b.rms_norm(&mut qr, c.q_lora_rank, Some(&a.q_norm), eps);
        // The query and (CSA layers) the indexer's query, both from the normed q_lora.
        let (mut q, indexer_q) = match &a.indexer {
            Some(ix) => {
                let [q, iq] = <[B::Buf; 2]>::try_from(self.project_many(&qr, rows, &[&a.wq_b, &ix.wq_b]))
                    .unwrap_or_else(|_| unreachable!("two weights, two products"));
                (q, Some(iq))
            }
            None => (self.project(&qr, rows, &a.wq_b), None),
        };
        // The compressors and the indexer (which read the projections and write the
        // compressed pages) do not touch the query or the new entry: a branch, so a GPU
        // may run the two chains of small kernels at once. The indexer's chain (its
        // compressor, query, scores, top-k) is the longest, so a CSA layer's main
        // compressor goes beside it with the norms; an HCA layer's compressor is the
        // branch.
        let main_compressor = a.compressor.as_ref().zip(main_compressed);
        let (main_beside, main_on_branch) =
            if a.indexer.is_some() { (main_compressor, None) } else { (None, main_compressor) };
        b.fork();
        if let Some((cw, projs)) = main_on_branch {
            self.run_compressor(l, Branch::Main, cw, projs, kv, plan);
        }
        let indexer = a.indexer.as_ref().zip(indexer_projections).zip(indexer_q);
        let selection: Option<Selection<B>> = indexer.map(|((ix, (projs, mut iw)), mut iq)| {
            self.run_compressor(l, Branch::Indexer, &ix.compressor, projs, kv, plan);
            // (q rotated at the rows' positions and the head weights scaled on the way.)
            let (heads, k, scale) = (c.index_heads, c.index_topk, c.index_weight_scale());
            b.indexer_select(&kv.view(), &self.layout, l, plan, &mut iq, &mut iw, heads, k, &self.compress_rope, scale)
        });
        b.to_main();
        if let Some((cw, projs)) = main_beside {
            self.run_compressor(l, Branch::Main, cw, projs, kv, plan);
        }
        // The query's heads, and the new entry normed, rotated, then rounded to exactly
        // what the window ring will hold, so a token attends to the same values whether
        // it is in this chunk or a later one (for fp8 that is each entry quantised with
        // its own block scales, RoPE tail in BF16).
        // Where the backend's attention reads the query anyway (a GPU's prefill kernel),
        // it norms and rotates the heads there, and the query's pass over memory goes.
        let entry = Some(&self.layout.layers[l].main);
        let query_raw = b.attention_preps_query(&self.layout, l, plan, h);
        let shared = HeadNormShared { head_dim: hd, eps, positions: pos, rope };
        let mut entry_job = HeadNormJob { x: &mut new_kv, heads: 1, weight: Some(&a.kv_norm), round: entry };
        if query_raw {
            entry_job.run_alone(b, &shared);
        } else {
            b.head_norm_rope2(
                &mut HeadNormJob { x: &mut q, heads: h, weight: None, round: None },
                &mut entry_job,
                &shared,
            );
        }
        b.join();

        // Attention, its output rotated back at the query positions (K = V carried the
        // rotation into it), wo_a and wo_b; the new entries go to the window rings after it.
        let mut out = b.output(rows * b.weight_shape(&a.wo_b).0);
        let prep = QueryPrep { eps, rope };
        let io = AttentionIo {
            q: &mut q,
            new_kv: &new_kv,
            selected: selection.as_ref(),
            sinks: &a.sinks,
            heads: h,
            scale: c.attention_scale(),
            prep: query_raw.then_some(&prep),
        };
        let proj = OutputProjection { rope, groups: c.o_groups, wo_a: &a.wo_a, wo_b: &a.wo_b };
        b.attention_projected(&kv.view(), &self.layout, l, plan, io, &proj, &mut out);
        b.store_window(&mut kv.view_mut(), &self.layout, l, plan, &new_kv);
        out
    }
}

/// A step's residual streams: `hc` copies of each row of the embedding until the first
/// residual update makes them (`[rows, hc, hidden]`), which backends may take from the
/// embedding alone ([`Backend::hc_post_pre_copies`]).
pub(super) enum Streams<B: Backend> {
    Copies(B::Buf),
    Made(B::Buf),
}

impl<B: Backend> Streams<B> {
    /// The made streams: every layer's first residual update makes them.
    fn made(self) -> B::Buf {
        match self {
            Streams::Made(made) => made,
            Streams::Copies(_) => panic!("a layer's residual update left the streams unmade"),
        }
    }

    fn made_mut(&mut self) -> &mut B::Buf {
        match self {
            Streams::Made(made) => made,
            Streams::Copies(_) => panic!("a layer's residual update left the streams unmade"),
        }
    }
}

/// How [`Model::layer_from`] ends a layer.
enum Next<'a, B: Backend> {
    /// With this next layer's attention input.
    Layer(&'a LayerWeights<B>),
    /// With every row's residual update.
    Update,
    /// With these rows' residual updates alone (the last layer's: the logit rows).
    Rows(&'a [usize]),
}

/// A sub-block's input mixed from the residual streams (`x[rows, hidden]`, normed) and
/// the mixing its residual update will use (`post[rows, hc]`, `comb[rows, hc, hc]`).
struct SubBlockInput<B: Backend> {
    x: B::Buf,
    post: B::Buf,
    comb: B::Buf,
}
