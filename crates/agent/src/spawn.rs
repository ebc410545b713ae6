//! Starting a child that shares the agent's memory until it execs:
//! `clone(CLONE_VM | CLONE_VFORK | SIGCHLD)` on a stack of its own, as
//! glibc's `posix_spawn` does. A `fork` of the agent copies its page tables
//! (every thread's stack, the heap, the pools) and then takes a copy-on-write
//! fault for each page either side touches; under emulation that was most of
//! what one short command cost beyond the guest's own `posix_spawn`.
//!
//! The rules of such a child, which [`vfork`]'s callers keep:
//!
//! - it writes none of the parent's memory: no allocation, no locks, no
//!   libc call that keeps state (glibc's `setuid` and friends signal every
//!   thread of the process to change theirs: the child makes the raw
//!   system calls instead);
//! - it never returns from its function: it ends in `execve` or `_exit`;
//! - signals: the calling thread blocks all of them (the internal ones
//!   too) across the clone, so that none of the agent's handlers runs on the
//!   child's stack; the child sets every disposition to the default before
//!   it unblocks them (in [`reset_signals`]).
//!
//! The calling thread sleeps until the child has exec'd or exited
//! (`CLONE_VFORK`); the other threads run on.

use std::ffi::c_void;
use std::io;
use std::sync::Mutex;

use crate::sys::lock;

/// The child's stack: it runs a few system calls and the exec.
const STACK_SIZE: usize = 128 * 1024;
/// Stacks kept for the next spawn (one per spawn running at once).
const KEEP_STACKS: usize = 8;

/// An anonymous mapping with a guard page at its low end.
struct Stack(*mut u8);

// SAFETY: a plain mapping, used by one spawn at a time.
unsafe impl Send for Stack {}

impl Stack {
    fn new() -> io::Result<Stack> {
        // SAFETY: a fresh private anonymous mapping, checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                STACK_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the first page of the mapping just made; an overflow faults there.
        unsafe { libc::mprotect(p, page_size(), libc::PROT_NONE) };
        Ok(Stack(p.cast()))
    }

    /// Its top, 16-byte aligned (the mapping is page aligned).
    fn top(&self) -> *mut c_void {
        // SAFETY: one past the end of the mapping, which the stack grows down from.
        unsafe { self.0.add(STACK_SIZE).cast() }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used.
        unsafe { libc::munmap(self.0.cast(), STACK_SIZE) };
    }
}

fn page_size() -> usize {
    // SAFETY: plain libc call.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

static STACKS: Mutex<Vec<Stack>> = Mutex::new(Vec::new());

/// The whole signal set as the kernel sees it (glibc's `sigfillset` leaves
/// out the two signals it uses itself).
const ALL_SIGNALS: u64 = !0;

fn sigprocmask(how: libc::c_int, set: &u64, old: *mut u64) {
    // SAFETY: the kernel reads 8 bytes from `set` and writes 8 to `old` (or none).
    unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            how,
            set as *const u64,
            old,
            std::mem::size_of::<u64>(),
        )
    };
}

/// Starts `child` in a new process that shares this one's memory until it
/// execs; returns its pid once it has exec'd or exited.
///
/// # Safety
/// `child` runs in that process: it must keep the rules of the module's
/// comment (async-signal-safe, allocation-free, writes none of the parent's
/// memory, ends in `execve` or `_exit` (one that returns exits with 127),
/// calls [`reset_signals`] before it unblocks signals).
pub(crate) unsafe fn vfork<F: FnMut()>(mut child: F) -> io::Result<libc::pid_t> {
    extern "C" fn entry<F: FnMut()>(arg: *mut c_void) -> libc::c_int {
        // SAFETY: `arg` is the `&mut F` below; the parent sleeps until this
        // process execs or exits, so it stays valid and unshared.
        let f = unsafe { &mut *arg.cast::<F>() };
        f();
        // It must not return (libc's clone would then exit with its value);
        // should it, it ends here.
        // SAFETY: ends the child without running anything of the parent's.
        unsafe { libc::_exit(127) }
    }
    let stack = match lock(&STACKS).pop() {
        Some(s) => s,
        None => Stack::new()?,
    };
    let mut old: u64 = 0;
    sigprocmask(libc::SIG_SETMASK, &ALL_SIGNALS, &mut old);
    // SAFETY: `entry` runs `child` on its own stack; CLONE_VFORK keeps this
    // frame (and `child`) alive and untouched until the child execs or exits.
    let pid = unsafe {
        libc::clone(
            entry::<F>,
            stack.top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&mut child as *mut F).cast(),
        )
    };
    let err = io::Error::last_os_error();
    sigprocmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    let mut stacks = lock(&STACKS);
    if stacks.len() < KEEP_STACKS {
        stacks.push(stack);
    }
    if pid < 0 {
        return Err(err);
    }
    Ok(pid)
}

/// In the child: every signal's disposition back to the default (the
/// agent's handlers must not run in it, and what the agent ignores, such as
/// `SIGPIPE`, the command must not), then every signal unblocked.
///
/// # Safety
/// Only in a child of [`vfork`] (or of `fork`).
pub(crate) unsafe fn reset_signals() {
    // The kernel's `struct sigaction` with everything zero: SIG_DFL, no
    // flags, an empty mask (sized for any layout).
    let dfl = [0u64; 4];
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: the kernel reads the zeroed struct; no old action wanted.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                dfl.as_ptr(),
                std::ptr::null_mut::<c_void>(),
                std::mem::size_of::<u64>(),
            )
        };
    }
    sigprocmask(libc::SIG_SETMASK, &0, std::ptr::null_mut());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child that sets a status and exits, reaped here: the parent gets
    /// its pid after the child is done with the shared memory.
    #[test]
    fn a_child_runs_on_its_own_stack_and_the_parent_goes_on() {
        for code in [0, 3] {
            // SAFETY: the child makes system calls only and exits.
            let pid = unsafe {
                vfork(|| {
                    reset_signals();
                    libc::_exit(code)
                })
            }
            .unwrap();
            let mut status = 0;
            // SAFETY: waits for our own child.
            let r = unsafe { libc::waitpid(pid, &mut status, 0) };
            assert_eq!(r, pid);
            assert!(libc::WIFEXITED(status));
            assert_eq!(libc::WEXITSTATUS(status), code);
        }
    }

    #[test]
    fn the_parents_signal_mask_is_restored() {
        let mut before: u64 = 0;
        sigprocmask(libc::SIG_BLOCK, &0, &mut before);
        // SAFETY: as above.
        let pid = unsafe { vfork(|| libc::_exit(0)) }.unwrap();
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        let mut after: u64 = 0;
        sigprocmask(libc::SIG_BLOCK, &0, &mut after);
        assert_eq!(before, after);
    }
}
