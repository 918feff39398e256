//! The mHC sites' parameters as backends take them ([`HcWeights`] before a sub-block,
//! [`HcHeadWeights`] before the output norm) and a step's streams before their first
//! update, still copies of the embedding ([`StreamCopies`]).

use crate::backend::Backend;

/// Parameters of one mHC site (attention or FFN side of a layer).
pub struct HcWeights<B: Backend + ?Sized> {
    /// `[(2 + hc) * hc, hc * hidden]`: rows are pre, post, then comb logits.
    pub mix: B::Weight,
    /// `(2 + hc) * hc` biases.
    pub base: Vec<f32>,
    /// Scales for pre, post and comb logits.
    pub scale: [f32; 3],
    pub hc: usize,
    pub hidden: usize,
    pub sinkhorn_iters: usize,
    pub norm_eps: f32,
    pub hc_eps: f32,
}

/// Residual streams `[rows, hc, hidden]` that are `hc` copies of each row of `x`
/// (`[rows, hidden]`): a step's streams before its first residual update, every one the
/// token's embedding ([`Backend::hc_pre_copies`], [`Backend::hc_post_pre_copies`]).
pub struct StreamCopies<'a, B: Backend + ?Sized> {
    pub x: &'a B::Buf,
    pub rows: usize,
    pub hc: usize,
    pub hidden: usize,
}

impl<B: Backend + ?Sized> StreamCopies<'_, B> {
    /// The streams made: each row of `x` repeated `hc` times.
    pub fn make(&self, b: &B) -> B::Buf {
        b.gather_rows(self.x, self.hidden, &self.copied_rows(0..self.rows))
    }

    /// The streams of `rows` alone, in that order (`[rows.len(), hc, hidden]`).
    pub fn make_rows(&self, b: &B, rows: &[usize]) -> B::Buf {
        b.gather_rows(self.x, self.hidden, &self.copied_rows(rows.iter().copied()))
    }

    fn copied_rows(&self, rows: impl Iterator<Item = usize>) -> Vec<usize> {
        rows.flat_map(|r| std::iter::repeat_n(r, self.hc)).collect()
    }
}

/// The final stream collapse before the output norm.
pub struct HcHeadWeights<B: Backend + ?Sized> {
    /// `[hc, hc * hidden]`.
    pub mix: B::Weight,
    pub base: Vec<f32>,
    pub scale: f32,
    pub hc: usize,
    pub hidden: usize,
    pub norm_eps: f32,
    pub hc_eps: f32,
}
