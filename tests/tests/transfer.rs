//! The KV a prefill worker computed lands byte for byte in the decode worker's pool,
//! over each single-host UCX transport. The test plays the router's part of the
//! handshake (reserve → prefill → commit happens inside prefill) and compares the two
//! workers' debug dumps of the same reservation.

use sluice_e2e::{Spec, TestCluster, prompt};
use sluice_proto::v1 as pb;

const VOCAB: u32 = 320;

/// Prompt lengths: inside one block, exactly one block, and crossing blocks (the tiny
/// preset's windows and compression ratios all show up within 300 tokens).
const LENGTHS: [usize; 3] = [5, 128, 300];

async fn pages_arrive_byte_equal(tls: &str) {
    let spec = Spec { debug_hooks: true, ucx_tls: Some(tls.into()), ..Spec::new(1, 1) };
    let c = TestCluster::start(spec).await;
    let mut decode = c.decode_client("decode-0").await;
    let mut prefill = c.prefill_client("prefill-0").await;
    for (i, &len) in LENGTHS.iter().enumerate() {
        let tokens = prompt(len, 11 + i as u32, VOCAB);
        let res = decode
            .reserve(pb::ReserveRequest {
                request_id: format!("t-{tls}-{len}"),
                prompt_tokens: len as u32,
                max_tokens: 4,
                fingerprint: String::new(),
            })
            .await
            .expect("reserve")
            .into_inner();
        let reply = prefill
            .prefill(pb::PrefillRequest {
                request_id: format!("t-{tls}-{len}"),
                reservation_id: res.reservation_id.clone(),
                tokens: tokens.clone(),
                target: res.target.clone(),
                decode_addr: c.worker_url("decode-0"),
                lease_ms: res.lease_ms,
            })
            .await
            .unwrap_or_else(|e| panic!("prefill over UCX_TLS={tls}: {e}"))
            .into_inner();
        assert_eq!(reply.tokens as usize, len);

        let key = pb::DumpKvRequest { reservation_id: res.reservation_id.clone() };
        let sent = prefill.dump_kv(key.clone()).await.expect("prefill dump").into_inner();
        let landed = decode.dump_kv(key).await.expect("decode dump").into_inner();

        assert_eq!(sent.pages.len(), len.div_ceil(128), "one page per 128-token block");
        assert!(sent.pages.iter().all(|p| p.iter().any(|&b| b != 0)), "every sent page holds KV");
        assert!(sent.rings.iter().any(|&b| b != 0) && !sent.logits.is_empty(), "state cache and logits were sent");
        let bytes: u64 = sent.pages.iter().map(|p| p.len() as u64).sum::<u64>()
            + (sent.rings.len() + sent.comp.len() + sent.logits.len()) as u64;
        assert_eq!(reply.transfer_bytes, bytes, "the reply counts every byte put");
        assert_eq!(landed.pages.len(), sent.pages.len());
        for (b, (s, l)) in sent.pages.iter().zip(&landed.pages).enumerate() {
            assert!(s == l, "UCX_TLS={tls}, {len} tokens: page {b} differs after transfer");
        }
        assert!(sent.rings == landed.rings, "UCX_TLS={tls}, {len} tokens: window rings differ");
        assert!(sent.comp == landed.comp, "UCX_TLS={tls}, {len} tokens: compressor state differs");
        assert!(sent.logits == landed.logits, "UCX_TLS={tls}, {len} tokens: logits differ");

        decode
            .release(pb::ReleaseRequest { reservation_id: res.reservation_id, writer_done: true })
            .await
            .expect("release");
        eprintln!("UCX_TLS={tls}: {len}-token prompt, {bytes} bytes byte-equal");
    }
    c.assert_pages_return(std::time::Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_arrive_byte_equal_over_shared_memory() {
    pages_arrive_byte_equal("shm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_arrive_byte_equal_over_tcp() {
    pages_arrive_byte_equal("tcp").await;
}
