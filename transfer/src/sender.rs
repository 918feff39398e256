//! The sending side: one UCX worker with an endpoint per receiver, writing a
//! sequence's pages, its state slot and its logits, then one flush, so that when
//! [`Sender::send`] returns every byte is in the receiver's memory.
//!
//! Thread affinity: a [`Sender`] is `!Send`; it lives on the thread that owns the KV
//! memory it sends from (a prefill worker's engine thread), so pages go out of that
//! memory with no staging copy.
//!
//! Remote keys are kept between sends: unpacking one maps the receiver's region into
//! this process over shared memory (sysv/posix attach), and a fresh mapping takes a page
//! fault on the first write to every 4 KiB of it, which cost more than the copy itself
//! (`sluice bench transfer`, docs/perf.md). A receiver that stops getting sends has its
//! keys dropped after [`KEY_IDLE`], so a departed decode worker's memory is not held.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kernels::backend::DeviceMemory;
use ucx_sys::{Context, DeviceRegion, Endpoint, ErrorMode, Features, RemoteKey, Source, UcxError, Worker};

use crate::TransferError;
use crate::target::{RegionSpec, Target};
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

/// One sequence's bytes wherever they are: host memory, or device memory a GPU engine
/// holds (sent straight from the GPU when the loaded libucx reaches CUDA memory,
/// [`Sender::reaches_device_memory`]). Pages in block order, as in [`SendParts`].
pub struct SourceParts<'a> {
    pub pages: Vec<Source<'a>>,
    pub rings: Source<'a>,
    pub comp: Source<'a>,
    pub logits: Source<'a>,
}

impl<'a> SourceParts<'a> {
    /// Host bytes as sources.
    pub fn host(parts: &SendParts<'a>) -> Self {
        SourceParts {
            pages: parts.pages.iter().map(|p| Source::Host(p)).collect(),
            rings: Source::Host(parts.rings),
            comp: Source::Host(parts.comp),
            logits: Source::Host(parts.logits),
        }
    }

    pub fn bytes(&self) -> u64 {
        (self.pages.iter().map(Source::len).sum::<usize>() + self.rings.len() + self.comp.len() + self.logits.len())
            as u64
    }

    /// Whether any part is read from device memory.
    pub fn from_device(&self) -> bool {
        self.pages.iter().chain([&self.rings, &self.comp, &self.logits]).any(|s| matches!(s, Source::Device { .. }))
    }
}

/// One write of local bytes (host or device memory) into a peer's registered region,
/// at `offset` bytes from the region's base.
#[derive(Clone, Copy, Debug)]
pub struct RemoteWrite<'a> {
    pub region: &'a RegionSpec,
    pub offset: u64,
    pub source: Source<'a>,
}

#[derive(Clone, Copy, Debug)]
pub struct SendStats {
    pub bytes: u64,
    pub elapsed: Duration,
    /// Puts issued: GPU pages that continue one another on both ends go out as one.
    pub puts: usize,
}

/// How long a receiver's remote keys (and so its mapped regions) are kept after the
/// last send to it.
pub const KEY_IDLE: Duration = Duration::from_secs(30);

pub struct Sender {
    worker: Worker,
    /// By receiver worker address.
    peers: HashMap<Vec<u8>, Peer>,
    /// Device memory registered with this sender's context ([`Sender::register_local`]):
    /// puts from inside it carry its memory handle.
    local: Vec<DeviceRegion>,
    /// Asked which memory types the loaded transports reach.
    ctx: Context,
}

/// A connected receiver and the keys of its regions unpacked on that endpoint (a key
/// keeps its endpoint open, so both go together).
struct Peer {
    ep: Endpoint,
    /// By the packed bytes the receiver handed out.
    keys: HashMap<Vec<u8>, RemoteKey>,
    last_send: Instant,
}

impl Peer {
    fn unpack(&mut self, packed: &[u8]) -> Result<(), UcxError> {
        if !self.keys.contains_key(packed) {
            let key = self.ep.unpack_rkey(packed)?;
            self.keys.insert(packed.to_vec(), key);
        }
        Ok(())
    }
}

impl Sender {
    pub fn new() -> Result<Self, TransferError> {
        let ctx = Context::new(Features::RMA | Features::WAKEUP)?;
        Ok(Sender { worker: Worker::new(&ctx)?, ctx, peers: HashMap::new(), local: Vec::new() })
    }

    /// Connect with peer-failure detection where the configured transports allow it
    /// (tcp, RDMA), without it where they do not (UCX 1.13's shared memory): asking
    /// shared memory for it would fail and make UCX log an ERROR on every connection.
    /// Without it a dead receiver is noticed by the control plane instead: its commit
    /// RPC fails and the router retries elsewhere; over shared memory a put is a copy
    /// into a mapping that stays valid, so it cannot hang on the dead peer.
    fn peer(&mut self, address: &[u8]) -> Result<&mut Peer, TransferError> {
        if self.peers.get(address).is_some_and(|p| p.ep.has_failed()) {
            self.peers.remove(address);
        }
        if !self.peers.contains_key(address) {
            let ep = match self.worker.connect_with(address, self.worker.error_mode()) {
                Ok(ep) => ep,
                Err(e)
                    if e.status == i32::from(ucx_sys::raw::UCS_ERR_UNREACHABLE)
                        && self.worker.error_mode() == ErrorMode::Peer =>
                {
                    // The transports named include a network one that cannot reach this
                    // peer (UCX logged why just before); shared memory may still.
                    tracing::warn!(error = %e, "no UCX transport with peer-failure detection reaches the receiver; connecting without error handling (set UCX_TLS to transports both sides share)");
                    self.worker.connect_with(address, ErrorMode::None)?
                }
                Err(e) => return Err(e.into()),
            };
            self.peers.insert(address.to_vec(), Peer { ep, keys: HashMap::new(), last_send: Instant::now() });
        }
        Ok(self.peers.get_mut(address).expect("inserted above"))
    }

    /// Drops the keys of receivers not sent to for [`KEY_IDLE`], unmapping their regions;
    /// endpoints stay, as closing one to a departed peer could wait on it.
    fn release_idle_keys(&mut self, now: Instant) {
        for peer in self.peers.values_mut() {
            if now.saturating_duration_since(peer.last_send) > KEY_IDLE {
                peer.keys.clear();
            }
        }
    }

    /// Whether this sender's libucx can put from GPU memory (CUDA transports loaded).
    pub fn reaches_device_memory(&self) -> bool {
        self.ctx.supports(ucx_sys::MemoryType::Cuda)
    }

    /// Register device memory this sender puts from (a GPU engine's KV pools), once:
    /// puts from inside it then carry its memory handle, which UCX's zero-copy GPU
    /// protocols need (without it a put from GPU memory goes through bounce buffers at
    /// a fraction of the speed). The sender keeps the memory allocated until it drops.
    pub fn register_local(&mut self, mem: Box<dyn DeviceMemory>) -> Result<(), TransferError> {
        self.local.push(DeviceRegion::register_memory(&self.ctx, mem)?);
        Ok(())
    }

    /// `s` as a put from registered memory when a local registration holds it.
    fn with_memh<'a>(&'a self, s: Source<'a>) -> Source<'a> {
        if let Source::Device { mem, offset, len } = s {
            let addr = mem.device_ptr() + offset as u64;
            if let Some(region) = self.local.iter().find(|r| r.contains(addr, len)) {
                return Source::Registered { region, offset: (addr - region.address()) as usize, len };
            }
        }
        s
    }

    /// Write `parts` (host memory) to `target`; `ours` is the sender's own geometry,
    /// which must match the receiver's.
    pub fn send(
        &mut self,
        target: &Target,
        ours: &WireGeometry,
        parts: &SendParts<'_>,
        timeout: Duration,
    ) -> Result<SendStats, TransferError> {
        self.send_from(target, ours, &SourceParts::host(parts), timeout)
    }

    /// Write `parts` (host or device memory) to `target`, as [`Sender::send`].
    pub fn send_from(
        &mut self,
        target: &Target,
        ours: &WireGeometry,
        parts: &SourceParts<'_>,
        timeout: Duration,
    ) -> Result<SendStats, TransferError> {
        ours.check_compatible(&target.geometry)?;
        check_sizes(target, parts)?;
        if parts.from_device() && !self.reaches_device_memory() {
            return Err(TransferError::Memory(
                "asked to send from GPU memory, but the loaded libucx has no CUDA transports".into(),
            ));
        }
        let started = Instant::now();
        let result = self.put_everything(target, parts, started + timeout);
        if result.is_err() {
            // A failed endpoint is reconnected (and its keys unpacked again) on the next send.
            self.peers.remove(target.ucx_address.as_slice());
        }
        result.map(|puts| SendStats { bytes: parts.bytes(), elapsed: started.elapsed(), puts })
    }

    /// Write arbitrary ranges into the regions of the peer at `address` (a kvstore
    /// filling a prefill worker's pages and slot, say), then flush: when this returns
    /// every byte is in the peer's memory. Ranges are checked against their regions.
    pub fn write(
        &mut self,
        address: &[u8],
        writes: &[RemoteWrite<'_>],
        timeout: Duration,
    ) -> Result<SendStats, TransferError> {
        for w in writes {
            let end = w.offset.checked_add(w.source.len() as u64);
            if end.is_none_or(|end| end > w.region.len) {
                return Err(WireError::Malformed(format!(
                    "a write of {} bytes at offset {} of a {}-byte region",
                    w.source.len(),
                    w.offset,
                    w.region.len
                ))
                .into());
            }
        }
        let started = Instant::now();
        let deadline = started + timeout;
        let result = (|| {
            let now = Instant::now();
            self.release_idle_keys(now);
            let peer = self.peer(address)?;
            peer.last_send = now;
            for w in writes {
                peer.unpack(&w.region.rkey)?;
            }
            let peer = &self.peers[address];
            // One batch per region (a batch shares one remote key), in first-use order,
            // all flushed together.
            let mut keys: Vec<&Vec<u8>> = Vec::new();
            for w in writes {
                if !keys.contains(&&w.region.rkey) {
                    keys.push(&w.region.rkey);
                }
            }
            let puts: Vec<Vec<(Source<'_>, u64)>> = keys
                .iter()
                .map(|&key| {
                    writes
                        .iter()
                        .filter(|w| &w.region.rkey == key)
                        .map(|w| (self.with_memh(w.source), w.region.base + w.offset))
                        .collect()
                })
                .collect();
            let batches: Vec<_> = keys.iter().zip(&puts).map(|(&key, p)| (&peer.keys[key], p.as_slice())).collect();
            let left = deadline.saturating_duration_since(Instant::now());
            Ok::<usize, TransferError>(self.worker.put_batches(&peer.ep, &batches, left)?)
        })();
        if result.is_err() {
            self.peers.remove(address);
        }
        let bytes = writes.iter().map(|w| w.source.len() as u64).sum();
        result.map(|puts| SendStats { bytes, elapsed: started.elapsed(), puts })
    }

    /// Puts every part and waits for them; returns how many puts were issued.
    fn put_everything(
        &mut self,
        t: &Target,
        parts: &SourceParts<'_>,
        deadline: Instant,
    ) -> Result<usize, TransferError> {
        let g = &t.geometry;
        let now = Instant::now();
        self.release_idle_keys(now);
        let peer = self.peer(&t.ucx_address)?;
        peer.last_send = now;
        for region in [&t.pages, &t.rings, &t.comp, &t.logits] {
            peer.unpack(&region.rkey)?;
        }
        let peer = &self.peers[t.ucx_address.as_slice()];
        let pages: Vec<(Source<'_>, u64)> = parts
            .pages
            .iter()
            .zip(&t.page_ids)
            .map(|(p, &id)| (self.with_memh(*p), t.pages.base + id as u64 * g.page_bytes as u64))
            .collect();
        let state = [
            (&t.rings, parts.rings, g.ring_bytes),
            (&t.comp, parts.comp, g.comp_bytes),
            (&t.logits, parts.logits, g.logits_bytes),
        ]
        .map(|(region, source, per_slot)| {
            (region, [(self.with_memh(source), region.base + t.slot as u64 * per_slot as u64)])
        });
        // Pages, rings, compressor slots and logits, each region its own batch, then one
        // flush for all of them.
        let mut batches = vec![(&peer.keys[&t.pages.rkey], pages.as_slice())];
        batches.extend(state.iter().map(|(region, put)| (&peer.keys[&region.rkey], put.as_slice())));
        let left = deadline.saturating_duration_since(Instant::now());
        Ok(self.worker.put_batches(&peer.ep, &batches, left)?)
    }
}

fn check_sizes(t: &Target, parts: &SourceParts<'_>) -> Result<(), WireError> {
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

#[cfg(test)]
mod tests {
    use kernels::backend::Backend;
    use kernels::{AttnKind, CpuBackend, EntryDtype, KvLayout, LayerSpec};
    use model_spec::Fingerprint;

    use super::*;
    use crate::Receiver;

    fn bytes(len: usize, salt: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(salt)).collect()
    }

    /// A receiver holding a pool of `pool_pages` pages and one state slot, and the
    /// target that writes the sent pages into `page_ids` of it. The state regions stay
    /// registered for as long as the fixture lives.
    struct Fixture {
        g: WireGeometry,
        pool: crate::RegisteredRegion,
        _state: [crate::RegisteredRegion; 3],
        target: Target,
        /// Dropped last, after its regions.
        _rx: Receiver,
    }

    fn fixture(pool_pages: usize, page_ids: Vec<u32>) -> Fixture {
        let spec = LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: 32, index_dim: 16, rope_dim: 16 };
        let g = WireGeometry::new(&KvLayout::new(128, 128, EntryDtype::Bf16, &[spec]), &Fingerprint([1; 32]), 64);
        let rx = Receiver::start().unwrap();
        let [pool, rings, comp, logits] =
            [pool_pages * g.page_bytes, g.ring_bytes, g.comp_bytes, g.logits_bytes].map(|b| rx.allocate(b).unwrap());
        let target = Target {
            geometry: g.clone(),
            ucx_address: rx.address().to_vec(),
            pages: pool.spec.clone(),
            rings: rings.spec.clone(),
            comp: comp.spec.clone(),
            logits: logits.spec.clone(),
            page_ids,
            slot: 0,
        };
        Fixture { g, pool, _state: [rings, comp, logits], target, _rx: rx }
    }

    /// The bytes of the fixture's pool, read as a decode worker reads its pages.
    fn landed(f: Fixture, pool_pages: usize) -> Vec<u8> {
        let cpu = CpuBackend::new();
        let kv = cpu.kv_adopt(Box::new(f.pool.region), pool_pages * f.g.page_bytes / 2, EntryDtype::Bf16).unwrap();
        cpu.kv_host_bytes(&kv).unwrap().to_vec()
    }

    #[test]
    fn remote_keys_are_reused_between_sends_and_released_when_idle() {
        let f = fixture(2, vec![1]);
        let (g, target) = (&f.g, &f.target);
        let (r, cm, l) = (bytes(g.ring_bytes, 1), bytes(g.comp_bytes, 2), bytes(g.logits_bytes, 3));
        let (a, b, c) = (bytes(g.page_bytes, 10), bytes(g.page_bytes, 20), bytes(g.page_bytes, 30));
        let parts = |page| SendParts { pages: vec![page], rings: &r, comp: &cm, logits: &l };
        let timeout = Duration::from_secs(20);
        let keys = |tx: &Sender| tx.peers[target.ucx_address.as_slice()].keys.len();

        let mut tx = Sender::new().unwrap();
        let sent = tx.send(target, g, &parts(&a), timeout).unwrap();
        assert_eq!(sent.puts, 4, "a put per region: the page, rings, compressor slots, logits");
        assert_eq!(keys(&tx), 4, "one key per region");
        tx.release_idle_keys(Instant::now() + KEY_IDLE + Duration::from_secs(1));
        assert_eq!(keys(&tx), 0, "an idle receiver's regions are unmapped");
        tx.send(target, g, &parts(&b), timeout).unwrap();
        tx.send(target, g, &parts(&c), timeout).unwrap();
        assert_eq!(keys(&tx), 4, "unpacked again once, then reused");

        let page_bytes = g.page_bytes;
        let landed = landed(f, 2);
        assert!(landed[page_bytes..] == c[..], "the last send landed through the reused key");
    }

    /// Pages from host memory keep a put each even where they continue one another on
    /// both ends (only GPU pages are merged), and every page lands in its own place.
    #[test]
    fn host_pages_go_out_page_by_page_and_land_in_place() {
        let f = fixture(4, vec![1, 2, 3]);
        let g = &f.g;
        let (r, cm, l) = (bytes(g.ring_bytes, 1), bytes(g.comp_bytes, 2), bytes(g.logits_bytes, 3));
        // Three pages side by side in one host buffer, to consecutive remote pages.
        let local = bytes(3 * g.page_bytes, 40);
        let parts = SendParts { pages: local.chunks_exact(g.page_bytes).collect(), rings: &r, comp: &cm, logits: &l };
        let sent = Sender::new().unwrap().send(&f.target, g, &parts, Duration::from_secs(20)).unwrap();
        assert_eq!(sent.puts, 3 + 3, "three page puts and three state puts");
        assert_eq!(sent.bytes, parts.bytes());
        let page_bytes = g.page_bytes;
        let landed = landed(f, 4);
        assert!(landed[page_bytes..] == local[..], "pages 1..4 hold the three pages in order");
        assert!(landed[..page_bytes].iter().all(|&b| b == 0), "page 0 untouched");
    }
}
