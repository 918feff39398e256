//! The bulk path of Get: a thread that owns a UCX sender and writes records into
//! callers' registered memory. The sender is `!Send` (its worker is single-threaded),
//! so requests come to it over a channel. A job's records arrive one by one as the
//! store reads them, so reading the next record from disk overlaps writing this one.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use transfer::{RegionSpec, RemoteWrite, SendStats, Sender, TransferError};

use crate::record::Payload;

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
    /// Records as they are read: (index, bytes); the job ends when the sender hangs up.
    pub records: mpsc::Receiver<(usize, Payload)>,
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
                    let _ = reply.send(write_job(&mut sender, job));
                }
            })
            .map_err(|e| TransferError::Thread(e.to_string()))?;
        ready_rx.recv().map_err(|_| TransferError::Thread("the bulk thread exited".into()))??;
        Ok(Bulk { tx })
    }

    /// Write the job's pieces as its records arrive; resolves once every record that
    /// arrived is in the caller's memory (or the first failure).
    pub async fn write(&self, job: Job) -> Result<SendStats, TransferError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send((job, reply)).map_err(|_| TransferError::Thread("the bulk thread exited".into()))?;
        rx.await.map_err(|_| TransferError::Thread("the bulk thread exited".into()))?
    }
}

/// Each record's pieces, written (and flushed) as the record arrives, all within the
/// job's timeout.
fn write_job(sender: &mut Sender, job: Job) -> Result<SendStats, TransferError> {
    let started = Instant::now();
    let deadline = started + job.timeout;
    let (mut bytes, mut puts) = (0, 0);
    for (i, record) in job.records.iter() {
        let record: &[u8] = (*record).as_ref();
        let writes: Vec<RemoteWrite<'_>> = job
            .pieces
            .iter()
            .filter(|p| p.record == i)
            .map(|p| RemoteWrite {
                region: &job.regions[p.region],
                offset: p.offset,
                source: transfer::Source::Host(&record[p.from..p.from + p.len]),
            })
            .collect();
        let left = deadline.saturating_duration_since(Instant::now());
        let sent = sender.write(&job.address, &writes, left)?;
        bytes += sent.bytes;
        puts += sent.puts;
    }
    Ok(SendStats { bytes, elapsed: started.elapsed(), puts })
}
