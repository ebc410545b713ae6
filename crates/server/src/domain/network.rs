//! A sandbox's network settings over `runtime_egress::Rules`: what a create
//! asks, the settings as kept (rules, chosen secrets, version), and the
//! policy they give.

use runtime_egress::{Policy, Rules};
use serde_json::{json, Value};

/// What a create asked of the network.
#[derive(Debug, Clone, Default)]
pub(crate) struct CreateNet {
    pub(crate) rules: Option<Rules>,
    /// `None`: every secret; `Some([])`: none.
    pub(crate) secrets: Option<Vec<String>>,
}

/// Rules from their fields. `internet: false` with an allow list is that
/// list alone (the client's rule), so such rules have `internet` on.
pub(crate) fn rules_from(
    internet: bool,
    allow: Option<Vec<String>>,
    deny: Option<Vec<String>>,
    connect: Option<Vec<String>>,
) -> Rules {
    let internet = internet || allow.as_ref().is_some_and(|a| !a.is_empty());
    Rules {
        internet,
        allow,
        deny,
        connect,
    }
}

/// The policy rules give; rules that do not validate (only an old or
/// damaged record has them) let nothing out.
pub(crate) fn policy(rules: &Rules) -> Policy {
    rules.validate().unwrap_or_else(|_| Policy::off())
}

/// A sandbox's network settings as kept (the `sandbox-net` record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settings {
    pub(crate) rules: Rules,
    /// The secrets it gets: `None` every secret.
    pub(crate) secrets: Option<Vec<String>>,
    /// Bumped by every change of the rules.
    pub(crate) version: u64,
    pub(crate) updated_at: Option<String>,
}

impl Default for Settings {
    /// What a sandbox without a record has: the internet, every secret.
    fn default() -> Self {
        Settings {
            rules: Rules::default(),
            secrets: None,
            version: 1,
            updated_at: None,
        }
    }
}

impl Settings {
    /// The settings a create asked for, as of `now` (ISO 8601).
    pub(crate) fn at_create(c: &CreateNet, now: String) -> Settings {
        Settings {
            rules: c.rules.clone().unwrap_or_default(),
            secrets: c.secrets.clone(),
            version: 1,
            updated_at: Some(now),
        }
    }

    /// Reads a record; a part that cannot be read is as if absent.
    pub(crate) fn from_doc(doc: &Value) -> Settings {
        Settings {
            rules: serde_json::from_value(doc["rules"].clone()).unwrap_or_default(),
            secrets: serde_json::from_value(doc["secrets"].clone()).ok(),
            version: doc["version"].as_u64().unwrap_or(1),
            updated_at: doc["updatedAt"].as_str().map(String::from),
        }
    }

    pub(crate) fn to_doc(&self) -> Value {
        json!({
            "rules": serde_json::to_value(&self.rules).unwrap_or(Value::Null),
            "secrets": self.secrets,
            "version": self.version,
            "updatedAt": self.updated_at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(v: &[&str]) -> Option<Vec<String>> {
        Some(v.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn an_allow_list_without_the_internet_is_that_list_alone() {
        assert!(rules_from(false, list(&["pypi.org"]), None, None).internet);
        assert!(!rules_from(false, list(&[]), None, None).internet);
        assert!(!rules_from(false, None, list(&["a.com"]), None).internet);
        assert!(rules_from(true, None, None, None).internet);
    }

    #[test]
    fn rules_that_do_not_validate_let_nothing_out() {
        let bad = Rules {
            internet: true,
            allow: list(&["not a host!"]),
            deny: None,
            connect: None,
        };
        assert!(bad.validate().is_err());
        assert_eq!(policy(&bad).ports(), Policy::off().ports());
        assert!(policy(&bad).ports().is_empty());
        assert!(!policy(&Rules::default()).ports().is_empty());
    }

    #[test]
    fn settings_are_kept_as_their_record() {
        let s = Settings::at_create(
            &CreateNet {
                rules: Some(rules_from(false, list(&["pypi.org"]), None, None)),
                secrets: list(&["A"]),
            },
            "2024-01-01T00:00:00.000Z".into(),
        );
        let doc = s.to_doc();
        assert_eq!(
            doc,
            json!({"rules": {"internet": true, "allow": ["pypi.org"]}, "secrets": ["A"],
                   "version": 1, "updatedAt": "2024-01-01T00:00:00.000Z"})
        );
        assert_eq!(Settings::from_doc(&doc), s);
    }

    #[test]
    fn no_record_is_the_internet_and_every_secret() {
        let d = Settings::default();
        assert_eq!(
            d.to_doc(),
            json!({"rules": {"internet": true}, "secrets": null, "version": 1, "updatedAt": null})
        );
        assert_eq!(Settings::from_doc(&Value::Null), d);
        let damaged = json!({"rules": {"internet": "yes"}, "secrets": 3, "version": "x"});
        assert_eq!(Settings::from_doc(&damaged), d);
    }
}
