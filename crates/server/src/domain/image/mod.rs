//! Custom images (contract §11, docs/images.md): the record as stored and
//! answered, its states, how a reference (`id`, `name`, `name:tag`,
//! `name@version`) picks one, the inline files of a build, and the errors a
//! build request can have. The parsers that turn a recipe or a Dockerfile
//! into steps are [`recipe`] and [`dockerfile`]; the steps and their key
//! chain are [`steps`].

pub(crate) mod context;
pub(crate) mod dockerfile;
pub(crate) mod recipe;
pub(crate) mod steps;

use std::collections::BTreeMap;

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where an image is in its build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ImageState {
    Queued,
    Building,
    Ready,
    Failed,
}

impl ImageState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ImageState::Queued => "queued",
            ImageState::Building => "building",
            ImageState::Ready => "ready",
            ImageState::Failed => "failed",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<ImageState> {
        [
            ImageState::Queued,
            ImageState::Building,
            ImageState::Ready,
            ImageState::Failed,
        ]
        .into_iter()
        .find(|st| st.as_str() == s)
    }

    /// Queued or building: the build has not ended.
    pub(crate) fn in_progress(self) -> bool {
        matches!(self, ImageState::Queued | ImageState::Building)
    }
}

/// Where a step is in its build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum StepState {
    Pending,
    Running,
    /// Its layer was already kept: the build did not run it.
    Cached,
    Done,
    Failed,
}

/// The guest's two users: a build step, and an image's sandboxes' start
/// command, run as one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ImageUser {
    Root,
    /// The sandbox user, uid 1000.
    User,
}

impl ImageUser {
    /// The `chown` owner of what a step writes for this user.
    pub(crate) fn owner(self) -> &'static str {
        match self {
            ImageUser::Root => "0:0",
            ImageUser::User => "1000:1000",
        }
    }
}

/// What a build was written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Source {
    Recipe,
    Dockerfile,
    /// A registry image as it is (`image` of a build).
    Image,
}

/// One step of a build.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Step {
    pub(crate) index: usize,
    /// As the user wrote it (`RUN …`, `pip install …`).
    pub(crate) instruction: String,
    /// The step's place in the hash chain, and its layer's name.
    pub(crate) key: String,
    pub(crate) state: StepState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) script: Option<String>,
    pub(crate) root: bool,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) workdir: Option<String>,
    pub(crate) seconds: Option<f64>,
    /// Context files the build places in the machine before the script
    /// runs (a COPY or ADD from the build context).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) copy: Option<steps::CopyPlan>,
    /// The layer this step runs on when it is not the step before's (the
    /// base's for the first): the first step of a stage of a multi-stage
    /// build that is not built on the stage before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) on: Option<String>,
    /// A `COPY --from`'s source: the layer (another stage's last, or a
    /// pulled image's) the build machine gets as a volume, mounted at
    /// [`steps::from_mount`] while the step runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) from_layer: Option<String>,
}

/// Who wrote a line of a build's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum LogStream {
    /// The build itself (steps starting, cached, failing).
    System,
    /// A step's stdout and stderr.
    Output,
}

/// One line of a build's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct LogLine {
    pub(crate) seq: u64,
    pub(crate) step: Option<usize>,
    pub(crate) stream: LogStream,
    pub(crate) text: String,
}

/// An image as stored (its log lines are kept beside it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Image {
    pub(crate) id: String,
    pub(crate) key_id: String,
    pub(crate) name: Option<String>,
    /// 1, 2, … per name (the store assigns it); 1 without a name.
    pub(crate) version: u32,
    pub(crate) tags: Vec<String>,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) state: ImageState,
    pub(crate) error: Option<String>,
    pub(crate) source: Source,
    /// The image it was built on; `None` for the server's own.
    pub(crate) base: Option<String>,
    /// The key of the layer the steps start from.
    pub(crate) base_key: String,
    pub(crate) steps: Vec<Step>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) workdir: Option<String>,
    pub(crate) user: ImageUser,
    pub(crate) start: Option<Value>,
    pub(crate) created_at: String,
    pub(crate) created_ms: i64,
    pub(crate) ready_at: Option<String>,
    pub(crate) build_seconds: Option<f64>,
    /// The build machine while one runs (ended by a restart's recovery).
    #[serde(default)]
    pub(crate) build_vm: Option<String>,
    /// The registry image the build starts from (`FROM`, a recipe's
    /// `base`, or `image`): as written until pulled, then its canonical
    /// reference with the manifest's digest.
    #[serde(default)]
    pub(crate) pulled: Option<String>,
    /// The build context's archive, which COPY steps read from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) context: Option<context::ArchiveRef>,
    /// The build machine's shape and the build's limits (`build` on the
    /// create); images kept before they existed had the defaults.
    #[serde(default)]
    pub(crate) build: BuildLimits,
    /// Deleted while sandboxes still use it: gone from the API (no get,
    /// list, reference or new sandbox), kept for those sandboxes' starts
    /// until a prune finds none left.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) deleted: bool,
}

/// A build's machine and limits, `build: {vcpu, memoryMiB, timeoutSeconds,
/// maxImageMiB, diskMiB}` on `POST /v1/images` (docs/images.md "Build
/// machine and limits").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct BuildLimits {
    pub(crate) vcpu: u32,
    #[serde(rename = "memoryMiB")]
    pub(crate) memory_mib: u32,
    /// From the build's start (a pull included) to its image kept.
    pub(crate) timeout_seconds: u32,
    /// What the image's file system may hold after any step.
    #[serde(rename = "maxImageMiB")]
    pub(crate) max_image_mib: u32,
    /// The build machine's disk, which each step's file system fills: the
    /// image's file system is this large, and so at least is the disk of a
    /// sandbox from it. Records from before it have the one disk builds had.
    #[serde(rename = "diskMiB", default = "BuildLimits::default_disk")]
    pub(crate) disk_mib: u32,
}

impl BuildLimits {
    pub(crate) const VCPU: (u32, u32) = (1, 8);
    pub(crate) const MEMORY_MIB: (u32, u32) = (1024, 16384);
    pub(crate) const TIMEOUT_SECONDS: (u32, u32) = (60, 3600);
    pub(crate) const MAX_IMAGE_MIB: (u32, u32) = (512, 20480);
    /// From the smallest sandbox disk (the default, which keeps the layer
    /// keys of builds before the setting) to the product's 32 GiB.
    pub(crate) const DISK_MIB: (u32, u32) = (3072, 32768);

    fn default_disk() -> u32 {
        Self::DISK_MIB.0
    }

    /// The disk when it is not the default: it then names the build's layers
    /// apart from the same steps on the default disk.
    pub(crate) fn other_disk(&self) -> Option<u32> {
        (self.disk_mib != Self::DISK_MIB.0).then_some(self.disk_mib)
    }
}

impl Default for BuildLimits {
    fn default() -> Self {
        BuildLimits {
            vcpu: 2,
            memory_mib: 2048,
            timeout_seconds: 1800,
            max_image_mib: 8192,
            disk_mib: Self::DISK_MIB.0,
        }
    }
}

impl Image {
    /// The key of the final disk (the base's when there are no steps).
    pub(crate) fn disk_key(&self) -> &str {
        self.steps.last().map_or(&self.base_key, |s| &s.key)
    }

    /// Whether a sandbox of it boots on the server's own image unchanged
    /// (no steps, no base of ours): it then needs no disk of its own.
    pub(crate) fn is_plain_base(&self) -> bool {
        self.disk_key() == self.base_key && self.base.is_none() && self.pulled.is_none()
    }
}

/// The command a new sandbox of an image runs in the background, from its
/// `start` (`{"command": "…"}` run by `bash -lc`, or an argv); `None`
/// without one.
pub(crate) fn start_argv(start: Option<&Value>) -> Option<Vec<String>> {
    match start?.get("command")? {
        Value::String(c) if !c.trim().is_empty() => {
            Some(vec!["bash".into(), "-lc".into(), c.clone()])
        }
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_string) => Some(
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect(),
        ),
        _ => None,
    }
}

/// Which version of a name a reference picks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Pick {
    /// `name`: the one tagged `latest`.
    Latest,
    /// `name:tag`.
    Tag(String),
    /// `name@version`.
    Version(u32),
}

/// A reference by name: `name`, `name:tag` or `name@version`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ImageRef {
    pub(crate) name: String,
    pub(crate) pick: Pick,
}

impl ImageRef {
    /// `None` for `name@x` whose version is not a number.
    pub(crate) fn parse(r: &str) -> Option<ImageRef> {
        let (name, pick) = if let Some((n, v)) = r.split_once('@') {
            (n, Pick::Version(v.parse().ok()?))
        } else if let Some((n, t)) = r.split_once(':') {
            (n, Pick::Tag(t.to_string()))
        } else {
            (r, Pick::Latest)
        };
        Some(ImageRef {
            name: name.to_string(),
            pick,
        })
    }

    /// The image this reference names among `images` (newest first). A
    /// tag names its newest ready image: a new version's tags move to it
    /// only once it is ready, so one building or failed leaves the name
    /// where it was. Without a ready one, the newest (which a create then
    /// refuses as not ready).
    pub(crate) fn pick<'a>(
        &self,
        images: impl IntoIterator<Item = &'a Image>,
    ) -> Option<&'a Image> {
        let mut newest = None;
        for d in images.into_iter().filter(|d| self.picks(d)) {
            if d.state == ImageState::Ready || matches!(self.pick, Pick::Version(_)) {
                return Some(d);
            }
            newest = newest.or(Some(d));
        }
        newest
    }

    pub(crate) fn picks(&self, d: &Image) -> bool {
        d.name.as_deref() == Some(self.name.as_str())
            && match &self.pick {
                Pick::Latest => d.tags.iter().any(|t| t == "latest"),
                Pick::Tag(t) => d.tags.contains(t),
                Pick::Version(v) => d.version == *v,
            }
    }
}

/// Where tags go when `ready` becomes ready: the tags it keeps (those a
/// newer ready version of its name has stay there), and the new tags of
/// each other image of its name that changes (older versions give those
/// tags up). A tag so names the newest ready version that has it, whatever
/// order the builds end in.
pub(crate) fn tags_on_ready(
    ready: &Image,
    others: &[Image],
) -> (Vec<String>, Vec<(String, Vec<String>)>) {
    // A name is its key's: another key's image of the same name is another image.
    let same_name = |o: &&Image| {
        o.id != ready.id && o.key_id == ready.key_id && o.name.is_some() && o.name == ready.name
    };
    let kept: Vec<String> = ready
        .tags
        .iter()
        .filter(|t| {
            !others.iter().filter(same_name).any(|o| {
                o.version > ready.version && o.state == ImageState::Ready && o.tags.contains(t)
            })
        })
        .cloned()
        .collect();
    let changed = others
        .iter()
        .filter(same_name)
        .filter(|o| o.version < ready.version && o.tags.iter().any(|t| kept.contains(t)))
        .map(|o| {
            let tags = o
                .tags
                .iter()
                .filter(|t| !kept.contains(t))
                .cloned()
                .collect();
            (o.id.clone(), tags)
        })
        .collect();
    (kept, changed)
}

/// A tag: 1-128 characters without `:`, `@`, `/` or spaces.
pub(crate) fn valid_tag(t: &str) -> bool {
    !t.is_empty() && t.len() <= 128 && !t.contains([':', '@', '/', ' '])
}

/// An absolute path without `..` parts or control characters.
pub(crate) fn valid_abs(p: &str) -> bool {
    p.starts_with('/') && !p.split('/').any(|c| c == "..") && !p.chars().any(char::is_control)
}

/// One file given inline with a build (`files`, `recipe.files`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InlineFile {
    pub(crate) path: String,
    pub(crate) data: Vec<u8>,
    pub(crate) mode: Option<u32>,
}

impl InlineFile {
    /// `{path, content, encoding?, mode?}`; `encoding` is `utf-8` (the
    /// default) or `base64`, `mode` 3-4 octal digits or an integer.
    pub(crate) fn parse(v: &Value) -> Result<InlineFile, ImageError> {
        let path = v["path"]
            .as_str()
            .ok_or(ImageError::FileWithoutPath)?
            .to_string();
        let content = v["content"]
            .as_str()
            .ok_or(ImageError::FileWithoutContent)?;
        let data = match v["encoding"].as_str() {
            Some("base64") => base64::engine::general_purpose::STANDARD
                .decode(content)
                .map_err(|_| ImageError::NotBase64(path.clone()))?,
            None | Some("utf-8") | Some("utf8") => content.as_bytes().to_vec(),
            Some(e) => {
                return Err(ImageError::UnknownEncoding {
                    path,
                    encoding: e.to_string(),
                })
            }
        };
        let mode = match &v["mode"] {
            Value::Null => None,
            m => Some(file_mode(m).ok_or_else(|| ImageError::BadMode(path.clone()))?),
        };
        Ok(InlineFile { path, data, mode })
    }
}

/// A mode as 1-4 octal digits (`"755"`), or an integer (0o755 = 493); the
/// same rule as the files API's.
fn file_mode(v: &Value) -> Option<u32> {
    match v {
        Value::String(s) if (1..=4).contains(&s.len()) => {
            u32::from_str_radix(s, 8).ok().filter(|m| *m <= 0o7777)
        }
        Value::Number(n) => n.as_u64().filter(|m| *m <= 0o7777).map(|m| m as u32),
        _ => None,
    }
}

/// Why a build request is refused before anything runs. The text is the
/// message of the 400 issue that names `recipe`, `dockerfile` or `files`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ImageError {
    #[error("recipe must be an object")]
    RecipeNotAnObject,
    #[error("recipe.{0} is not a recipe field")]
    UnknownRecipeField(String),
    #[error("recipe.env.{0} must be a string")]
    EnvNotAString(String),
    #[error("recipe.workdir must be an absolute path")]
    WorkdirNotAbsolute,
    /// `field` is `recipe.apt`, `recipe.pip` or `recipe.npm`.
    #[error("{field}: {expected}")]
    BadPackages {
        field: &'static str,
        expected: &'static str,
    },
    #[error("{0} must be strings")]
    NotStrings(&'static str),
    #[error("{0} must be a list of strings")]
    NotAList(&'static str),
    #[error("recipe.files: {0} must be an absolute path")]
    FileNotAbsolute(String),
    #[error("recipe.files: {0} must be text")]
    FileNotText(String),
    #[error("recipe.files must be {{path: text}} or a list of {{path, content}}")]
    FilesShape,
    #[error("a file needs a path")]
    FileWithoutPath,
    #[error("a file needs content")]
    FileWithoutContent,
    #[error("{0}: content is not base64")]
    NotBase64(String),
    #[error("{path}: unknown encoding {encoding}")]
    UnknownEncoding { path: String, encoding: String },
    #[error("{0}: bad mode")]
    BadMode(String),
    /// The instruction starting on line `line` (from 1) is wrong.
    #[error("Dockerfile line {line} ({op}): {problem}")]
    Instruction {
        line: usize,
        op: String,
        problem: dockerfile::Problem,
    },
    #[error("a Dockerfile needs FROM")]
    NoFrom,
    #[error("at most {} steps", steps::MAX_STEPS)]
    TooManySteps,
    #[error("no stage is named {0}")]
    NoSuchTarget(String),
    #[error(
        "COPY and ADD may place at most {} files in one build",
        dockerfile::MAX_COPY_ENTRIES
    )]
    TooManyCopies,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn image(name: &str, version: u32, tags: &[&str]) -> Image {
        Image {
            id: format!("{name}-{version}"),
            key_id: "k".into(),
            name: Some(name.into()),
            version,
            tags: tags.iter().map(|t| t.to_string()).collect(),
            labels: BTreeMap::new(),
            state: ImageState::Ready,
            error: None,
            source: Source::Recipe,
            base: None,
            base_key: "base-x".into(),
            steps: Vec::new(),
            env: Vec::new(),
            workdir: None,
            user: ImageUser::User,
            start: None,
            created_at: "2024-01-01T00:00:00.000Z".into(),
            created_ms: 0,
            ready_at: None,
            build_seconds: None,
            build_vm: None,
            pulled: None,
            context: None,
            build: BuildLimits::default(),
            deleted: false,
        }
    }

    #[test]
    fn a_reference_picks_latest_a_tag_or_a_version_of_its_name() {
        let v1 = image("app", 1, &["stable"]);
        let v2 = image("app", 2, &["latest"]);
        let other = image("web", 2, &["latest"]);
        let r = ImageRef::parse("app").unwrap();
        assert_eq!(r.pick, Pick::Latest);
        assert!(r.picks(&v2) && !r.picks(&v1) && !r.picks(&other));
        let r = ImageRef::parse("app:stable").unwrap();
        assert!(r.picks(&v1) && !r.picks(&v2));
        let r = ImageRef::parse("app@2").unwrap();
        assert_eq!(r.pick, Pick::Version(2));
        assert!(r.picks(&v2) && !r.picks(&v1) && !r.picks(&other));
        // `@` is read before `:`; a version must be a number.
        assert_eq!(
            ImageRef::parse("a:b@3"),
            Some(ImageRef {
                name: "a:b".into(),
                pick: Pick::Version(3)
            })
        );
        assert_eq!(ImageRef::parse("app@latest"), None);
        // An unnamed image is picked by no name.
        let mut unnamed = image("app", 1, &["latest"]);
        unnamed.name = None;
        assert!(!ImageRef::parse("app").unwrap().picks(&unnamed));
    }

    #[test]
    fn a_tag_names_its_newest_ready_image() {
        let mut v3 = image("app", 3, &["latest"]);
        v3.state = ImageState::Building;
        let mut v2 = image("app", 2, &["latest"]);
        v2.state = ImageState::Failed;
        let v1 = image("app", 1, &["latest", "stable"]);
        let all = [v3.clone(), v2.clone(), v1.clone()];
        let pick = |r: &str| ImageRef::parse(r).unwrap().pick(&all).map(|d| d.version);
        assert_eq!(pick("app"), Some(1));
        assert_eq!(pick("app:stable"), Some(1));
        // A version is that version, ready or not.
        assert_eq!(pick("app@3"), Some(3));
        assert_eq!(pick("app@2"), Some(2));
        assert_eq!(pick("app@4"), None);
        assert_eq!(pick("web"), None);
        // No ready one: the newest.
        let building = [v3, v2];
        assert_eq!(
            ImageRef::parse("app")
                .unwrap()
                .pick(&building)
                .map(|d| d.version),
            Some(3)
        );
    }

    #[test]
    fn a_ready_build_takes_its_tags_from_older_versions_only() {
        let mut v1 = image("app", 1, &["latest", "stable"]);
        let mut v2 = image("app", 2, &["latest"]);
        v2.state = ImageState::Building;
        let v3 = image("app", 3, &["latest", "edge"]);
        let other = image("web", 1, &["latest"]);
        let mut unnamed = image("x", 1, &["latest"]);
        unnamed.name = None;
        // v3 ends first: it keeps its tags, and the older ones give them up
        // (v2 while it still builds).
        let all = [
            v1.clone(),
            v2.clone(),
            v3.clone(),
            other.clone(),
            unnamed.clone(),
        ];
        let (kept, changed) = tags_on_ready(&v3, &all);
        assert_eq!(kept, ["latest", "edge"]);
        assert_eq!(
            changed,
            [
                ("app-1".to_string(), vec!["stable".to_string()]),
                ("app-2".to_string(), vec![])
            ]
        );
        // v2 ends after v3 (which kept `latest`): it does not take it, and
        // v1 keeps what v2 does not take.
        v2.state = ImageState::Ready;
        v1.tags = vec!["latest".into(), "stable".into()];
        let (kept, changed) = tags_on_ready(&v2, &[v1.clone(), v2.clone(), v3.clone()]);
        assert!(kept.is_empty());
        assert!(changed.is_empty());
        // A newer one still building does not hold its tags back.
        let mut v3b = v3;
        v3b.state = ImageState::Building;
        let (kept, changed) = tags_on_ready(&v2, &[v1, v2.clone(), v3b]);
        assert_eq!(kept, ["latest"]);
        assert_eq!(changed, [("app-1".to_string(), vec!["stable".to_string()])]);
    }

    #[test]
    fn the_disk_is_the_last_steps_layer_or_the_base() {
        let mut d = image("app", 1, &[]);
        assert_eq!(d.disk_key(), "base-x");
        assert!(d.is_plain_base());
        d.base = Some("parent".into());
        assert!(!d.is_plain_base());
        d.base = None;
        d.steps.push(Step {
            index: 0,
            instruction: "RUN true".into(),
            key: "k1".into(),
            state: StepState::Done,
            script: Some("true".into()),
            root: false,
            env: Vec::new(),
            workdir: None,
            seconds: None,
            copy: None,
            on: None,
            from_layer: None,
        });
        assert_eq!(d.disk_key(), "k1");
        assert!(!d.is_plain_base());
    }

    #[test]
    fn a_start_command_is_a_bash_line_or_an_argv() {
        let argv = |v: Value| start_argv(Some(&v));
        assert_eq!(
            argv(json!({"command": "python3 -m http.server"})),
            Some(vec![
                "bash".into(),
                "-lc".into(),
                "python3 -m http.server".into()
            ])
        );
        assert_eq!(
            argv(json!({"command": ["python3", "app.py"]})),
            Some(vec!["python3".into(), "app.py".into()])
        );
        assert_eq!(argv(json!({"command": "  "})), None);
        assert_eq!(argv(json!({"command": []})), None);
        assert_eq!(argv(json!({"command": ["a", 1]})), None);
        assert_eq!(argv(json!({})), None);
        assert_eq!(start_argv(None), None);
    }

    #[test]
    fn states_users_and_sources_keep_their_stored_strings() {
        let s = serde_json::to_value([
            ImageState::Queued,
            ImageState::Building,
            ImageState::Ready,
            ImageState::Failed,
        ])
        .unwrap_or_default();
        assert_eq!(s, json!(["queued", "building", "ready", "failed"]));
        for st in [
            ImageState::Queued,
            ImageState::Building,
            ImageState::Ready,
            ImageState::Failed,
        ] {
            assert_eq!(ImageState::parse(st.as_str()), Some(st));
            assert_eq!(
                serde_json::to_value(st).unwrap_or_default(),
                json!(st.as_str())
            );
        }
        let s = serde_json::to_value([
            StepState::Pending,
            StepState::Running,
            StepState::Cached,
            StepState::Done,
            StepState::Failed,
        ])
        .unwrap_or_default();
        assert_eq!(s, json!(["pending", "running", "cached", "done", "failed"]));
        assert_eq!(
            serde_json::to_value([ImageUser::Root, ImageUser::User]).unwrap_or_default(),
            json!(["root", "user"])
        );
        assert_eq!(
            serde_json::to_value([Source::Recipe, Source::Dockerfile]).unwrap_or_default(),
            json!(["recipe", "dockerfile"])
        );
        assert_eq!(
            serde_json::to_value([LogStream::System, LogStream::Output]).unwrap_or_default(),
            json!(["system", "output"])
        );
        assert_eq!(ImageState::parse("done"), None);
        assert!(ImageState::Queued.in_progress() && ImageState::Building.in_progress());
        assert!(!ImageState::Ready.in_progress() && !ImageState::Failed.in_progress());
    }

    #[test]
    fn inline_files_name_what_is_wrong() {
        let f = InlineFile::parse(&json!({"path": "/a", "content": "hi"}));
        assert_eq!(
            f,
            Ok(InlineFile {
                path: "/a".into(),
                data: b"hi".to_vec(),
                mode: None
            })
        );
        let f = InlineFile::parse(
            &json!({"path": "/a", "content": "aGk=", "encoding": "base64", "mode": "755"}),
        );
        assert_eq!(
            f.map(|f| (f.data, f.mode)),
            Ok((b"hi".to_vec(), Some(0o755)))
        );
        let f = InlineFile::parse(
            &json!({"path": "/a", "content": "x", "encoding": "utf8", "mode": 420}),
        );
        assert_eq!(f.map(|f| f.mode), Ok(Some(0o644)));
        let err = |v: Value| InlineFile::parse(&v).err().map(|e| e.to_string());
        assert_eq!(
            err(json!({"content": "x"})).as_deref(),
            Some("a file needs a path")
        );
        assert_eq!(
            err(json!({"path": "/a"})).as_deref(),
            Some("a file needs content")
        );
        assert_eq!(
            err(json!({"path": "/a", "content": "!!", "encoding": "base64"})).as_deref(),
            Some("/a: content is not base64")
        );
        assert_eq!(
            err(json!({"path": "/a", "content": "x", "encoding": "latin1"})).as_deref(),
            Some("/a: unknown encoding latin1")
        );
        for bad in [json!("8"), json!("77777"), json!(0o10000), json!(true)] {
            assert_eq!(
                err(json!({"path": "/a", "content": "x", "mode": bad})).as_deref(),
                Some("/a: bad mode")
            );
        }
    }

    #[test]
    fn paths_and_tags() {
        assert!(valid_abs("/a/b") && valid_abs("/"));
        assert!(!valid_abs("a/b") && !valid_abs("/a/../b") && !valid_abs("/a\n"));
        assert!(valid_tag("v1.2-rc") && valid_tag(&"t".repeat(128)));
        for t in ["", "a:b", "a@b", "a/b", "a b"] {
            assert!(!valid_tag(t), "{t}");
        }
        assert!(!valid_tag(&"t".repeat(129)));
    }
}
