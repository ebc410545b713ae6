//! The Dockerfiles this server builds (docs/images.md "Dockerfiles"):
//! `FROM` (first, once), `RUN`, `COPY`/`ADD` of files given inline, `ENV`,
//! `WORKDIR`, `USER`, `ARG` (with `buildArgs`), and `CMD`/`ENTRYPOINT` read
//! as the image's `start`; a few others are accepted and ignored.

use serde_json::{json, Value};

use super::steps::{sh_quote, shell_form, Steps};
use super::{valid_abs, ImageError, ImageUser, InlineFile};

/// What is wrong with one instruction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Problem {
    #[error("the first instruction must be FROM")]
    FirstNotFrom,
    #[error("multi-stage builds are not supported")]
    MultiStage,
    #[error("expected KEY=VALUE")]
    ExpectedKeyEqualsValue,
    #[error("expected KEY VALUE")]
    ExpectedKeyValue,
    #[error("must be a path without ..")]
    WorkdirNotNormal,
    #[error("user {0}: only root and runtime (uid 1000) exist")]
    UnknownUser(String),
    #[error("bad JSON form")]
    BadJsonForm,
    #[error("expected COPY <src>... <dest>")]
    CopyArguments,
    #[error("{0} is not among the build's files")]
    NotAmongFiles(String),
    #[error("the destination must be a path without ..")]
    DestinationNotNormal,
    #[error("not a supported instruction")]
    Unsupported,
}

/// What a Dockerfile says besides its steps.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Parsed {
    /// The image `FROM` names; `None` for the server's own.
    pub(crate) base: Option<String>,
    /// The last `CMD` or `ENTRYPOINT`, as `{"command": …}`.
    pub(crate) start: Option<Value>,
}

/// Reads `text` into `b`'s steps. `files` are what `COPY` may name; `args`
/// the build's `buildArgs`.
pub(crate) fn parse(
    b: &mut Steps,
    text: &str,
    files: &[InlineFile],
    args: &[(String, String)],
) -> Result<Parsed, ImageError> {
    let mut out = Parsed::default();
    let mut argv: Vec<(String, String)> = Vec::new();
    let mut seen_from = false;
    for (n, l) in logical_lines(text).iter().enumerate() {
        let (op, rest) = l
            .split_once(char::is_whitespace)
            .unwrap_or((l.as_str(), ""));
        let rest = rest.trim();
        let op = op.to_ascii_uppercase();
        let at = |problem: Problem| ImageError::Instruction {
            n: n + 1,
            op: op.clone(),
            problem,
        };
        if !seen_from && op != "FROM" && op != "ARG" {
            return Err(at(Problem::FirstNotFrom));
        }
        match op.as_str() {
            "FROM" => {
                if seen_from {
                    return Err(at(Problem::MultiStage));
                }
                seen_from = true;
                let r = substitute(rest, &argv, &[]);
                // `--platform=…` is ours to choose (linux/amd64).
                let r = r
                    .split_whitespace()
                    .find(|t| !t.starts_with("--"))
                    .unwrap_or("");
                if !matches!(
                    r,
                    "runtime" | "default" | "runtime:latest" | "default:latest"
                ) {
                    out.base = Some(r.to_string());
                }
            }
            "ARG" => {
                let (k, default) = match rest.split_once('=') {
                    Some((k, v)) => (k.trim(), Some(v.trim().trim_matches('"'))),
                    None => (rest, None),
                };
                let v = args
                    .iter()
                    .find(|(a, _)| a == k)
                    .map(|(_, v)| v.clone())
                    .or(default.map(str::to_string))
                    .unwrap_or_default();
                argv.retain(|(a, _)| a != k);
                argv.push((k.to_string(), v));
            }
            "ENV" => {
                let rest = substitute(rest, &argv, &b.state.env);
                if rest.contains('=') {
                    for pair in rest.split_whitespace() {
                        let (k, v) = pair
                            .split_once('=')
                            .ok_or_else(|| at(Problem::ExpectedKeyEqualsValue))?;
                        b.state.set_env(k, v.trim_matches('"'));
                    }
                } else {
                    let (k, v) = rest
                        .split_once(char::is_whitespace)
                        .ok_or_else(|| at(Problem::ExpectedKeyValue))?;
                    b.state.set_env(k, v.trim().trim_matches('"'));
                }
            }
            "WORKDIR" => {
                let w = substitute(rest, &argv, &b.state.env);
                let w = if w.starts_with('/') {
                    w
                } else {
                    format!(
                        "{}/{w}",
                        b.state
                            .workdir
                            .as_deref()
                            .unwrap_or("")
                            .trim_end_matches('/')
                    )
                };
                if !valid_abs(&w) {
                    return Err(at(Problem::WorkdirNotNormal));
                }
                b.workdir(&w);
            }
            "USER" => {
                let u = substitute(rest, &argv, &b.state.env);
                b.state.user = match u.as_str() {
                    "root" | "0" | "0:0" => ImageUser::Root,
                    // The sandbox user is `runtime` in the image (it was
                    // `user` on the older base; both names mean uid 1000).
                    "runtime" | "runtime:runtime" | "user" | "1000" | "1000:1000" | "sandbox" => {
                        ImageUser::User
                    }
                    other => return Err(at(Problem::UnknownUser(other.to_string()))),
                };
            }
            "RUN" => {
                let cmd = shell_form(rest).ok_or_else(|| at(Problem::BadJsonForm))?;
                // ARG values are in the step's environment, as in Docker.
                let prefix: String = argv
                    .iter()
                    .map(|(k, v)| format!("{k}={} ", sh_quote(v)))
                    .collect();
                let script = if prefix.is_empty() {
                    cmd.clone()
                } else {
                    format!("export {prefix}; {cmd}")
                };
                b.push(format!("RUN {cmd}"), script);
            }
            "COPY" | "ADD" => {
                let parts: Vec<String> = substitute(rest, &argv, &b.state.env)
                    .split_whitespace()
                    .filter(|p| !p.starts_with("--"))
                    .map(str::to_string)
                    .collect();
                let Some((dest, srcs)) = parts.split_last().filter(|(_, s)| !s.is_empty()) else {
                    return Err(at(Problem::CopyArguments));
                };
                let base_dir = b.state.workdir.clone().unwrap_or_else(|| "/".into());
                for src in srcs {
                    let src = src.trim_start_matches("./");
                    let f = files
                        .iter()
                        .find(|f| f.path.trim_start_matches("./").trim_start_matches('/') == src)
                        .ok_or_else(|| at(Problem::NotAmongFiles(src.to_string())))?;
                    // `dir/`, `.` and `dir/.` name a directory to copy into.
                    let into_dir = dest.ends_with('/')
                        || dest == "."
                        || dest.ends_with("/.")
                        || srcs.len() > 1;
                    let target = if into_dir {
                        format!(
                            "{}/{}",
                            dest.trim_end_matches('/'),
                            src.rsplit('/').next().unwrap_or(src)
                        )
                    } else {
                        dest.clone()
                    };
                    let target = if target.starts_with('/') {
                        target
                    } else {
                        format!("{}/{target}", base_dir.trim_end_matches('/'))
                    };
                    if !valid_abs(&target) {
                        return Err(at(Problem::DestinationNotNormal));
                    }
                    b.file(&target, &f.data, f.mode);
                }
            }
            "CMD" | "ENTRYPOINT" => {
                let cmd = shell_form(rest).ok_or_else(|| at(Problem::BadJsonForm))?;
                out.start = Some(json!({ "command": cmd }));
            }
            "LABEL" | "EXPOSE" | "MAINTAINER" | "SHELL" | "STOPSIGNAL" | "HEALTHCHECK"
            | "VOLUME" => {}
            _ => return Err(at(Problem::Unsupported)),
        }
    }
    if !seen_from {
        return Err(ImageError::NoFrom);
    }
    Ok(out)
}

/// The instructions of `text`: blank lines and comment lines dropped (also
/// inside a continued instruction), lines ending in `\` joined with the
/// next.
fn logical_lines(text: &str) -> Vec<String> {
    let mut logical = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
            continue;
        }
        cur.push_str(t);
        logical.push(std::mem::take(&mut cur));
    }
    if !cur.is_empty() {
        logical.push(cur);
    }
    logical
}

/// `$NAME` and `${NAME}` replaced by the build's variables (ENV before
/// ARG), each name read whole and each value put in as it is; an unknown
/// name stays as written.
fn substitute(s: &str, argv: &[(String, String)], env: &[(String, String)]) -> String {
    let value = |name: &str| {
        env.iter()
            .chain(argv.iter())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let (name, len) = if let Some(braced) = after.strip_prefix('{') {
            match braced.find('}') {
                Some(end) => (&braced[..end], end + 2),
                None => ("", 0),
            }
        } else {
            let end = after
                .char_indices()
                .find(|(k, c)| {
                    !(c.is_ascii_alphanumeric() || *c == '_') || (*k == 0 && c.is_ascii_digit())
                })
                .map_or(after.len(), |(k, _)| k);
            (&after[..end], end)
        };
        match value(name).filter(|_| !name.is_empty()) {
            Some(v) => {
                out.push_str(v);
                rest = &after[len..];
            }
            None => {
                out.push('$');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::super::steps::BuildState;
    use super::*;

    fn file(path: &str, data: &str) -> InlineFile {
        InlineFile {
            path: path.into(),
            data: data.as_bytes().to_vec(),
            mode: None,
        }
    }

    fn build(
        text: &str,
        files: &[InlineFile],
        args: &[(&str, &str)],
    ) -> Result<(Steps, Parsed), String> {
        let mut b = Steps::new(
            "base-abc",
            BuildState {
                env: Vec::new(),
                workdir: None,
                user: ImageUser::Root,
            },
        );
        let args: Vec<(String, String)> = args
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let p = parse(&mut b, text, files, &args).map_err(|e| e.to_string())?;
        Ok((b, p))
    }

    fn ok(text: &str) -> Steps {
        build(text, &[], &[]).unwrap().0
    }

    fn err(text: &str, files: &[InlineFile]) -> String {
        build(text, files, &[]).err().unwrap_or_default()
    }

    fn instructions(b: &Steps) -> Vec<&str> {
        b.steps.iter().map(|s| s.instruction.as_str()).collect()
    }

    fn env(b: &Steps) -> Vec<(&str, &str)> {
        b.state
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    #[test]
    fn a_whole_dockerfile_with_pinned_keys() {
        let files = [InlineFile {
            path: "app.py".into(),
            data: b"print(1)".to_vec(),
            mode: Some(0o755),
        }];
        let (b, p) = build(
            "ARG V=1\nFROM runtime\nENV X=$V Y=b\nWORKDIR app\nCOPY app.py ./\nUSER 1000\n\
             RUN [\"python3\", \"app.py\"]\nCMD python3 app.py",
            &files,
            &[("V", "2")],
        )
        .unwrap();
        assert_eq!(p.base, None);
        assert_eq!(p.start, Some(json!({"command": "python3 app.py"})));
        assert_eq!(
            instructions(&b),
            [
                "WORKDIR /app",
                // `./` is kept as written: the path is the same file.
                "COPY /app/./app.py (8 bytes, sha256 d287bb7f9d15)",
                "RUN 'python3' 'app.py'"
            ]
        );
        // The key the server has always given this step.
        assert_eq!(
            b.steps[0].key,
            "d7705ff46f50ecfd787eaa50730aa3114f363bb883fc46e1787b9dbd886ab0df"
        );
        assert_eq!(
            b.steps[1].script.as_deref(),
            Some(
                "mkdir -p '/app/.' && printf '%s' 'cHJpbnQoMSk=' | base64 -d > '/app/./app.py' && \
                 chmod 755 '/app/./app.py' && chown 0:0 '/app/./app.py'"
            )
        );
        assert_eq!(
            b.steps[2].script.as_deref(),
            Some("export V='2' ; 'python3' 'app.py'")
        );
        assert_eq!(
            b.steps.iter().map(|s| s.root).collect::<Vec<_>>(),
            [true, true, false]
        );
        assert_eq!(b.steps[2].workdir.as_deref(), Some("/app"));
        assert_eq!(env(&b), [("X", "2"), ("Y", "b")]);
        assert_eq!(b.state.user, ImageUser::User);
    }

    #[test]
    fn from_names_the_servers_image_or_one_of_ours() {
        for f in ["runtime", "default", "runtime:latest", "default:latest"] {
            assert_eq!(
                build(&format!("FROM {f}"), &[], &[]).unwrap().1.base,
                None,
                "{f}"
            );
        }
        let base = |t: &str, args: &[(&str, &str)]| build(t, &[], args).unwrap().1.base;
        assert_eq!(base("FROM app:1 AS build", &[]).as_deref(), Some("app:1"));
        assert_eq!(
            base("FROM --platform=linux/amd64 python:3.12-slim", &[]).as_deref(),
            Some("python:3.12-slim")
        );
        assert_eq!(base("from app@2", &[]).as_deref(), Some("app@2"));
        assert_eq!(base("ARG B=app\nFROM $B", &[]).as_deref(), Some("app"));
        assert_eq!(
            base("ARG B=app\nFROM ${B}:v2", &[("B", "web")]).as_deref(),
            Some("web:v2")
        );
    }

    #[test]
    fn run_has_a_shell_and_an_exec_form_and_sees_the_args() {
        let b = ok("FROM runtime\nRUN echo hi && true\nrun [\"echo\", \"it's\"]");
        assert_eq!(
            instructions(&b),
            ["RUN echo hi && true", r"RUN 'echo' 'it'\''s'"]
        );
        assert_eq!(b.steps[0].script.as_deref(), Some("echo hi && true"));
        // RUN is not substituted: the shell expands the exported args.
        let (b, _) = build(
            "ARG A=1\nFROM runtime\nARG B\nARG C=\"x y\"\nRUN echo $A$B$C",
            &[],
            &[("B", "2")],
        )
        .unwrap();
        assert_eq!(b.steps[0].instruction, "RUN echo $A$B$C");
        assert_eq!(
            b.steps[0].script.as_deref(),
            Some("export A='1' B='2' C='x y' ; echo $A$B$C")
        );
        // A build arg no ARG declares is not used; a later ARG replaces one.
        let (b, _) = build(
            "FROM runtime\nARG A=1\nARG A=3\nRUN true",
            &[],
            &[("Z", "9")],
        )
        .unwrap();
        assert_eq!(b.steps[0].script.as_deref(), Some("export A='3' ; true"));
    }

    #[test]
    fn env_has_both_forms_and_substitutes_earlier_values() {
        let b =
            ok("FROM runtime\nENV A=1 B=\"two\"\nENV C hello world\nENV D \"q\"\nENV E=$A/${B}");
        assert_eq!(
            env(&b),
            [
                ("A", "1"),
                ("B", "two"),
                ("C", "hello world"),
                ("D", "q"),
                ("E", "1/two")
            ]
        );
        assert!(b.steps.is_empty());
        // A later value replaces an earlier one; later steps run with it.
        let b = ok("FROM runtime\nENV A=1\nRUN one\nENV A=2\nRUN two");
        assert_eq!(b.steps[0].env, [("A".to_string(), "1".to_string())]);
        assert_eq!(b.steps[1].env, [("A".to_string(), "2".to_string())]);
    }

    #[test]
    fn workdir_is_absolute_or_relative_to_the_previous_one() {
        let b = ok("FROM runtime\nWORKDIR b\nWORKDIR /a\nWORKDIR c/\nWORKDIR d\nWORKDIR /e");
        assert_eq!(
            instructions(&b),
            [
                "WORKDIR /b",
                "WORKDIR /a",
                "WORKDIR /a/c/",
                "WORKDIR /a/c/d",
                "WORKDIR /e"
            ]
        );
        assert_eq!(b.state.workdir.as_deref(), Some("/e"));
        let b = ok("FROM runtime\nENV D=/srv\nWORKDIR $D/app");
        assert_eq!(b.state.workdir.as_deref(), Some("/srv/app"));
        // Made by root, owned by the user the build is at.
        let b = ok("FROM runtime\nUSER user\nWORKDIR /w");
        assert!(b.steps[0].root);
        assert_eq!(
            b.steps[0].script.as_deref(),
            Some("mkdir -p '/w' && chown 1000:1000 '/w'")
        );
    }

    #[test]
    fn user_is_root_or_the_sandbox_user() {
        for u in ["root", "0", "0:0"] {
            let b = ok(&format!("FROM runtime\nUSER user\nUSER {u}\nRUN id"));
            assert_eq!(b.state.user, ImageUser::Root, "{u}");
            assert!(b.steps[0].root);
        }
        for u in [
            "runtime",
            "runtime:runtime",
            "user",
            "1000",
            "1000:1000",
            "sandbox",
        ] {
            let b = ok(&format!("FROM runtime\nUSER {u}\nRUN id"));
            assert_eq!(b.state.user, ImageUser::User, "{u}");
            assert!(!b.steps[0].root);
        }
        let b = ok("FROM runtime\nARG U=user\nUSER $U");
        assert_eq!(b.state.user, ImageUser::User);
    }

    #[test]
    fn copy_and_add_write_the_inline_files() {
        let files = [
            file("a.txt", "A"),
            file("./dir/b.txt", "B"),
            file("/c.txt", "C"),
        ];
        let (b, _) = build(
            "FROM runtime\nCOPY a.txt /etc/a.conf\nCOPY --chown=user:user ./a.txt dir/b.txt /opt/\n\
             WORKDIR /w\nADD c.txt c\nCOPY a.txt /",
            &files,
            &[],
        )
        .unwrap();
        assert_eq!(
            instructions(&b),
            [
                "COPY /etc/a.conf (1 bytes, sha256 559aead08264)",
                "COPY /opt/a.txt (1 bytes, sha256 559aead08264)",
                "COPY /opt/b.txt (1 bytes, sha256 df7e70e50215)",
                "WORKDIR /w",
                "COPY /w/c (1 bytes, sha256 6b23c0d5f35d)",
                "COPY /a.txt (1 bytes, sha256 559aead08264)",
            ]
        );
        // Several sources go into the destination as a directory.
        let (b, _) = build("FROM runtime\nCOPY a.txt dir/b.txt /x", &files, &[]).unwrap();
        assert_eq!(
            b.steps[1].instruction,
            "COPY /x/b.txt (1 bytes, sha256 df7e70e50215)"
        );
        // The file belongs to the build's user.
        let (b, _) = build(
            "FROM runtime\nUSER user\nCOPY a.txt /home/user/a",
            &files,
            &[],
        )
        .unwrap();
        assert!(b.steps[0].root);
        assert!(b.steps[0]
            .script
            .as_deref()
            .unwrap_or("")
            .ends_with("chown 1000:1000 '/home/user/a'"));
        assert_eq!(b.state.user, ImageUser::User);
        // Sources and destinations are substituted.
        let (b, _) = build(
            "FROM runtime\nARG F=a.txt\nENV D=/d\nCOPY $F ${D}/",
            &files,
            &[],
        )
        .unwrap();
        assert_eq!(
            b.steps[0].instruction,
            "COPY /d/a.txt (1 bytes, sha256 559aead08264)"
        );
    }

    #[test]
    fn cmd_and_entrypoint_become_the_start_command() {
        let (_, p) = build(
            "FROM runtime\nCMD [\"python3\", \"-m\", \"http.server\"]",
            &[],
            &[],
        )
        .unwrap();
        assert_eq!(
            p.start,
            Some(json!({"command": "'python3' '-m' 'http.server'"}))
        );
        let (b, p) = build("FROM runtime\nCMD a\nENTRYPOINT b c", &[], &[]).unwrap();
        assert_eq!(p.start, Some(json!({"command": "b c"})));
        assert!(b.steps.is_empty());
        assert_eq!(build("FROM runtime", &[], &[]).unwrap().1.start, None);
    }

    #[test]
    fn some_instructions_are_accepted_and_ignored() {
        let b = ok(
            "FROM runtime\nLABEL a=b\nEXPOSE 80\nMAINTAINER me\nSHELL [\"/bin/sh\"]\n\
                    STOPSIGNAL SIGTERM\nHEALTHCHECK NONE\nVOLUME /data",
        );
        assert!(b.steps.is_empty());
        assert!(b.state.env.is_empty());
    }

    #[test]
    fn comments_blank_lines_and_continuations() {
        let b = ok("# syntax=docker/dockerfile:1\n\n  # a comment\nFROM runtime\n\nRUN apt-get update && \\\n    apt-get install -y jq\n");
        // The joined line keeps the space before the `\` and adds one.
        assert_eq!(
            instructions(&b),
            ["RUN apt-get update &&  apt-get install -y jq"]
        );
        // A continuation at the end of the text ends the instruction.
        let b = ok("FROM runtime\nRUN a \\");
        assert_eq!(instructions(&b), ["RUN a"]);
        // Numbers count instructions, not lines.
        assert_eq!(
            err("# c\n\nFROM runtime\nRUN a \\\n b\nONBUILD x", &[]),
            "Dockerfile instruction 3 (ONBUILD): not a supported instruction"
        );
    }

    #[test]
    fn every_error_names_the_instruction() {
        let e = |t: &str| err(t, &[file("a", "A")]);
        assert_eq!(
            e("RUN true"),
            "Dockerfile instruction 1 (RUN): the first instruction must be FROM"
        );
        assert_eq!(
            e("ARG A\nenv A=1"),
            "Dockerfile instruction 2 (ENV): the first instruction must be FROM"
        );
        assert_eq!(
            e("FROM runtime\nFROM app"),
            "Dockerfile instruction 2 (FROM): multi-stage builds are not supported"
        );
        assert_eq!(
            e("FROM runtime\nENV A=1 B"),
            "Dockerfile instruction 2 (ENV): expected KEY=VALUE"
        );
        assert_eq!(
            e("FROM runtime\nENV A"),
            "Dockerfile instruction 2 (ENV): expected KEY VALUE"
        );
        assert_eq!(
            e("FROM runtime\nWORKDIR /a/../b"),
            "Dockerfile instruction 2 (WORKDIR): must be a path without .."
        );
        assert_eq!(
            e("FROM runtime\nWORKDIR ../b"),
            "Dockerfile instruction 2 (WORKDIR): must be a path without .."
        );
        assert_eq!(
            e("FROM runtime\nUSER nobody"),
            "Dockerfile instruction 2 (USER): user nobody: only root and runtime (uid 1000) exist"
        );
        assert_eq!(
            e("FROM runtime\nRUN [\"a\", 1]"),
            "Dockerfile instruction 2 (RUN): bad JSON form"
        );
        assert_eq!(
            e("FROM runtime\nCMD [nope"),
            "Dockerfile instruction 2 (CMD): bad JSON form"
        );
        assert_eq!(
            e("FROM runtime\nENTRYPOINT [1]"),
            "Dockerfile instruction 2 (ENTRYPOINT): bad JSON form"
        );
        assert_eq!(
            e("FROM runtime\nCOPY a"),
            "Dockerfile instruction 2 (COPY): expected COPY <src>... <dest>"
        );
        assert_eq!(
            e("FROM runtime\nCOPY --chown=1 a"),
            "Dockerfile instruction 2 (COPY): expected COPY <src>... <dest>"
        );
        assert_eq!(
            e("FROM runtime\nADD missing.txt /x"),
            "Dockerfile instruction 2 (ADD): missing.txt is not among the build's files"
        );
        assert_eq!(
            e("FROM runtime\nCOPY a ../x"),
            "Dockerfile instruction 2 (COPY): the destination must be a path without .."
        );
        assert_eq!(
            e("FROM runtime\nONBUILD RUN true"),
            "Dockerfile instruction 2 (ONBUILD): not a supported instruction"
        );
        assert_eq!(e(""), "a Dockerfile needs FROM");
        assert_eq!(e("# only a comment\n"), "a Dockerfile needs FROM");
        assert_eq!(e("ARG A=1"), "a Dockerfile needs FROM");
    }

    #[test]
    fn copy_to_dot_copies_into_the_workdir() {
        // `COPY app.py .` is Docker's usual form: the file goes into the
        // directory, not onto the directory's own path.
        let files = [file("app.py", "A")];
        let (b, _) = build(
            "FROM runtime\nWORKDIR /srv\nCOPY app.py .\nCOPY app.py /opt/.",
            &files,
            &[],
        )
        .unwrap();
        assert_eq!(
            b.steps[1].instruction,
            "COPY /srv/./app.py (1 bytes, sha256 559aead08264)"
        );
        assert_eq!(
            b.steps[2].instruction,
            "COPY /opt/./app.py (1 bytes, sha256 559aead08264)"
        );
    }

    #[test]
    fn a_variable_is_replaced_whole_and_once() {
        // `$V` is not the start of `$VERSION`, and a value is not read again
        // for more variables.
        let b = ok("FROM runtime\nARG V=1\nARG VERSION=2.0\nENV A=$VERSION B=${V}x C=$Vx");
        assert_eq!(env(&b), [("A", "2.0"), ("B", "1x"), ("C", "$Vx")]);
        let b = ok("FROM runtime\nENV A=$B\nENV B=x\nENV C=${A}");
        assert_eq!(env(&b), [("A", "$B"), ("B", "x"), ("C", "$B")]);
        // ENV wins over ARG; unknown names and a lone `$` stay as written.
        let b = ok("FROM runtime\nARG N=arg\nENV N=env\nENV M=$N/$NOPE/${NOPE}/$/${");
        assert_eq!(env(&b), [("N", "env"), ("M", "env/$NOPE/${NOPE}/$/${")]);
    }

    #[test]
    fn comments_and_blank_lines_inside_a_continuation_are_dropped() {
        // As in Docker: a comment line inside a continued instruction is
        // not part of it, and a blank line does not end it.
        let b = ok("FROM runtime\nRUN apt-get update \\\n    # the tools\n    && apt-get install -y jq \\\n\n    && true");
        assert_eq!(
            instructions(&b),
            ["RUN apt-get update  && apt-get install -y jq  && true"]
        );
    }
}
