//! Segment files: append-only logs of records (`seg-<id>.kvs` in the store
//! directory). One writer appends to the newest; readers read any segment at any
//! offset through a shared handle (positional reads), also while it is appended to or
//! after it was unlinked by compaction.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::record::{HEADER_LEN, Header, Kind};

pub fn path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("seg-{id:010}.kvs"))
}

/// Ids of the segments in `dir`, oldest first.
pub fn list(dir: &Path) -> io::Result<Vec<u64>> {
    let mut ids = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        let name = name.to_string_lossy();
        if let Some(id) = name.strip_prefix("seg-").and_then(|s| s.strip_suffix(".kvs")).and_then(|s| s.parse().ok()) {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

/// A segment as its writer holds it.
pub struct Segment {
    pub id: u64,
    pub file: Arc<File>,
    /// Bytes in the file (the append position).
    pub size: u64,
}

/// A record found by a scan.
#[derive(Clone, Debug)]
pub struct Found {
    pub offset: u64,
    pub header: Header,
    /// Tombstones only: their payload.
    pub tombstone: Option<Vec<u8>>,
}

impl Segment {
    pub fn create(dir: &Path, id: u64) -> io::Result<Segment> {
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(path(dir, id))?;
        Ok(Segment { id, file: Arc::new(file), size: 0 })
    }

    pub fn open(dir: &Path, id: u64) -> io::Result<Segment> {
        let file = OpenOptions::new().read(true).write(true).open(path(dir, id))?;
        let size = file.metadata()?.len();
        Ok(Segment { id, file: Arc::new(file), size })
    }

    /// Append one record; returns its offset. On failure (a full disk, say) the file is
    /// cut back to where it was, so no partial record stays behind.
    pub fn append(&mut self, header: &Header, payload: &[u8]) -> io::Result<u64> {
        let at = self.size;
        // Two writes rather than one of a copied buffer: payloads are large.
        let written = self
            .file
            .write_all_at(&header.encode(), at)
            .and_then(|()| self.file.write_all_at(payload, at + HEADER_LEN as u64));
        if let Err(e) = written {
            let _ = self.file.set_len(at);
            return Err(e);
        }
        self.size = at + (HEADER_LEN + payload.len()) as u64;
        Ok(at)
    }

    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// Read every record from the start, stopping at the first that is torn or
    /// damaged (header checksum, a payload past the end, or — with `verify_payloads` —
    /// a payload checksum). Returns the records and the end of the last good one.
    pub fn scan(&self, verify_payloads: bool) -> io::Result<(Vec<Found>, u64)> {
        let mut found = Vec::new();
        let mut at = 0u64;
        let mut header = [0u8; HEADER_LEN];
        while at + HEADER_LEN as u64 <= self.size {
            self.file.read_exact_at(&mut header, at)?;
            let h = match Header::decode(&header) {
                Ok(h) => h,
                Err(e @ crate::record::RecordError::OldFormat) => {
                    tracing::warn!(offset = at, "{e}");
                    break;
                }
                Err(_) => break,
            };
            let end = at + h.total_len();
            if end > self.size {
                break;
            }
            let needs_payload = verify_payloads || h.kind == Kind::Tombstone;
            let mut tombstone = None;
            if needs_payload {
                let payload = read_payload(&self.file, at, h.payload_len)?;
                if h.verify(&payload).is_err() {
                    break;
                }
                if h.kind == Kind::Tombstone {
                    tombstone = Some(payload);
                }
            }
            found.push(Found { offset: at, header: h, tombstone });
            at = end;
        }
        Ok((found, at))
    }

    /// Cut the file at `len` (a torn tail).
    pub fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.file.set_len(len)?;
        self.size = len;
        Ok(())
    }
}

/// The payload of the record whose header starts at `offset`.
pub fn read_payload(file: &File, offset: u64, len: u64) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, offset + HEADER_LEN as u64)?;
    Ok(buf)
}

/// The header and payload of the record at `offset`, checked.
pub fn read_record(file: &File, offset: u64) -> io::Result<(Header, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    file.read_exact_at(&mut h, offset)?;
    let header = Header::decode(&h).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let payload = read_payload(file, offset, header.payload_len)?;
    header.verify(&payload).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok((header, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Pools, checksum};

    fn header(kind: Kind, key: u8, payload: &[u8]) -> Header {
        Header {
            kind,
            depth: 0,
            key: [key; 32],
            parent: None,
            pools: Pools::default(),
            payload_len: payload.len() as u64,
            payload_checksum: checksum(payload),
        }
    }

    #[test]
    fn appends_scan_back_and_torn_tails_stop_the_scan() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Segment::create(dir.path(), 1).unwrap();
        let a = vec![1u8; 1000];
        let b = vec![2u8; 3000];
        let oa = s.append(&header(Kind::Page, 1, &a), &a).unwrap();
        let ob = s.append(&header(Kind::Snapshot, 1, &b), &b).unwrap();
        assert_eq!((oa, ob), (0, HEADER_LEN as u64 + 1000));
        let (found, end) = s.scan(true).unwrap();
        assert_eq!(found.len(), 2);
        assert_eq!(end, s.size);
        assert_eq!(read_record(&s.file, ob).unwrap().1, b);

        // A record cut short by a crash: the scan ends before it.
        let c = vec![3u8; 500];
        let oc = s.append(&header(Kind::Page, 2, &c), &c).unwrap();
        s.truncate(oc + HEADER_LEN as u64 + 100).unwrap();
        let (found, end) = Segment::open(dir.path(), 1).unwrap().scan(false).unwrap();
        assert_eq!((found.len(), end), (2, oc));

        // A payload whose bytes were not all written: only a payload check finds it.
        s.truncate(oc).unwrap();
        s.append(&header(Kind::Page, 2, &c), &c).unwrap();
        s.file.write_all_at(&[0u8; 10], oc + HEADER_LEN as u64 + 50).unwrap();
        let s = Segment::open(dir.path(), 1).unwrap();
        assert_eq!(s.scan(false).unwrap().0.len(), 3);
        assert_eq!(s.scan(true).unwrap().1, oc);
        assert!(read_record(&s.file, oc).is_err());
        assert_eq!(list(dir.path()).unwrap(), vec![1]);
    }
}
