//! A network partition on one machine: a network namespace joined to this one by a veth
//! pair. A worker started inside reaches etcd (through a forwarder on the pair's host
//! side) and is reached by the router and the prefill workers over the pair; taking the
//! pair's link down cuts it off from all of them at once, as a failed switch port
//! would, while it keeps running. Needs root and iproute2 (`ip`); otherwise the fault
//! is left out and the suite says so.

use std::process::Command;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub struct Netns {
    pub name: String,
    /// The pair's address inside the namespace (where the worker listens).
    pub inner_ip: String,
    /// The pair's address on this side.
    pub host_ip: String,
    host_if: String,
    forwarders: Vec<JoinHandle<()>>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Netns {
    /// Namespace `sluice-chaos-<id>` with the pair 10.77.<id>.1 (here) / .2 (inside).
    pub fn create(id: u8) -> Result<Netns, String> {
        let name = format!("sluice-chaos-{id}");
        let (host_if, inner_if) = (format!("vsc{id}h"), format!("vsc{id}n"));
        let (host_ip, inner_ip) = (format!("10.77.{id}.1"), format!("10.77.{id}.2"));
        // Leftovers of an interrupted run first.
        let _ = ip(&["netns", "del", &name]);
        let _ = ip(&["link", "del", &host_if]);
        ip(&["netns", "add", &name])?;
        let ns = Netns {
            name: name.clone(),
            inner_ip: inner_ip.clone(),
            host_ip: host_ip.clone(),
            host_if: host_if.clone(),
            forwarders: Vec::new(),
        };
        ip(&["link", "add", &host_if, "type", "veth", "peer", "name", &inner_if])?;
        ip(&["link", "set", &inner_if, "netns", &name])?;
        ip(&["addr", "add", &format!("{host_ip}/24"), "dev", &host_if])?;
        ip(&["link", "set", &host_if, "up"])?;
        let cidr = format!("{inner_ip}/24");
        for cmd in [
            vec!["addr", "add", cidr.as_str(), "dev", inner_if.as_str()],
            vec!["link", "set", inner_if.as_str(), "up"],
            vec!["link", "set", "lo", "up"],
        ] {
            let mut all = vec!["-n", name.as_str()];
            all.extend(cmd);
            ip(&all)?;
        }
        Ok(ns)
    }

    /// The command prefix that runs a program inside.
    pub fn exec_prefix(&self) -> Vec<String> {
        vec!["ip".into(), "netns".into(), "exec".into(), self.name.clone()]
    }

    /// Forward `host_ip:port` to `target` (a loopback service such as etcd), so a process
    /// inside reaches it through the pair; returns the URL to give it.
    pub async fn forward(&mut self, target: &str) -> String {
        let listener = TcpListener::bind((self.host_ip.as_str(), 0)).await.expect("bind the forwarder");
        let port = listener.local_addr().expect("forwarder address").port();
        let target = target.to_string();
        self.forwarders.push(tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        }));
        format!("http://{}:{port}", self.host_ip)
    }

    /// Take the link down: nothing crosses until [`Netns::heal`].
    pub fn cut(&self) {
        ip(&["link", "set", &self.host_if, "down"]).expect("cut the link");
    }

    pub fn heal(&self) {
        ip(&["link", "set", &self.host_if, "up"]).expect("bring the link back");
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for f in &self.forwarders {
            f.abort();
        }
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}
