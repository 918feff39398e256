//! Discovery through a real etcd (Debian's `etcd-server`): the cluster keeps serving
//! while etcd is down, workers register again when it comes back (even empty), and a
//! worker that joins later is placed while a dead one drops out within its lease TTL.

use std::time::{Duration, Instant};

use cluster::discovery::{EtcdConfig, Member, Role, watch};
use cluster::testing::EtcdServer;
use sluice_e2e::{Spec, TestCluster, ids_request, prompt};

const VOCAB: u32 = 320;

/// Workers' etcd lease TTL (cluster's default) plus the router's poll and watch slack.
const DROP_OUT: Duration = Duration::from_secs(5 + 3);

/// Members registered in etcd right now, once `pred` holds (bounded).
async fn registered(etcd: &EtcdServer, pred: impl Fn(&[Member]) -> bool) -> Vec<Member> {
    let fut = async {
        let mut m =
            watch(EtcdConfig::new(etcd.endpoints(), EtcdConfig::members_prefix("default"))).await.expect("watch");
        m.wait_for(|ms| pred(ms)).await.expect("membership")
    };
    tokio::time::timeout(Duration::from_secs(30), fut).await.expect("workers registered in time")
}

fn count(ms: &[Member], role: Role) -> usize {
    ms.iter().filter(|m| m.role == role).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_survives_an_etcd_outage_and_workers_register_again() {
    let mut etcd = EtcdServer::start();
    let mut c = TestCluster::start(Spec { etcd: Some(etcd.endpoint()), ..Spec::new(1, 1) }).await;
    let before = registered(&etcd, |ms| ms.len() == 2).await;
    let p = prompt(150, 5, VOCAB);
    let expected = c.generate(ids_request(p.clone(), 6)).await.expect("serving with etcd").ids();

    // etcd down for longer than a lease: requests keep being served from the router's
    // last view of the cluster.
    etcd.stop();
    let down = Instant::now();
    let mut served = 0;
    while down.elapsed() < Duration::from_secs(7) {
        let g = c.generate(ids_request(p.clone(), 6)).await.expect("serving while etcd is down");
        assert_eq!(g.ids(), expected);
        served += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    eprintln!("{served} requests served while etcd was down");

    // Back with its data: the same workers are registered (leases kept alive again).
    etcd.restart();
    let after = registered(&etcd, |ms| ms.len() == 2).await;
    let ids = |ms: &[Member]| {
        let mut v: Vec<String> = ms.iter().map(|m| m.id.clone()).collect();
        v.sort();
        v
    };
    assert_eq!(ids(&after), ids(&before));
    assert_eq!(c.generate(ids_request(p.clone(), 6)).await.expect("serving after restart").ids(), expected);

    // Back empty (data lost, every lease gone): the workers notice and register anew,
    // without restarting, and the router keeps placing them.
    etcd.stop();
    std::fs::remove_dir_all(etcd.data_dir()).expect("wipe etcd data");
    etcd.restart();
    let fresh = registered(&etcd, |ms| count(ms, Role::Prefill) == 1 && count(ms, Role::Decode) == 1).await;
    assert_eq!(ids(&fresh), ids(&before), "the same processes registered again");
    for w in c.workers.iter_mut() {
        assert!(w.exited().is_none(), "{} kept running through lease loss", w.name);
    }
    c.wait_for_workers(1, 1).await;
    assert_eq!(c.generate(ids_request(p, 6)).await.expect("serving after etcd lost its data").ids(), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_worker_is_used_and_a_dead_one_drops_out_within_its_lease() {
    let etcd = EtcdServer::start();
    let mut c = TestCluster::start(Spec { etcd: Some(etcd.endpoint()), ..Spec::new(1, 1) }).await;
    let p = prompt(140, 9, VOCAB);
    let expected = c.generate(ids_request(p.clone(), 6)).await.expect("serving").ids();

    c.add_worker("decode", 1, vec![]).await;
    c.wait_for_workers(1, 2).await;

    c.kill_worker("decode-0").await;
    let killed = Instant::now();
    registered(&etcd, |ms| count(ms, Role::Decode) == 1).await;
    let gone = killed.elapsed();
    eprintln!("dead decode worker left etcd {:.1} s after kill -9", gone.as_secs_f64());
    assert!(gone <= DROP_OUT, "a dead worker's registration outlived its lease: {gone:?}");

    // Only decode-1 is left, so a successful request was decoded there.
    let deadline = Instant::now() + DROP_OUT;
    let g = loop {
        match c.generate(ids_request(p.clone(), 6)).await {
            Ok(g) => break g,
            // Until the router's view catches up it may still try the dead worker once.
            Err(e) if Instant::now() < deadline => eprintln!("retrying after: {e}"),
            Err(e) => panic!("the new decode worker was not used: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(g.ids(), expected);
    c.assert_pages_return(Duration::from_secs(2)).await;
}
