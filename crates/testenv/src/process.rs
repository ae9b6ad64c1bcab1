//! Child processes (etcd, kube-apiserver) that never outlive the process that started them.
//!
//! Linux delivers `PR_SET_PDEATHSIG` when the *thread* that forked the child exits, not the process. Test
//! harnesses run each test on its own short-lived thread, so children are forked from one dedicated thread
//! that lives as long as the process does.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::{Error, Result};

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("testenv-spawner".into())
            .spawn(move || {
                // The sender lives in a static, so this loop (and the thread) ends only with the process.
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("spawning the testenv process thread");
        Mutex::new(tx)
    })
}

/// A running child whose output goes to a log file.
pub struct ManagedProcess {
    name: &'static str,
    child: Mutex<Child>,
    log: PathBuf,
    /// Set once we ask it to stop, so an exit we caused is not reported as a crash.
    stopping: AtomicBool,
}

impl ManagedProcess {
    pub fn spawn(name: &'static str, command: Command, log: &Path) -> Result<Self> {
        let log_file =
            File::create(log).map_err(|e| Error::io(format!("creating {}", log.display()), e))?;
        let child = start_child(name, command, log_file)?;
        Ok(ManagedProcess {
            name,
            child: Mutex::new(child),
            log: log.to_path_buf(),
            stopping: AtomicBool::new(false),
        })
    }

    /// Stops the process (SIGTERM, then SIGKILL after `grace`) and starts `command` in its place, its
    /// output appended to the same log. The exit this causes is not reported as a crash.
    pub fn restart(&self, command: Command, grace: Duration) -> Result<()> {
        self.stop(grace);
        let log_file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .map_err(|e| Error::io(format!("opening {}", self.log.display()), e))?;
        let child = start_child(self.name, command, log_file)?;
        *self.child.lock().expect("child lock") = child;
        self.stopping.store(false, Ordering::SeqCst);
        Ok(())
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.lock().expect("child lock").id()
    }

    /// The exit status if the process has ended.
    pub fn exited(&self) -> Option<ExitStatus> {
        self.child
            .lock()
            .expect("child lock")
            .try_wait()
            .ok()
            .flatten()
    }

    /// The exit status if the process ended without being asked to.
    pub fn crashed(&self) -> Option<ExitStatus> {
        let status = self.exited()?;
        (!self.stopping.load(Ordering::SeqCst)).then_some(status)
    }

    /// SIGTERM, then SIGKILL if it has not exited after `grace`.
    pub fn stop(&self, grace: Duration) {
        self.stopping.store(true, Ordering::SeqCst);
        let mut child = self.child.lock().expect("child lock");
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        // SAFETY: plain kill(2) on a pid we own and have not reaped yet.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// The last `lines` lines of the process's output.
    pub fn log_tail(&self, lines: usize) -> String {
        tail_of_file(&self.log, lines)
            .unwrap_or_else(|e| format!("(cannot read {}: {e})", self.log.display()))
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// Reads at most the last 256 KiB of a file and returns its last `lines` lines.
/// Starts `command` from the spawner thread, its output going to `log_file`, in its own process group,
/// killed if this process dies.
fn start_child(name: &'static str, mut command: Command, log_file: File) -> Result<Child> {
    let stderr = log_file
        .try_clone()
        .map_err(|e| Error::io("duplicating a log file handle", e))?;
    let parent = std::process::id() as libc::pid_t;
    command
        .stdin(Stdio::null())
        .stdout(log_file)
        .stderr(stderr)
        // Own process group: a Ctrl-C in the demo's terminal reaches us, and we stop the children in order.
        .process_group(0);
    // SAFETY: the closure runs between fork and exec and calls only async-signal-safe libc functions.
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let (reply_tx, reply_rx) = mpsc::channel();
    spawner()
        .lock()
        .expect("spawner lock")
        .send((command, reply_tx))
        .map_err(|_| Error::io(format!("starting {name}"), io::Error::other("spawner gone")))?;
    reply_rx
        .recv()
        .map_err(|_| Error::io(format!("starting {name}"), io::Error::other("spawner gone")))?
        .map_err(|e| Error::io(format!("starting {name}"), e))
}

fn tail_of_file(path: &Path, lines: usize) -> io::Result<String> {
    const WINDOW: u64 = 256 * 1024;
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(WINDOW)))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    Ok(all[all.len().saturating_sub(lines)..].join("\n"))
}
