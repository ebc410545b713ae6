//! A tool's arguments, declared once: the declaration gives the tool's JSON
//! schema (`inputSchema`) and the check that names every wrong field in one
//! answer, as the API's bodies do.

use runtime_api::Issue;
use serde_json::{json, Map, Value};

/// What an argument holds.
#[derive(Clone, Copy)]
pub(super) enum Ty {
    Str,
    Int,
    Bool,
    /// Any JSON object (the API checks its fields).
    Obj,
    /// An object of string values (`env`, `labels`).
    StrMap,
    StrList,
    ObjList,
    /// A shell command line, or an argv array run without a shell.
    Command,
    /// A string or an integer (a signal's name or number).
    StrOrInt,
    Enum(&'static [&'static str]),
}

/// One argument of a tool.
pub(super) struct Arg {
    pub name: &'static str,
    pub ty: Ty,
    pub desc: &'static str,
    pub required: bool,
    /// The actions that take it (empty: every action, or a tool without one).
    pub actions: &'static [&'static str],
}

/// An optional argument.
pub(super) const fn opt(name: &'static str, ty: Ty, desc: &'static str) -> Arg {
    Arg {
        name,
        ty,
        desc,
        required: false,
        actions: &[],
    }
}

/// A required argument.
pub(super) const fn req(name: &'static str, ty: Ty, desc: &'static str) -> Arg {
    Arg {
        required: true,
        ..opt(name, ty, desc)
    }
}

impl Arg {
    /// Taken only by these actions (and required by them when `required`).
    pub(super) const fn only(self, actions: &'static [&'static str]) -> Arg {
        Arg { actions, ..self }
    }

    fn applies(&self, action: Option<&str>) -> bool {
        self.actions.is_empty() || action.is_some_and(|a| self.actions.contains(&a))
    }

    fn type_schema(&self) -> Value {
        match self.ty {
            Ty::Str => json!({"type": "string"}),
            Ty::Int => json!({"type": "integer"}),
            Ty::Bool => json!({"type": "boolean"}),
            Ty::Obj => json!({"type": "object"}),
            Ty::StrMap => json!({"type": "object", "additionalProperties": {"type": "string"}}),
            Ty::StrList => json!({"type": "array", "items": {"type": "string"}}),
            Ty::ObjList => json!({"type": "array", "items": {"type": "object"}}),
            Ty::Command => json!({"anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1}
            ]}),
            Ty::StrOrInt => json!({"type": ["string", "integer"]}),
            Ty::Enum(values) => json!({"type": "string", "enum": values}),
        }
    }

    /// What is wrong with `v` as this argument, if anything.
    fn wrong(&self, v: &Value) -> Option<String> {
        let ok = match self.ty {
            Ty::Str => v.is_string(),
            Ty::Int => v.is_i64() || v.is_u64(),
            Ty::Bool => v.is_boolean(),
            Ty::Obj => v.is_object(),
            Ty::StrMap => v
                .as_object()
                .is_some_and(|m| m.values().all(Value::is_string)),
            Ty::StrList => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
            Ty::ObjList => v.as_array().is_some_and(|a| a.iter().all(Value::is_object)),
            Ty::Command => {
                v.is_string()
                    || v.as_array()
                        .is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_string))
            }
            Ty::StrOrInt => v.is_string() || v.is_i64(),
            Ty::Enum(values) => v.as_str().is_some_and(|s| values.contains(&s)),
        };
        if ok {
            return None;
        }
        Some(match self.ty {
            Ty::Str => "must be a string".into(),
            Ty::Int => "must be an integer".into(),
            Ty::Bool => "must be true or false".into(),
            Ty::Obj => "must be an object".into(),
            Ty::StrMap => "must be an object of string values".into(),
            Ty::StrList => "must be an array of strings".into(),
            Ty::ObjList => "must be an array of objects".into(),
            Ty::Command => "must be a command line, or a non-empty array of strings".into(),
            Ty::StrOrInt => "must be a string or an integer".into(),
            Ty::Enum(values) => format!("must be one of: {}", values.join(", ")),
        })
    }
}

/// The `inputSchema` of a tool taking `args`.
pub(super) fn input_schema(args: &[Arg]) -> Value {
    let mut props = Map::new();
    let mut required = Vec::new();
    for a in args {
        let mut s = a.type_schema();
        let mut desc = a.desc.to_string();
        if !a.actions.is_empty() {
            let verb = if a.required { "required by" } else { "used by" };
            desc.push_str(&format!(" ({verb} action: {})", a.actions.join(", ")));
        }
        s["description"] = Value::String(desc);
        if a.required && a.actions.is_empty() {
            required.push(Value::String(a.name.to_string()));
        }
        props.insert(a.name.to_string(), s);
    }
    json!({
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": false,
    })
}

/// Checks `v` against `args`: every unknown, misplaced, missing or
/// mistyped field named in one list. A `null` counts as absent.
pub(super) fn check(args: &[Arg], v: Option<&Value>) -> Result<Map<String, Value>, Vec<Issue>> {
    let issue = |field: &str, message: String| Issue {
        field: field.to_string(),
        message,
    };
    let obj = match v {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => return Err(vec![issue("arguments", "must be an object".into())]),
    };
    let action = obj.get("action").and_then(Value::as_str).filter(|a| {
        args.iter()
            .find(|x| x.name == "action")
            .is_some_and(|x| x.wrong(&Value::String((*a).to_string())).is_none())
    });
    let mut issues = Vec::new();
    for (k, v) in &obj {
        if v.is_null() {
            continue;
        }
        match args.iter().find(|a| a.name == k) {
            None => issues.push(issue(k, "unknown field".into())),
            Some(a) if !a.applies(action) => {
                // Without a valid action, `action` itself is the issue.
                if let Some(act) = action {
                    issues.push(issue(k, format!("is not used by action {act}")));
                }
            }
            Some(a) => {
                if let Some(m) = a.wrong(v) {
                    issues.push(issue(k, m));
                }
            }
        }
    }
    for a in args {
        let given = obj.get(a.name).is_some_and(|v| !v.is_null());
        if a.required && !given && a.applies(action) {
            let m = if a.actions.is_empty() {
                "is required".to_string()
            } else {
                format!("is required by action {}", action.unwrap_or_default())
            };
            issues.push(issue(a.name, m));
        }
    }
    if issues.is_empty() {
        Ok(obj.into_iter().filter(|(_, v)| !v.is_null()).collect())
    } else {
        issues.sort_by(|a, b| a.field.cmp(&b.field));
        Err(issues)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ARGS: &[Arg] = &[
        req("id", Ty::Str, "the sandbox"),
        req("action", Ty::Enum(&["get", "extend"]), "what to do"),
        req("seconds", Ty::Int, "how long").only(&["extend"]),
        opt("labels", Ty::StrMap, "labels"),
    ];

    fn fields(r: Result<Map<String, Value>, Vec<Issue>>) -> Vec<String> {
        r.err()
            .unwrap_or_default()
            .into_iter()
            .map(|i| format!("{}: {}", i.field, i.message))
            .collect()
    }

    #[test]
    fn every_wrong_field_is_named() {
        let got = fields(check(
            ARGS,
            Some(&json!({"id": 3, "action": "extend", "labels": {"a": 1}, "zzz": true})),
        ));
        assert_eq!(
            got,
            vec![
                "id: must be a string",
                "labels: must be an object of string values",
                "seconds: is required by action extend",
                "zzz: unknown field",
            ]
        );
        let got = fields(check(
            ARGS,
            Some(&json!({"id": "s", "action": "get", "seconds": 5})),
        ));
        assert_eq!(got, vec!["seconds: is not used by action get"]);
        let got = fields(check(ARGS, Some(&json!({"action": "fly"}))));
        assert_eq!(
            got,
            vec!["action: must be one of: get, extend", "id: is required"]
        );
        assert!(check(
            ARGS,
            Some(&json!({"id": "s", "action": "extend", "seconds": 60}))
        )
        .is_ok());
        assert_eq!(
            fields(check(ARGS, Some(&json!([1])))),
            vec!["arguments: must be an object"]
        );
    }

    #[test]
    fn schemas_name_their_required_fields() {
        let s = input_schema(ARGS);
        assert_eq!(s["required"], json!(["id", "action"]));
        assert_eq!(s["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["action"]["enum"], json!(["get", "extend"]));
        assert!(s["properties"]["seconds"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("required by action: extend")));
    }
}
