//! The bulk path of Get: a thread that owns a UCX sender and writes records into
//! callers' registered memory. The sender is `!Send` (its worker is single-threaded),
//! so requests come to it over a channel.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use tokio::sync::oneshot;
use transfer::{RegionSpec, RemoteWrite, SendStats, Sender, TransferError};

/// One range of a record, written at `offset` of region `region`.
#[derive(Clone, Debug)]
pub struct Piece {
    pub record: usize,
    /// Offset inside the record.
    pub from: usize,
    pub len: usize,
    pub region: usize,
    pub offset: u64,
}

pub struct Job {
    pub address: Vec<u8>,
    pub regions: Vec<RegionSpec>,
    pub records: Vec<Arc<Vec<u8>>>,
    pub pieces: Vec<Piece>,
    pub timeout: Duration,
}

type Reply = oneshot::Sender<Result<SendStats, TransferError>>;

#[derive(Clone)]
pub struct Bulk {
    tx: mpsc::Sender<(Job, Reply)>,
}

impl Bulk {
    pub fn start() -> Result<Bulk, TransferError> {
        let (tx, rx) = mpsc::channel::<(Job, Reply)>();
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("kvstore-bulk".into())
            .spawn(move || {
                let mut sender = match Sender::new() {
                    Ok(s) => {
                        let _ = ready_tx.send(Ok(()));
                        s
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                for (job, reply) in rx {
                    let writes: Vec<RemoteWrite<'_>> = job
                        .pieces
                        .iter()
                        .map(|p| RemoteWrite {
                            region: &job.regions[p.region],
                            offset: p.offset,
                            bytes: &job.records[p.record][p.from..p.from + p.len],
                        })
                        .collect();
                    let result = sender.write(&job.address, &writes, job.timeout);
                    let _ = reply.send(result);
                }
            })
            .map_err(|e| TransferError::Thread(e.to_string()))?;
        ready_rx.recv().map_err(|_| TransferError::Thread("the bulk thread exited".into()))??;
        Ok(Bulk { tx })
    }

    /// Write the job's pieces; resolves once they are in the caller's memory.
    pub async fn write(&self, job: Job) -> Result<SendStats, TransferError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send((job, reply)).map_err(|_| TransferError::Thread("the bulk thread exited".into()))?;
        rx.await.map_err(|_| TransferError::Thread("the bulk thread exited".into()))?
    }
}
