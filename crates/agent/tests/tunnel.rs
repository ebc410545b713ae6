//! TCP tunnels through the agent binary, the test playing the host.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};

use common::Agent;
use runtime_proto::flow::WINDOW;
use runtime_proto::{channel, FailCode, Kind, Reply, Request, GUEST_STREAM};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Reads the tunnel's guest->host bytes until `Eof`, granting credit.
fn drain(a: &mut Agent, s: u32) -> Vec<u8> {
    let mut got = Vec::new();
    loop {
        let f = a.recv(s);
        match f.kind {
            Kind::Data => {
                assert_eq!(f.channel, channel::INPUT);
                got.extend_from_slice(&f.payload);
                a.send(
                    s,
                    &Request::Credit {
                        bytes: f.payload.len() as u32,
                    },
                );
            }
            Kind::Control => match f.parse::<Reply>().unwrap() {
                Reply::Eof => return got,
                Reply::Credit { .. } => {}
                other => panic!("unexpected {other:?}"),
            },
        }
    }
}

#[test]
fn connect_carries_bytes_both_ways_with_half_close() {
    let mut a = Agent::start();
    a.hello_session(1);
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    // The guest-side server echoes reversed once its input ends.
    let srv = std::thread::spawn(move || {
        let (mut c, _) = server.accept().unwrap();
        let mut all = Vec::new();
        c.read_to_end(&mut all).unwrap();
        all.reverse();
        c.write_all(&all).unwrap();
    });
    let s = a.new_stream();
    a.send(s, &Request::Connect { port });
    assert_eq!(a.reply(s), Reply::Done);
    let Reply::Credit { bytes: window } = a.reply(s) else {
        panic!("no window")
    };
    assert_eq!(window, WINDOW);
    let payload: Vec<u8> = (0..600_000u32).map(|i| (i % 253) as u8).collect();
    // Send within the window, waiting for credits.
    let mut sent = 0;
    let mut avail = window as usize;
    while sent < payload.len() {
        let n = avail.min(payload.len() - sent).min(100_000);
        if n == 0 {
            match a.reply(s) {
                Reply::Credit { bytes } => avail += bytes as usize,
                other => panic!("{other:?}"),
            }
            continue;
        }
        a.send_data(s, &payload[sent..sent + n]);
        sent += n;
        avail -= n;
    }
    a.send(s, &Request::Eof);
    a.send(s, &Request::Credit { bytes: WINDOW });
    let mut back = drain(&mut a, s);
    back.reverse();
    assert!(back == payload, "the bytes came back changed");
    srv.join().unwrap();

    // Nothing listens: refused.
    let s = a.new_stream();
    a.send(s, &Request::Connect { port: free_port() });
    assert!(matches!(
        a.reply(s),
        Reply::Failed {
            code: FailCode::ConnectionRefused,
            ..
        }
    ));
}

#[test]
fn outbound_connections_become_guest_streams_and_reset_on_a_new_session() {
    let port = free_port();
    let mut a = Agent::start_with(&["--proxy-port", &port.to_string()]);
    a.hello_session(7);
    let mut client = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(c) => break c,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    };
    client.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    client.shutdown(Shutdown::Write).unwrap();
    let f = a.next_any();
    let s = f.stream;
    assert!(s & GUEST_STREAM != 0, "guest ids have the high bit: {s:#x}");
    assert_eq!(f.parse::<Reply>().unwrap(), Reply::Outbound);
    assert_eq!(a.reply(s), Reply::Credit { bytes: WINDOW });
    // Nothing flows before the host opens the guest's window.
    a.send(s, &Request::Credit { bytes: WINDOW });
    assert_eq!(drain(&mut a, s), b"GET / HTTP/1.0\r\n\r\n");
    a.send_data(s, b"HTTP/1.0 200 OK\r\n\r\nhello");
    a.send(s, &Request::Eof);
    let mut answer = String::new();
    client.read_to_string(&mut answer).unwrap();
    assert_eq!(answer, "HTTP/1.0 200 OK\r\n\r\nhello");

    // The same session keeps a tunnel; a new one resets it.
    let mut c2 = TcpStream::connect(("127.0.0.1", port)).unwrap();
    // (Credits for the first tunnel's last bytes may come first.)
    let s2 = loop {
        let f = a.next_any();
        if f.stream != s {
            assert_eq!(f.parse::<Reply>().unwrap(), Reply::Outbound);
            break f.stream;
        }
    };
    assert_eq!(a.reply(s2), Reply::Credit { bytes: WINDOW });
    a.send(s2, &Request::Credit { bytes: WINDOW });
    a.hello_session(7);
    c2.write_all(b"still").unwrap();
    let f = a.recv(s2);
    assert_eq!(f.payload, b"still");
    a.hello_session(8);
    let mut rest = Vec::new();
    let r = c2.read_to_end(&mut rest);
    assert!(r.is_err() || rest.is_empty(), "{r:?} {rest:?}");
    // The host's frames for the forgotten stream are answered Close.
    a.send(s2, &Request::Credit { bytes: 1 });
    assert_eq!(a.reply(s2), Reply::Close);
}

#[test]
fn tunnels_beyond_the_cap_are_refused_until_some_end() {
    const MAX: usize = 512;
    let port = free_port();
    let mut a = Agent::start_with(&["--proxy-port", &port.to_string()]);
    a.hello_session(1);
    let connect = || loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(c) => break c,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    };
    let mut open = Vec::new();
    let mut announced = std::collections::HashSet::new();
    for _ in 0..MAX {
        open.push(connect());
    }
    while announced.len() < MAX {
        let f = a.next_any();
        if let Ok(Reply::Outbound) = f.parse::<Reply>() {
            announced.insert(f.stream);
        }
    }
    // One more is reset at once (after its accept), and never announced.
    let mut extra = connect();
    extra
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 1];
    let r = extra.read(&mut buf);
    assert!(
        matches!(r, Ok(0))
            || r.as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "{r:?}"
    );
    // A new session frees them all; a new connection is taken again.
    a.hello_session(2);
    let _again = connect();
    loop {
        let f = a.next_any();
        if let Ok(Reply::Outbound) = f.parse::<Reply>() {
            assert!(!announced.contains(&f.stream));
            break;
        }
    }
    drop(open);
}
