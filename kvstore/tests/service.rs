//! The kvstore process as its clients use it: records put through UCX into its staging
//! and read back into the caller's registered memory, checked; refusals that say what
//! is wrong; put leases; deletes; and a disk that fills up (writes refused and counted,
//! serving goes on).

use std::path::Path;
use std::time::Duration;

use cluster::launch::{ServiceProcess, free_port};
use sluice_proto::v1 as pb;
use sluice_proto::v1::kv_store_client::KvStoreClient;
use tonic::Code;
use tonic::transport::Channel;
use transfer::checksum::kv_checksum;
use transfer::{Landing, Receiver, RegionSpec, RemoteWrite, Sender};

const WAIT: Duration = Duration::from_secs(30);

struct Store {
    process: ServiceProcess,
    client: KvStoreClient<Channel>,
}

/// Start the real binary, optionally under a shell that caps file sizes (`ulimit -f`
/// in KiB, with SIGXFSZ ignored so an oversized write fails instead of killing it).
async fn start(dir: &Path, extra: &[&str], file_limit_kib: Option<u64>) -> Store {
    let port = free_port();
    let bin = env!("CARGO_BIN_EXE_kvstore");
    let mut args: Vec<String> = vec![
        "--dir".into(),
        dir.join("data").display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--metrics-listen".into(),
        "off".into(),
        "--capacity".into(),
        "64MiB".into(),
        "--staging-bytes".into(),
        "8MiB".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let (program, args) = match file_limit_kib {
        None => (bin.to_string(), args),
        Some(kib) => {
            let line = format!("trap '' XFSZ; ulimit -f {kib}; exec {bin} {}", args.join(" "));
            ("bash".to_string(), vec!["-c".to_string(), line])
        }
    };
    // Under a file-size cap UCX's shared-memory transports (files in /dev/shm) fail to
    // start, so such a store speaks tcp only (the test's own side negotiates down to it).
    let env: Vec<(String, String)> =
        if file_limit_kib.is_some() { vec![("UCX_TLS".into(), "tcp".into())] } else { vec![] };
    let url = format!("http://127.0.0.1:{port}");
    let mut process =
        ServiceProcess::spawn("kvstore", Path::new(&program), &args, &env, url.clone(), &dir.join("logs")).unwrap();
    process.wait_healthy(WAIT).await.unwrap_or_else(|e| panic!("kvstore did not start: {e}"));
    Store { process, client: KvStoreClient::connect(url).await.unwrap() }
}

fn key(i: u8) -> Vec<u8> {
    let mut k = vec![0x5a; 32];
    k[0] = i;
    k
}

fn bytes(len: usize, salt: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt)).collect()
}

fn page(i: u8, len: usize) -> pb::PutRecord {
    pb::PutRecord {
        key: key(i),
        parent: if i == 0 { vec![] } else { key(i - 1) },
        depth: i as u32,
        kind: pb::RecordKind::Page as i32,
        len: len as u64,
        pools: Some(pb::PoolBytes { csa_main: len as u64, ..Default::default() }),
    }
}

fn snapshot(i: u8, len: usize) -> pb::PutRecord {
    pb::PutRecord {
        key: key(i),
        parent: vec![],
        depth: i as u32,
        kind: pb::RecordKind::Snapshot as i32,
        len: len as u64,
        pools: Some(pb::PoolBytes { swa: len as u64, ..Default::default() }),
    }
}

fn region(r: &pb::RemoteRegion) -> RegionSpec {
    RegionSpec { base: r.base, len: r.len, rkey: r.rkey.clone() }
}

/// Offer records and write the accepted ones; returns (accepted flags, commit reply).
async fn put(
    store: &mut Store,
    sender: &mut Sender,
    records: &[(pb::PutRecord, Vec<u8>)],
    corrupt: bool,
) -> (Vec<bool>, Option<pb::CommitPutReply>) {
    let begin = pb::BeginPutRequest { records: records.iter().map(|(r, _)| r.clone()).collect() };
    let reply = store.client.begin_put(begin).await.unwrap().into_inner();
    let taken: Vec<&Vec<u8>> = records.iter().zip(&reply.accepted).filter(|(_, a)| **a).map(|((_, b), _)| b).collect();
    if taken.is_empty() {
        return (reply.accepted, None);
    }
    let staging = region(reply.staging.as_ref().unwrap());
    let writes: Vec<RemoteWrite<'_>> = taken
        .iter()
        .zip(&reply.offsets)
        .map(|(b, &offset)| RemoteWrite { region: &staging, offset, source: transfer::Source::Host(b.as_slice()) })
        .collect();
    tokio::task::block_in_place(|| sender.write(&reply.ucx_address, &writes, WAIT)).unwrap();
    let mut checksums: Vec<u64> = taken.iter().map(|b| kv_checksum(b)).collect();
    if corrupt {
        checksums[0] ^= 1;
    }
    let commit = pb::CommitPutRequest { put_id: reply.put_id, checksums };
    let done = store.client.commit_put(commit).await.unwrap().into_inner();
    (reply.accepted, Some(done))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_move_through_ucx_both_ways_and_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = start(dir.path(), &["--swa-policy", "full", "--put-lease-ms", "300"], None).await;
    let info = store.client.info(pb::KvInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.swa_policy, "full");

    let mut sender = Sender::new().unwrap();
    let records = vec![
        (page(0, 5000), bytes(5000, 1)),
        (page(1, 5000), bytes(5000, 2)),
        (page(2, 5000), bytes(5000, 3)),
        (snapshot(2, 12_000), bytes(12_000, 4)),
    ];
    let (accepted, done) = put(&mut store, &mut sender, &records, false).await;
    assert_eq!(accepted, vec![true; 4]);
    assert_eq!(done.unwrap().stored, 4);
    let (accepted, done) = put(&mut store, &mut sender, &records[..1], false).await;
    assert_eq!((accepted, done.is_none()), (vec![false], true), "a stored record is declined");

    // A record whose bytes do not match its checksum is not stored.
    let (_, done) = put(&mut store, &mut sender, &[(page(3, 4000), bytes(4000, 5))], true).await;
    assert_eq!(done.unwrap().rejected, 1);
    let keys: Vec<Vec<u8>> = (0..5).map(key).collect();
    let found = store.client.lookup(pb::LookupRequest { keys: keys.clone() }).await.unwrap().into_inner();
    assert_eq!((found.cached_blocks, found.snapshots), (3, vec![3]));

    // Get: the pages into one region at chosen offsets, the snapshot split over two.
    let rx = Receiver::start().unwrap();
    let a = Landing::allocate(&rx, 64 * 1024).unwrap();
    let b = Landing::allocate(&rx, 64 * 1024).unwrap();
    let spec = |l: &Landing| pb::RemoteRegion { base: l.spec.base, len: l.spec.len, rkey: l.spec.rkey.clone() };
    let piece = |record: u32, region: u32, offset: u64, len: u64| pb::Piece { record, region, offset, len };
    let get = pb::GetRequest {
        keys: vec![key(0), key(1), key(2), key(2)],
        kinds: vec![1, 1, 1, 2],
        ucx_address: rx.address().to_vec(),
        regions: vec![spec(&a), spec(&b)],
        pieces: vec![
            piece(0, 0, 10_000, 5000),
            piece(1, 0, 0, 5000),
            piece(2, 0, 20_000, 5000),
            piece(3, 1, 0, 7000),
            piece(3, 0, 40_000, 5000),
        ],
        deadline_ms: 10_000,
    };
    let reply = store.client.get(get.clone()).await.unwrap().into_inner();
    assert_eq!(reply.bytes, 27_000);
    assert_eq!(a.bytes(10_000, 5000), records[0].1.as_slice());
    assert_eq!(a.bytes(0, 5000), records[1].1.as_slice());
    assert_eq!(a.bytes(20_000, 5000), records[2].1.as_slice());
    assert_eq!(b.bytes(0, 7000), &records[3].1[..7000]);
    assert_eq!(a.bytes(40_000, 5000), &records[3].1[7000..]);
    let sums: Vec<u64> = records.iter().map(|(_, b)| kv_checksum(b)).collect();
    assert_eq!(reply.checksums, sums);

    // Refusals name the problem and write nothing.
    let before = b.bytes(0, 64 * 1024).to_vec();
    let mut missing = get.clone();
    missing.keys[0] = key(9);
    missing.pieces =
        vec![piece(0, 1, 0, 5000), piece(1, 1, 5000, 5000), piece(2, 1, 10_000, 5000), piece(3, 1, 20_000, 12_000)];
    let err = store.client.get(missing).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert_eq!(b.bytes(0, 64 * 1024), before.as_slice(), "nothing written");
    let mut short = get.clone();
    short.pieces.pop();
    let err = store.client.get(short).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("record 3 is 12000 bytes"), "{}", err.message());
    let mut overrun = get.clone();
    overrun.pieces[0].offset = 64 * 1024 - 10;
    let err = store.client.get(overrun).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("overruns"), "{}", err.message());
    let err = store.client.lookup(pb::LookupRequest { keys: vec![vec![1, 2, 3]] }).await.unwrap_err();
    assert!(err.message().contains("32 bytes"), "{}", err.message());

    // A put whose writer never commits gives its reservation back after the lease.
    let begin = pb::BeginPutRequest { records: vec![page(3, 4000)] };
    let r = store.client.begin_put(begin.clone()).await.unwrap().into_inner();
    assert_eq!(r.accepted, vec![true]);
    assert_eq!(store.client.begin_put(begin.clone()).await.unwrap().into_inner().accepted, vec![false], "in flight");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let err = store.client.commit_put(pb::CommitPutRequest { put_id: r.put_id, checksums: vec![0] }).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(store.client.begin_put(begin).await.unwrap().into_inner().accepted, vec![true], "offered again");

    // Delete takes the block and what chains after it.
    let deleted = store.client.delete(pb::DeleteRequest { keys: vec![key(1)], all: false }).await.unwrap().into_inner();
    assert_eq!(deleted.deleted, 3, "blocks 1 and 2 and the snapshot of 2");
    let found = store.client.lookup(pb::LookupRequest { keys }).await.unwrap().into_inner();
    assert_eq!(found.cached_blocks, 1);
    store.process.terminate(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_and_the_store_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    // Files may not grow past 96 KiB: the first record fits, the later ones do not.
    let mut store = start(dir.path(), &["--swa-policy", "zero", "--segment-bytes", "1MiB"], Some(96)).await;
    let mut sender = Sender::new().unwrap();
    let first = vec![(page(0, 40_000), bytes(40_000, 1))];
    assert_eq!(put(&mut store, &mut sender, &first, false).await.1.unwrap().stored, 1);
    let more: Vec<(pb::PutRecord, Vec<u8>)> = (1..5).map(|i| (page(i, 40_000), bytes(40_000, i))).collect();
    assert_eq!(put(&mut store, &mut sender, &more, false).await.1.unwrap().stored, 4, "queued (write-behind)");
    let deadline = std::time::Instant::now() + WAIT;
    let stats = loop {
        let s = store.client.stats(pb::KvStatsRequest {}).await.unwrap().into_inner();
        if s.queued_records == 0 {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "the writer never drained: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(stats.write_errors >= 3, "writes past the limit are refused and counted: {stats:?}");
    assert!(stats.pages >= 1 && stats.pages <= 2, "what could not be written is not served: {stats:?}");
    assert!(stats.disk_bytes <= 96 * 1024);
    // Still serving: lookups, and gets of what is on disk.
    let found = store.client.lookup(pb::LookupRequest { keys: (0..5).map(key).collect() }).await.unwrap().into_inner();
    assert_eq!(found.cached_blocks as u64, stats.pages);
    let rx = Receiver::start().unwrap();
    let land = Landing::allocate(&rx, 40_000).unwrap();
    let get = pb::GetRequest {
        keys: vec![key(0)],
        kinds: vec![1],
        ucx_address: rx.address().to_vec(),
        regions: vec![pb::RemoteRegion { base: land.spec.base, len: land.spec.len, rkey: land.spec.rkey.clone() }],
        pieces: vec![pb::Piece { record: 0, region: 0, offset: 0, len: 40_000 }],
        deadline_ms: 0,
    };
    store.client.get(get).await.unwrap();
    assert_eq!(land.bytes(0, 40_000), first[0].1.as_slice());
    store.process.terminate(WAIT).await;
}
