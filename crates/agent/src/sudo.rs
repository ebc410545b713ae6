//! Runtime's `sudo`, for images that have none (docs/images.md "sudo in
//! every image"). The agent's own binary, installed at boot as
//! `/usr/bin/sudo` (root, setuid) when the image's root has no `sudo` on
//! the usual paths; started under the name `sudo`, it is this: passwordless
//! sudo for the sandbox user (uid 1000) and root, as the product's images
//! give, with sudo's common options (`-u`, `-g`, `-E`, `-H`, `-i`, `-s`,
//! `-n`, `-k`, `-v`, `--`). The binary is static: no loader reads `LD_*`.
//!
//! A marker, `/usr/lib/runtime/sudo.size`, holds the size of the copy it
//! installed: a later boot refreshes a copy still that size (a newer agent),
//! and leaves alone a `sudo` the image has since put there (`apt-get install
//! sudo` replaces the file; its size differs), dropping the marker.

use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::sys::log;

const TARGET: &str = "/usr/bin/sudo";
const MARKER: &str = "/usr/lib/runtime/sudo.size";
/// Where an image's own `sudo` would be.
const PLACES: &[&str] = &[
    "/usr/bin/sudo",
    "/bin/sudo",
    "/usr/sbin/sudo",
    "/sbin/sudo",
    "/usr/local/bin/sudo",
];
/// The sandbox user, who may use it beside root.
const SANDBOX_UID: u32 = 1000;
/// Debian's `secure_path`: the PATH of what sudo runs.
const SECURE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Whether this process was started as `sudo`.
pub(crate) fn invoked() -> bool {
    std::env::args_os()
        .next()
        .is_some_and(|a| Path::new(&a).file_name() == Some(OsStr::new("sudo")))
}

/// At boot (as root, on the image's root): puts Runtime's `sudo` in place
/// when the image has none, or refreshes the one an older agent put there.
pub(crate) fn supply() {
    let marked = std::fs::read_to_string(MARKER)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    let target_len = std::fs::metadata(TARGET).ok().map(|m| m.len());
    // Ours as installed: the marker holds the size the file still has.
    let ours = marked.is_some() && marked == target_len;
    if !ours {
        if marked.is_some() {
            // The image replaced or removed it since: not ours any more.
            let _ = std::fs::remove_file(MARKER);
        }
        if PLACES.iter().any(|p| Path::new(p).exists()) {
            return;
        }
    }
    let me = match std::fs::read("/proc/self/exe") {
        Ok(b) => b,
        Err(e) => {
            log!("supplying sudo: reading the agent: {e}");
            return;
        }
    };
    if ours && target_len == Some(me.len() as u64) {
        return;
    }
    if let Err(e) = install(&me) {
        log!("supplying sudo: {e}");
    }
}

fn install(me: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all("/usr/bin")?;
    std::fs::create_dir_all("/usr/lib/runtime")?;
    let fresh = format!("{TARGET}.runtime-new");
    std::fs::write(&fresh, me)?;
    std::os::unix::fs::chown(&fresh, Some(0), Some(0))?;
    // chmod after chown: a chown clears the setuid bit.
    std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(0o4755))?;
    std::fs::rename(&fresh, TARGET)?;
    std::fs::write(MARKER, format!("{}\n", me.len()))?;
    Ok(())
}

/// What the command line asks.
#[derive(Debug, PartialEq, Eq)]
struct Ask {
    user: Option<String>,
    group: Option<String>,
    keep_env: bool,
    login: bool,
    shell: bool,
    /// `-k`/`-v`/`-V` alone: nothing to run.
    nothing: bool,
    command: Vec<OsString>,
}

fn parse(args: &[OsString]) -> Result<Ask, String> {
    let mut a = Ask {
        user: None,
        group: None,
        keep_env: false,
        login: false,
        shell: false,
        nothing: false,
        command: Vec::new(),
    };
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].to_string_lossy().into_owned();
        if arg == "--" {
            i += 1;
            break;
        }
        if !arg.starts_with('-') || arg == "-" {
            break;
        }
        let mut value = |name: &str, inline: Option<&str>| -> Result<String, String> {
            if let Some(v) = inline {
                return Ok(v.to_string());
            }
            i += 1;
            args.get(i)
                .map(|v| v.to_string_lossy().into_owned())
                .ok_or_else(|| format!("option requires an argument -- '{name}'"))
        };
        if let Some(long) = arg.strip_prefix("--") {
            let (name, inline) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (long, None),
            };
            match name {
                "user" => a.user = Some(value("user", inline)?),
                "group" => a.group = Some(value("group", inline)?),
                "preserve-env" => a.keep_env = true,
                "login" => a.login = true,
                "shell" => a.shell = true,
                "set-home" | "non-interactive" => {}
                "reset-timestamp" | "remove-timestamp" | "validate" | "version" => a.nothing = true,
                _ => return Err(format!("unrecognized option '--{name}'")),
            }
            i += 1;
            continue;
        }
        // Short options, possibly grouped (`-nE`), a value last (`-u root`
        // or `-uroot`).
        let flags: Vec<char> = arg[1..].chars().collect();
        let mut j = 0;
        while j < flags.len() {
            let c = flags[j];
            match c {
                'u' | 'g' => {
                    let rest: String = flags[j + 1..].iter().collect();
                    let v = value(&c.to_string(), (!rest.is_empty()).then_some(rest.as_str()))?;
                    if c == 'u' {
                        a.user = Some(v);
                    } else {
                        a.group = Some(v);
                    }
                    j = flags.len();
                    continue;
                }
                'E' => a.keep_env = true,
                'i' => a.login = true,
                's' => a.shell = true,
                'H' | 'n' | 'S' | 'b' => {}
                'k' | 'K' | 'v' | 'V' => a.nothing = true,
                _ => return Err(format!("invalid option -- '{c}'")),
            }
            j += 1;
        }
        i += 1;
    }
    a.command = args[i..].to_vec();
    if a.command.is_empty() && !a.login && !a.shell && !a.nothing {
        return Err("usage: sudo [-u user] [-g group] [-EHins] [--] command [args...]".into());
    }
    Ok(a)
}

/// A passwd or group entry: name, id, gid (groups: the gid again), home,
/// shell.
fn entry(file: &str, key: &str) -> Option<(String, u32, u32, String, String)> {
    let text = std::fs::read_to_string(file).ok()?;
    let numeric = key.strip_prefix('#').and_then(|n| n.parse::<u32>().ok());
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        let id = f.get(2)?.parse::<u32>().ok()?;
        let hit = f[0] == key || numeric == Some(id) || key.parse::<u32>().ok() == Some(id);
        if !hit {
            return None;
        }
        let gid = f.get(3).and_then(|g| g.parse().ok()).unwrap_or(id);
        Some((
            f[0].to_string(),
            id,
            gid,
            f.get(5).unwrap_or(&"/").to_string(),
            f.get(6).unwrap_or(&"/bin/sh").to_string(),
        ))
    })
}

fn die(msg: &str) -> ! {
    eprintln!("sudo: {msg}");
    std::process::exit(1)
}

/// `sudo …`: never returns.
pub(crate) fn main() -> ! {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    // SAFETY: plain getters.
    let (ruid, rgid) = unsafe { (libc::getuid(), libc::getgid()) };
    if ruid != 0 && ruid != SANDBOX_UID {
        die("only the sandbox user (uid 1000) and root may use sudo here");
    }
    let ask = parse(&args).unwrap_or_else(|e| die(&e));
    if ask.nothing {
        std::process::exit(0);
    }
    let who = ask.user.clone().unwrap_or_else(|| "root".into());
    let (name, uid, mut gid, home, login_shell) = match entry("/etc/passwd", &who) {
        Some(e) => e,
        None if who == "root" || who == "#0" => {
            ("root".into(), 0, 0, "/root".into(), "/bin/sh".into())
        }
        None => match who.strip_prefix('#').and_then(|n| n.parse::<u32>().ok()) {
            Some(n) => (n.to_string(), n, n, "/".into(), "/bin/sh".into()),
            None => die(&format!("unknown user {who}")),
        },
    };
    if let Some(g) = &ask.group {
        gid = match entry("/etc/group", g) {
            Some(e) => e.1,
            None => match g.strip_prefix('#').and_then(|n| n.parse::<u32>().ok()) {
                Some(n) => n,
                None => die(&format!("unknown group {g}")),
            },
        };
    }
    let caller = entry("/etc/passwd", &ruid.to_string())
        .map(|e| e.0)
        .unwrap_or_else(|| ruid.to_string());
    let mut env: Vec<(OsString, OsString)> = if ask.keep_env {
        std::env::vars_os().collect()
    } else {
        std::env::vars_os()
            .filter(|(k, _)| {
                matches!(
                    k.to_str(),
                    Some("TERM" | "LANG" | "LC_ALL" | "COLORTERM" | "DISPLAY" | "TZ")
                ) || k.to_str().is_some_and(|k| k.starts_with("LC_"))
            })
            .collect()
    };
    let mut set = |k: &str, v: &str| {
        env.retain(|(ek, _)| ek != k);
        env.push((k.into(), v.into()));
    };
    set("PATH", &secure_path());
    set("HOME", &home);
    set("USER", &name);
    set("LOGNAME", &name);
    set("SHELL", &login_shell);
    set("SUDO_USER", &caller);
    set("SUDO_UID", &ruid.to_string());
    set("SUDO_GID", &rgid.to_string());
    let shell = if Path::new(&login_shell).exists() {
        login_shell.clone()
    } else {
        "/bin/sh".into()
    };
    let argv: Vec<OsString> = if ask.login || ask.shell {
        let mut v: Vec<OsString> = vec![shell.clone().into()];
        if ask.login {
            v.push("-l".into());
        }
        if !ask.command.is_empty() {
            let line: Vec<String> = ask
                .command
                .iter()
                .map(|a| shell_quote(&a.to_string_lossy()))
                .collect();
            v.push("-c".into());
            v.push(line.join(" ").into());
        }
        v
    } else {
        ask.command.clone()
    };
    set(
        "SUDO_COMMAND",
        &argv
            .iter()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" "),
    );
    if ask.login {
        let _ = std::env::set_current_dir(&home);
    }
    // SAFETY: plain syscalls on values owned here; the order drops the
    // groups and the gid while still root.
    unsafe {
        let groups = [gid];
        if libc::setgroups(1, groups.as_ptr()) != 0
            || libc::setresgid(gid, gid, gid) != 0
            || libc::setresuid(uid, uid, uid) != 0
        {
            die(&format!(
                "cannot become {name}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    let program = resolve(&argv[0])
        .unwrap_or_else(|| die(&format!("{}: command not found", argv[0].to_string_lossy())));
    let c = |s: &OsStr| {
        CString::new(s.as_bytes()).unwrap_or_else(|_| die("an argument holds a NUL byte"))
    };
    let cargv: Vec<CString> = argv.iter().map(|a| c(a)).collect();
    let cenv: Vec<CString> = env
        .iter()
        .map(|(k, v)| {
            let mut kv = k.clone().into_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).unwrap_or_else(|_| die("an environment value holds a NUL byte"))
        })
        .collect();
    let mut pargv: Vec<*const libc::c_char> = cargv.iter().map(|a| a.as_ptr()).collect();
    pargv.push(std::ptr::null());
    let mut penv: Vec<*const libc::c_char> = cenv.iter().map(|a| a.as_ptr()).collect();
    penv.push(std::ptr::null());
    let prog = c(program.as_os_str());
    // SAFETY: NUL-terminated arrays of valid C strings that outlive the call.
    unsafe { libc::execve(prog.as_ptr(), pargv.as_ptr(), penv.as_ptr()) };
    die(&format!(
        "{}: {}",
        argv[0].to_string_lossy(),
        std::io::Error::last_os_error()
    ))
}

/// Debian's secure path, then the tools supplied to an image that has no
/// shell (docs/images.md, "Images without a shell") when it got them.
fn secure_path() -> String {
    if Path::new(crate::exec::SUPPLIED_SH).is_file() {
        format!("{SECURE_PATH}:{}", crate::exec::SUPPLIED_BIN)
    } else {
        SECURE_PATH.to_string()
    }
}

/// The program `name` names: itself when it has a `/`, else the first
/// executable file of that name on the secure path.
fn resolve(name: &OsStr) -> Option<std::path::PathBuf> {
    if name.as_bytes().contains(&b'/') {
        return Some(name.into());
    }
    secure_path()
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn sudos_common_options_are_read_and_the_command_is_what_follows() {
        let a = parse(&args(&["-u", "nobody", "-E", "id", "-u"])).unwrap();
        assert_eq!(a.user.as_deref(), Some("nobody"));
        assert!(a.keep_env);
        assert_eq!(a.command, args(&["id", "-u"]));
        let a = parse(&args(&["-nE", "-uroot", "--", "-weird"])).unwrap();
        assert_eq!(a.user.as_deref(), Some("root"));
        assert_eq!(a.command, args(&["-weird"]));
        let a = parse(&args(&["--user=app", "--preserve-env", "env"])).unwrap();
        assert_eq!(a.user.as_deref(), Some("app"));
        assert!(a.keep_env);
        let a = parse(&args(&["-i"])).unwrap();
        assert!(a.login && a.command.is_empty());
        assert!(parse(&args(&["-k"])).unwrap().nothing);
        assert!(parse(&args(&[])).is_err());
        assert!(parse(&args(&["-u"])).is_err());
        assert!(parse(&args(&["-Z", "ls"])).is_err());
        assert!(parse(&args(&["--bogus", "ls"])).is_err());
    }

    #[test]
    fn a_login_command_line_is_quoted_for_the_shell() {
        assert_eq!(shell_quote("ls"), "ls");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
