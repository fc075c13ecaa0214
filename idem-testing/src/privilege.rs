//! Running installed server programs when the tests run as root: PostgreSQL
//! and PgBouncer both refuse to, so they run as an unprivileged account.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::HarnessError;

/// Runs installed server programs (PostgreSQL's, PgBouncer), as an
/// unprivileged account when this process is root.
#[derive(Debug)]
pub(crate) struct Runner {
    pub(crate) bin_dir: PathBuf,
    pub(crate) account: Option<Account>,
    drop_tool: Option<DropTool>,
}

/// The account a program runs as when this process is root.
#[derive(Debug)]
pub(crate) struct Account {
    pub(crate) name: String,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

#[derive(Debug)]
enum DropTool {
    Runuser(PathBuf),
    Setpriv(PathBuf),
}

impl Runner {
    /// Runs the programs of `bin_dir`: as `postgres` (or `nobody`) when this
    /// process is root, since PostgreSQL and PgBouncer both refuse root.
    pub(crate) fn for_bin_dir(bin_dir: PathBuf) -> Result<Runner, HarnessError> {
        let account = if is_root() {
            Some(unprivileged_account()?)
        } else {
            None
        };
        Runner::new(bin_dir, account)
    }

    fn new(bin_dir: PathBuf, account: Option<Account>) -> Result<Runner, HarnessError> {
        let drop_tool = match account {
            None => None,
            Some(_) => Some(if let Some(path) = find_program("runuser") {
                DropTool::Runuser(path)
            } else if let Some(path) = find_program("setpriv") {
                DropTool::Setpriv(path)
            } else {
                return Err(HarnessError::NoPrivilegeDropTool);
            }),
        };
        Ok(Runner {
            bin_dir,
            account,
            drop_tool,
        })
    }

    /// Hands `dir` to the account the programs run as, so they can write in it.
    pub(crate) fn give_dir(&self, dir: &Path) -> Result<(), HarnessError> {
        match &self.account {
            Some(account) => std::os::unix::fs::chown(dir, Some(account.uid), Some(account.gid))
                .map_err(|e| HarnessError::io(format!("chown {}", dir.display()), e)),
            None => Ok(()),
        }
    }

    /// `program` of the bin directory, run in `cwd` with no stdin.
    pub(crate) fn command(&self, program: &str, cwd: &Path) -> Command {
        let program = self.bin_dir.join(program);
        let mut cmd = match (&self.account, &self.drop_tool) {
            (Some(account), Some(DropTool::Runuser(runuser))) => {
                let mut cmd = Command::new(runuser);
                cmd.args(["-u", &account.name, "--"]).arg(program);
                cmd
            }
            (Some(account), Some(DropTool::Setpriv(setpriv))) => {
                let mut cmd = Command::new(setpriv);
                cmd.arg(format!("--reuid={}", account.uid))
                    .arg(format!("--regid={}", account.gid))
                    .args(["--clear-groups", "--"])
                    .arg(program);
                cmd
            }
            _ => Command::new(program),
        };
        // The caller's working directory may not be readable by the unprivileged account.
        cmd.current_dir(cwd).stdin(Stdio::null());
        cmd
    }
}

/// `name` on `PATH`, or in the usual system directories.
pub(crate) fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    // sbin is often missing from PATH in containers and CI, and that is where runuser lives.
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn unprivileged_account() -> Result<Account, HarnessError> {
    ["postgres", "nobody"]
        .into_iter()
        .find_map(lookup_account)
        .ok_or(HarnessError::NoUnprivilegedUser)
}

fn lookup_account(name: &str) -> Option<Account> {
    let c_name = CString::new(name).ok()?;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: passwd is plain old data; getpwnam_r fills it and points its strings into `buf`.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the duration of the call, and buf.len() is its real size.
    let rc = unsafe {
        libc::getpwnam_r(
            c_name.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return None;
    }
    // SAFETY: on success pw_name points to a NUL-terminated string inside `buf`.
    let name = unsafe { CStr::from_ptr(pwd.pw_name) }
        .to_string_lossy()
        .into_owned();
    Some(Account {
        name,
        uid: pwd.pw_uid,
        gid: pwd.pw_gid,
    })
}
