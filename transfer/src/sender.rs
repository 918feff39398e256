//! The sending side: one UCX worker with an endpoint per receiver, writing a
//! sequence's pages, then its state slot, then its logits, each batch followed by a
//! flush, so that when [`Sender::send`] returns every byte is in the receiver's memory.
//!
//! Thread affinity: a [`Sender`] is `!Send`; it lives on the thread that owns the KV
//! memory it sends from (a prefill worker's engine thread), so pages go out of that
//! memory with no staging copy.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ucx_sys::{Context, Endpoint, ErrorMode, Features, Worker};

use crate::TransferError;
use crate::target::Target;
use crate::wire::{WireError, WireGeometry};

/// One sequence's bytes as they sit in the sender's memory.
pub struct SendParts<'a> {
    /// Pages in block order; page `i` goes to `target.page_ids[i]`.
    pub pages: Vec<&'a [u8]>,
    pub rings: &'a [u8],
    pub comp: &'a [u8],
    pub logits: &'a [u8],
}

impl SendParts<'_> {
    pub fn bytes(&self) -> u64 {
        (self.pages.iter().map(|p| p.len()).sum::<usize>() + self.rings.len() + self.comp.len() + self.logits.len())
            as u64
    }
}

#[derive(Clone, Copy, Debug)]
pub struct SendStats {
    pub bytes: u64,
    pub elapsed: Duration,
}

pub struct Sender {
    worker: Worker,
    endpoints: HashMap<Vec<u8>, Endpoint>,
}

impl Sender {
    pub fn new() -> Result<Self, TransferError> {
        let ctx = Context::new(Features::RMA | Features::WAKEUP)?;
        Ok(Sender { worker: Worker::new(&ctx)?, endpoints: HashMap::new() })
    }

    /// Connect with peer-failure detection where the transports allow it; UCX 1.13's
    /// shared-memory transports do not, so fall back to no error handling for them.
    fn endpoint(&mut self, address: &[u8]) -> Result<&Endpoint, TransferError> {
        if self.endpoints.get(address).is_some_and(Endpoint::has_failed) {
            self.endpoints.remove(address);
        }
        if !self.endpoints.contains_key(address) {
            let ep = match self.worker.connect(address) {
                Ok(ep) => ep,
                Err(e) => {
                    tracing::debug!(error = %e, "peer-checked UCX endpoint unavailable; connecting without error handling");
                    self.worker.connect_with(address, ErrorMode::None)?
                }
            };
            self.endpoints.insert(address.to_vec(), ep);
        }
        Ok(&self.endpoints[address])
    }

    /// Write `parts` to `target`; `ours` is the sender's own geometry, which must match
    /// the receiver's.
    pub fn send(
        &mut self,
        target: &Target,
        ours: &WireGeometry,
        parts: &SendParts<'_>,
        timeout: Duration,
    ) -> Result<SendStats, TransferError> {
        ours.check_compatible(&target.geometry)?;
        check_sizes(target, parts)?;
        let started = Instant::now();
        let result = self.put_everything(target, parts, started + timeout);
        if result.is_err() {
            // A failed endpoint is reconnected on the next send.
            self.endpoints.remove(target.ucx_address.as_slice());
        }
        result.map(|()| SendStats { bytes: parts.bytes(), elapsed: started.elapsed() })
    }

    fn put_everything(&mut self, t: &Target, parts: &SendParts<'_>, deadline: Instant) -> Result<(), TransferError> {
        let g = &t.geometry;
        self.endpoint(&t.ucx_address)?;
        let ep = &self.endpoints[t.ucx_address.as_slice()];
        let left = || deadline.saturating_duration_since(Instant::now());
        let pages: Vec<(&[u8], u64)> = parts
            .pages
            .iter()
            .zip(&t.page_ids)
            .map(|(p, &id)| (*p, t.pages.base + id as u64 * g.page_bytes as u64))
            .collect();
        let rkey = ep.unpack_rkey(&t.pages.rkey)?;
        self.worker.put_all(ep, &pages, &rkey, left())?;
        for (region, bytes, per_slot) in [
            (&t.rings, parts.rings, g.ring_bytes),
            (&t.comp, parts.comp, g.comp_bytes),
            (&t.logits, parts.logits, g.logits_bytes),
        ] {
            let rkey = ep.unpack_rkey(&region.rkey)?;
            let at = region.base + t.slot as u64 * per_slot as u64;
            self.worker.put_all(ep, &[(bytes, at)], &rkey, left())?;
        }
        Ok(())
    }
}

fn check_sizes(t: &Target, parts: &SendParts<'_>) -> Result<(), WireError> {
    let g = &t.geometry;
    let bad = |what: String| Err(WireError::Malformed(what));
    if parts.pages.len() > t.page_ids.len() {
        return bad(format!("{} pages to send, {} reserved", parts.pages.len(), t.page_ids.len()));
    }
    if let Some(p) = parts.pages.iter().find(|p| p.len() != g.page_bytes) {
        return bad(format!("a page of {} bytes, geometry says {}", p.len(), g.page_bytes));
    }
    for (what, have, want) in [
        ("window rings", parts.rings.len(), g.ring_bytes),
        ("compressor slots", parts.comp.len(), g.comp_bytes),
        ("logits", parts.logits.len(), g.logits_bytes),
    ] {
        if have != want {
            return bad(format!("{what}: {have} bytes, geometry says {want}"));
        }
    }
    Ok(())
}
