//! The guest agent: PID 1 of every sandbox VM. It mounts the basics, reaps
//! zombies, and serves the host over one virtio-serial port (the protocol of
//! `runtime-proto`): commands, files, clock and entropy after a restore.
//!
//! It depends on `runtime-proto`, `libc` and `serde_json` only; no async
//! runtime (plain threads). As PID 1 it must never exit or panic: every
//! failure is logged to the serial console and retried.
//!
//! `runtime-agent --socket PATH` connects to a Unix socket instead of the
//! port and skips the PID 1 duties, so tests can run it as a normal process.

mod agent;
mod cgroup;
mod dns;
mod exec;
mod files;
mod init;
mod link;
mod net;
mod pool;
mod reaper;
mod share;
mod spawn;
mod sudo;
mod switch_root;
mod sys;
mod trace;
mod tunnel;
mod udp;
mod watch;

use std::path::PathBuf;
use std::time::Duration;

use sys::log;

fn main() {
    if sudo::invoked() {
        sudo::main();
    }
    // SAFETY: plain getters.
    if unsafe { libc::geteuid() != libc::getuid() } {
        // Installed setuid as `sudo` only: under any other name, nothing.
        eprintln!("runtime-agent: refusing to run setuid except as sudo");
        std::process::exit(1);
    }
    let mut socket: Option<PathBuf> = None;
    let mut proxy_port: Option<u16> = None;
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--socket" {
            socket = args.next().map(PathBuf::from);
        } else if arg == "--proxy-port" {
            // Test mode: where to listen for outbound connections.
            proxy_port = args.next().and_then(|p| p.to_str()?.parse().ok());
        } else {
            // The kernel hands init the command-line words it does not know.
            log!("ignoring argument {arg:?}");
        }
    }
    // SAFETY: plain syscalls.
    let pid1 = unsafe { libc::getpid() } == 1;
    if pid1 {
        proxy_port = Some(runtime_proto::PROXY_PORT);
    }
    // SAFETY: as above.
    unsafe { libc::umask(0o022) };
    if pid1 {
        // Started as /init of the initramfs: move onto the disk first. Its
        // errors are logged after init, once the console is open (an
        // initramfs without /dev/console starts init with no stdio).
        let switched = if switch_root::in_initramfs() {
            switch_root::switch_to_disk("/dev/vda")
        } else {
            Ok(())
        };
        init::run();
        if let Err(e) = switched {
            log!("cannot switch to the root disk: {e}");
        }
    } else {
        // Orphans of our commands come back to us, as they would to PID 1.
        // SAFETY: plain prctl.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
    let reaper = reaper::Reaper::start();
    loop {
        let served =
            std::panic::catch_unwind(|| agent::serve(socket.as_deref(), &reaper, proxy_port));
        if served.is_err() {
            log!("the main loop panicked; restarting it");
        }
        if !pid1 {
            // Test mode: the host (the test) is gone.
            std::process::exit(if served.is_ok() { 0 } else { 1 });
        }
        log!("the main loop ended; restarting it");
        std::thread::sleep(Duration::from_secs(1));
    }
}
