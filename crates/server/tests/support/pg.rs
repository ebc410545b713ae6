//! A throwaway PostgreSQL cluster for a test: `initdb` into a temp dir,
//! `pg_ctl start` on a free port of 127.0.0.1 (trust authentication, no
//! fsync), one database per [`PgCluster::database`], stopped and removed
//! when dropped. As root, the cluster runs as `nobody` (`initdb` refuses
//! root). Without PostgreSQL's binaries: a failure when `CI` is set, else
//! `None` and a message (the test then skips).
//!
//! Shared by the store's unit tests and the router's tests (`#[path]`).

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct PgCluster {
    dir: PathBuf,
    bin: PathBuf,
    user: Option<String>,
    pub port: u16,
    super_user: String,
}

/// The newest installed PostgreSQL's `bin` directory.
fn pg_bin() -> Option<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, b)| b)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind: {e}"));
    l.local_addr().unwrap_or_else(|e| panic!("{e}")).port()
}

impl PgCluster {
    /// Starts a cluster, or `None` (with a message) where PostgreSQL is
    /// not installed and `CI` is not set.
    pub fn start() -> Option<PgCluster> {
        let Some(bin) = pg_bin() else {
            if std::env::var_os("CI").is_some() {
                panic!(
                    "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): \
                     scripts/host-packages.sh installs it"
                );
            }
            eprintln!(
                "SKIPPED: PostgreSQL is not installed (scripts/host-packages.sh installs it)"
            );
            return None;
        };
        let dir = std::env::temp_dir().join(format!("rt-pg-{}", uuid_like()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let user = is_root().then(|| "nobody".to_string());
        if user.is_some() {
            let st = Command::new("chown")
                .args(["nobody", &dir.display().to_string()])
                .status()
                .unwrap_or_else(|e| panic!("chown: {e}"));
            assert!(st.success(), "chown of the cluster's dir failed");
        }
        let super_user = user
            .clone()
            .unwrap_or_else(|| std::env::var("USER").unwrap_or_else(|_| "postgres".into()));
        let c = PgCluster {
            dir,
            bin,
            user,
            port: free_port(),
            super_user,
        };
        c.run(
            "initdb",
            &[
                "-D",
                &c.data().display().to_string(),
                "-A",
                "trust",
                "-U",
                &c.super_user,
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
        );
        c.run(
            "pg_ctl",
            &[
                "-D",
                &c.data().display().to_string(),
                "-l",
                &c.dir.join("log").display().to_string(),
                "-w",
                "-o",
                &format!(
                    "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off",
                    c.port,
                    c.dir.display()
                ),
                "start",
            ],
        );
        Some(c)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let path = self.bin.join(tool);
        let out = match &self.user {
            Some(u) => Command::new("runuser")
                .args(["-u", u, "--"])
                .arg(&path)
                .args(args)
                .current_dir(&self.dir)
                .output(),
            None => Command::new(&path).args(args).output(),
        }
        .unwrap_or_else(|e| panic!("{tool}: {e}"));
        assert!(
            out.status.success(),
            "{tool} failed: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
        );
    }

    /// Makes a new database and answers its URL.
    pub fn database(&self) -> String {
        let name = format!("t{}", uuid_like());
        self.run(
            "createdb",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                &self.super_user,
                &name,
            ],
        );
        self.url(&name)
    }

    pub fn url(&self, db: &str) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{db}",
            self.super_user, self.port
        )
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let path = self.bin.join("pg_ctl");
        let data = self.data().display().to_string();
        let args = ["-D", data.as_str(), "-m", "immediate", "-w", "stop"];
        let _ = match &self.user {
            Some(u) => Command::new("runuser")
                .args(["-u", u, "--"])
                .arg(&path)
                .args(args)
                .output(),
            None => Command::new(&path).args(args).output(),
        };
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn uuid_like() -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    let n = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:x}{:x}", std::process::id(), n)
}
