//! A recipe (docs/images.md "Recipes"): `base`, `env`, `workdir`, `apt`,
//! `pip`, `npm`, `files`, `commands`, read into steps in that fixed order
//! whatever the order of the JSON.

use serde_json::Value;

use super::steps::{sh_quote, Steps};
use super::{valid_abs, ImageError, InlineFile};

const FIELDS: &[&str] = &[
    "base", "apt", "pip", "npm", "commands", "env", "files", "workdir",
];

/// The image a recipe builds on: `None` for the server's own (no `base`,
/// `default` or `runtime`).
pub(crate) fn base(recipe: &Value) -> Option<String> {
    match recipe.get("base").and_then(Value::as_str) {
        Some("default" | "runtime") | None => None,
        Some(b) => Some(b.to_string()),
    }
}

/// Reads `r` into `b`'s steps (the base is read by [`base`]).
pub(crate) fn parse(b: &mut Steps, r: &Value) -> Result<(), ImageError> {
    let obj = r.as_object().ok_or(ImageError::RecipeNotAnObject)?;
    if let Some(k) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(ImageError::UnknownRecipeField(k.clone()));
    }
    // No step of its own: set for every later step and every sandbox.
    if let Some(env) = obj.get("env").and_then(Value::as_object) {
        for (k, v) in env {
            let v = v
                .as_str()
                .ok_or_else(|| ImageError::EnvNotAString(k.clone()))?;
            b.state.set_env(k, v);
        }
    }
    if let Some(w) = obj.get("workdir").and_then(Value::as_str) {
        if !valid_abs(w) {
            return Err(ImageError::WorkdirNotAbsolute);
        }
        b.workdir(w);
    }
    b.as_root(|b| install(b, obj))?;
    match obj.get("files") {
        None | Some(Value::Null) => {}
        Some(Value::Array(files)) => {
            for f in files {
                let f = InlineFile::parse(f)?;
                if !valid_abs(&f.path) {
                    return Err(ImageError::FileNotAbsolute(f.path));
                }
                b.file(&f.path, &f.data, f.mode);
            }
        }
        Some(Value::Object(files)) => {
            for (path, content) in files {
                let content = content
                    .as_str()
                    .ok_or_else(|| ImageError::FileNotText(path.clone()))?;
                if !valid_abs(path) {
                    return Err(ImageError::FileNotAbsolute(path.clone()));
                }
                b.file(path, content.as_bytes(), None);
            }
        }
        Some(_) => return Err(ImageError::FilesShape),
    }
    for c in strings(obj.get("commands"), "recipe.commands")? {
        b.push(format!("RUN {c}"), c);
    }
    Ok(())
}

/// The `apt`, `pip` and `npm` steps, one per manager that has packages
/// (run as root: `b`'s user is root here).
fn install(b: &mut Steps, obj: &serde_json::Map<String, Value>) -> Result<(), ImageError> {
    let apt = packages(obj, "apt", "recipe.apt", "package names only")?;
    if !apt.is_empty() {
        b.push(
            format!("apt install {}", apt.join(" ")),
            format!(
                "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
                 --no-install-recommends {} && rm -rf /var/lib/apt/lists/*",
                quoted(&apt)
            ),
        );
    }
    let pip = packages(obj, "pip", "recipe.pip", "requirement specifiers only")?;
    if !pip.is_empty() {
        b.push(
            format!("pip install {}", pip.join(" ")),
            format!(
                "pip install --no-cache-dir --break-system-packages {}",
                quoted(&pip)
            ),
        );
    }
    let npm = packages(obj, "npm", "recipe.npm", "package names only")?;
    if !npm.is_empty() {
        b.push(
            format!("npm install -g {}", npm.join(" ")),
            format!("npm install -g --no-audit --no-fund {}", quoted(&npm)),
        );
    }
    Ok(())
}

/// The packages of one manager: names only, never options (options go in
/// `env`: `PIP_INDEX_URL`, `NPM_CONFIG_REGISTRY`, …).
fn packages(
    obj: &serde_json::Map<String, Value>,
    key: &str,
    field: &'static str,
    expected: &'static str,
) -> Result<Vec<String>, ImageError> {
    let list = strings(obj.get(key), field)?;
    if !list.iter().all(|p| package_ok(p)) {
        return Err(ImageError::BadPackages { field, expected });
    }
    Ok(list)
}

fn package_ok(p: &str) -> bool {
    !p.is_empty() && !p.starts_with('-') && !p.chars().any(|c| c.is_whitespace() || c.is_control())
}

fn quoted(list: &[String]) -> String {
    list.iter()
        .map(|p| sh_quote(p))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A list of strings (absent or null: empty).
fn strings(v: Option<&Value>, what: &'static str) -> Result<Vec<String>, ImageError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or(ImageError::NotStrings(what))
            })
            .collect(),
        Some(_) => Err(ImageError::NotAList(what)),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::steps::BuildState;
    use super::super::{ImageUser, StepState};
    use super::*;

    fn steps(user: ImageUser) -> Steps {
        Steps::new(
            "base-abc",
            BuildState {
                env: Vec::new(),
                workdir: None,
                user,
            },
        )
    }

    fn parsed(r: Value) -> Result<Steps, String> {
        let mut b = steps(ImageUser::User);
        parse(&mut b, &r).map_err(|e| e.to_string())?;
        Ok(b)
    }

    fn err(r: Value) -> String {
        parsed(r).err().unwrap_or_default()
    }

    #[test]
    fn every_field_becomes_steps_in_the_fixed_order_with_pinned_keys() {
        // The JSON's order does not matter.
        let b = parsed(json!({
            "commands": ["echo $A"], "files": {"/w/f": "hi"}, "npm": ["t"], "pip": ["x==1"],
            "apt": ["jq"], "workdir": "/w", "env": {"A": "1"}
        }))
        .unwrap();
        let got: Vec<(&str, &str, bool)> = b
            .steps
            .iter()
            .map(|s| {
                (
                    s.instruction.as_str(),
                    s.script.as_deref().unwrap_or(""),
                    s.root,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("WORKDIR /w", "mkdir -p '/w' && chown 1000:1000 '/w'", true),
                (
                    "apt install jq",
                    "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
                     --no-install-recommends 'jq' && rm -rf /var/lib/apt/lists/*",
                    true
                ),
                (
                    "pip install x==1",
                    "pip install --no-cache-dir --break-system-packages 'x==1'",
                    true
                ),
                (
                    "npm install -g t",
                    "npm install -g --no-audit --no-fund 't'",
                    true
                ),
                (
                    "COPY /w/f (2 bytes, sha256 8f434346648f)",
                    "mkdir -p '/w' && printf '%s' 'aGk=' | base64 -d > '/w/f' && chmod 644 '/w/f' \
                     && chown 1000:1000 '/w/f'",
                    true
                ),
                ("RUN echo $A", "echo $A", false),
            ]
        );
        // The keys the server has always given these steps (its kept layers
        // are found by them).
        let keys: Vec<&str> = b.steps.iter().map(|s| s.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "4460bff155f4cc3abed19c211f49317f14c576c1b51ceb3792cca7d57d36bd7c",
                "fb2e404599b47ceb6b6aaa2c08798e053e29ddbcc6dc6cc94eb142749c06532e",
                "dc05551f3a09a742c2658dbb1e9e78bc050df5563e34beaa9d7cc938dfd47514",
                "e5bafa41b9e060aed08bc115c49b9c0fb23708d55770e751df98ba2e23563453",
                "2c79fc96f8e31c66ed3f1cf77fb5ac673cf3fd04bf9ac68f3f6a8e0f3280a794",
                "a5c4b51232f0b7973ca1abf5fe82dda9d52e8a74d0f2984c0a96458e4b8d8315",
            ]
        );
        assert!(b.steps.iter().all(|s| s.state == StepState::Pending));
        assert_eq!(b.state.env, [("A".to_string(), "1".to_string())]);
        assert_eq!(b.state.workdir.as_deref(), Some("/w"));
        assert_eq!(b.state.user, ImageUser::User);
        assert_eq!(b.steps[5].workdir.as_deref(), Some("/w"));
    }

    #[test]
    fn an_empty_recipe_has_no_steps_and_empty_lists_add_none() {
        assert!(parsed(json!({})).unwrap().steps.is_empty());
        let b = parsed(json!({"apt": [], "pip": null, "files": null, "commands": [], "base": "x"}))
            .unwrap();
        assert!(b.steps.is_empty());
        let b = parsed(json!({"env": {"A": "1"}})).unwrap();
        assert!(b.steps.is_empty());
        assert_eq!(b.state.env.len(), 1);
    }

    #[test]
    fn files_may_be_a_map_of_text_or_a_list_of_inline_files() {
        let b = parsed(json!({"files": [
            {"path": "/a", "content": "aGk=", "encoding": "base64", "mode": "755"},
            {"path": "/b", "content": "x"}
        ]}))
        .unwrap();
        assert_eq!(b.steps.len(), 2);
        assert!(b.steps[0]
            .script
            .as_deref()
            .unwrap_or("")
            .contains("'aGk=' | base64 -d > '/a' && chmod 755"));
        assert!(b.steps[1]
            .script
            .as_deref()
            .unwrap_or("")
            .contains("chmod 644 '/b'"));
        // A map goes in key order (JSON objects are read sorted).
        let b = parsed(json!({"files": {"/z": "1", "/a": "2"}})).unwrap();
        assert_eq!(
            b.steps[0].instruction,
            "COPY /a (1 bytes, sha256 d4735e3a265e)"
        );
    }

    #[test]
    fn commands_run_as_the_builds_user() {
        let mut b = steps(ImageUser::Root);
        parse(&mut b, &json!({"commands": ["id -u"], "apt": ["jq"]})).unwrap();
        assert!(b.steps.iter().all(|s| s.root));
        assert_eq!(b.state.user, ImageUser::Root);
    }

    #[test]
    fn the_base_is_one_of_ours_or_the_servers() {
        assert_eq!(base(&json!({})), None);
        assert_eq!(base(&json!({"base": "default"})), None);
        assert_eq!(base(&json!({"base": "runtime"})), None);
        assert_eq!(base(&json!({"base": 3})), None);
        assert_eq!(base(&json!({"base": "app@2"})).as_deref(), Some("app@2"));
    }

    #[test]
    fn every_error_names_its_field() {
        assert_eq!(err(json!([])), "recipe must be an object");
        assert_eq!(
            err(json!({"apt": [], "bogus": 1})),
            "recipe.bogus is not a recipe field"
        );
        assert_eq!(
            err(json!({"env": {"A": 1}})),
            "recipe.env.A must be a string"
        );
        assert_eq!(
            err(json!({"workdir": "relative"})),
            "recipe.workdir must be an absolute path"
        );
        assert_eq!(
            err(json!({"workdir": "/a/../b"})),
            "recipe.workdir must be an absolute path"
        );
        assert_eq!(
            err(json!({"apt": ["-y"]})),
            "recipe.apt: package names only"
        );
        assert_eq!(
            err(json!({"apt": ["a b"]})),
            "recipe.apt: package names only"
        );
        assert_eq!(err(json!({"apt": [""]})), "recipe.apt: package names only");
        assert_eq!(
            err(json!({"pip": ["--index-url=http://x"]})),
            "recipe.pip: requirement specifiers only"
        );
        assert_eq!(
            err(json!({"npm": ["a\tb"]})),
            "recipe.npm: package names only"
        );
        assert_eq!(
            err(json!({"apt": "jq"})),
            "recipe.apt must be a list of strings"
        );
        assert_eq!(err(json!({"pip": [1]})), "recipe.pip must be strings");
        assert_eq!(
            err(json!({"commands": "true"})),
            "recipe.commands must be a list of strings"
        );
        assert_eq!(
            err(json!({"commands": [true]})),
            "recipe.commands must be strings"
        );
        assert_eq!(
            err(json!({"files": {"rel": "x"}})),
            "recipe.files: rel must be an absolute path"
        );
        assert_eq!(
            err(json!({"files": {"/a": 1}})),
            "recipe.files: /a must be text"
        );
        assert_eq!(
            err(json!({"files": [{"path": "rel", "content": ""}]})),
            "recipe.files: rel must be an absolute path"
        );
        assert_eq!(
            err(json!({"files": [{"content": ""}]})),
            "a file needs a path"
        );
        assert_eq!(
            err(json!({"files": "x"})),
            "recipe.files must be {path: text} or a list of {path, content}"
        );
    }
}
