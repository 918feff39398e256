//! Child processes driven line by line: their output is read on threads so that every
//! wait for a line is bounded, and a child still running when its handle is dropped is
//! killed, so no error path leaves one behind. Used by the benchmarks that run their
//! two sides as separate processes (`sluice bench transfer`).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

/// Lines of `r`, read on their own thread so that every wait for one can be bounded.
pub(crate) fn read_lines(r: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    forward_lines(r, tx);
    rx
}

fn forward_lines(r: impl Read + Send + 'static, tx: mpsc::Sender<String>) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
}

/// Waits up to `timeout` for a line that is `tag` or starts with `tag `; returns the
/// rest. Other lines are skipped.
pub(crate) fn expect_line(lines: &mpsc::Receiver<String>, from: &str, tag: &str, timeout: Duration) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) if line == tag => return Ok(String::new()),
            Ok(line) => {
                if let Some(rest) = line.strip_prefix(tag).and_then(|r| r.strip_prefix(' ')) {
                    return Ok(rest.to_string());
                }
            }
            Err(RecvTimeoutError::Timeout) => bail!("no `{tag}` from the {from} within {timeout:?}"),
            Err(RecvTimeoutError::Disconnected) => bail!("the {from} closed its output without a `{tag}` line"),
        }
    }
}

/// A child process whose output is read on threads (bounded waits), killed if it is
/// still running when dropped, so no error path leaves one behind.
pub(crate) struct Proc {
    name: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    /// Starts `cmd` with stdout (and, with `capture_stderr`, stderr) read as lines;
    /// otherwise stderr goes to ours.
    pub(crate) fn spawn(name: &'static str, cmd: &mut Command, capture_stderr: bool) -> std::io::Result<Proc> {
        let stderr = if capture_stderr { Stdio::piped() } else { Stdio::inherit() };
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(stderr).spawn()?;
        let (tx, lines) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            forward_lines(out, tx.clone());
        }
        if let Some(err) = child.stderr.take() {
            forward_lines(err, tx);
        }
        Ok(Proc { name, stdin: child.stdin.take(), child, lines })
    }

    pub(crate) fn expect(&mut self, tag: &str, timeout: Duration) -> Result<String> {
        expect_line(&self.lines, self.name, tag, timeout).map_err(|e| match self.child.try_wait() {
            Ok(Some(status)) => e.context(format!("the {} exited with {status}", self.name)),
            _ => e,
        })
    }

    pub(crate) fn send(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().ok_or_else(|| anyhow!("the {}'s stdin is closed", self.name))?;
        writeln!(stdin, "{line}").and_then(|()| stdin.flush()).with_context(|| format!("writing to the {}", self.name))
    }

    /// Closes its stdin and waits up to `timeout` for it to exit (killing it after
    /// that); returns its exit status and the output lines not read yet.
    pub(crate) fn finish(&mut self, timeout: Duration) -> Result<(ExitStatus, Vec<String>)> {
        self.stdin = None;
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("the {} did not exit within {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        // The pipes close at exit; the readers may still be forwarding the last lines.
        let mut rest = Vec::new();
        let drain = Instant::now() + Duration::from_secs(2);
        while let Ok(line) = self.lines.recv_timeout(drain.saturating_duration_since(Instant::now())) {
            rest.push(line);
        }
        Ok((status, rest))
    }

    pub(crate) fn finish_ok(&mut self, timeout: Duration) -> Result<()> {
        let (status, _) = self.finish(timeout)?;
        ensure!(status.success(), "the {} exited with {status}", self.name);
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
