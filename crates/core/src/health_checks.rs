//! The health checks (issue #23): before each node, objects of the workload cluster the user names must
//! be healthy, or the run holds. A storage system's health resource is the usual example: a Ceph
//! cluster rebalancing must not lose another node.
//!
//! Pure: what the annotation `upgrade.vitistack.io/health-checks` asks for ([`HealthChecks::parse`]:
//! a YAML or JSON list of checks, each an object reference and a condition, validated and its CEL
//! compiled here, so that a check that could never work keeps the run from starting), and, from what
//! the shell read of the objects, whether each check holds and the sentence that says so
//! ([`evaluate`], [`verdict`]). The shell (`src/holds/health.rs`) resolves the kinds, reads the objects
//! and hands them back.
//!
//! Every check must pass on every object it selects. What cannot be evaluated holds too, and says why:
//! a missing object, a selector that matches nothing (a typo in it must not pass silently), a kind the
//! cluster does not serve, an expression that fails on the object.
//!
//! CEL is cel-rust's (the `cel` crate) with its standard library and the strings extension (as
//! Kubernetes's own CEL has), over one variable, `object`: the whole object as JSON. Its parser and
//! evaluator recurse once per level of the expression, and in a debug build a few dozen levels
//! overflow a 2 MiB thread stack, which aborts the process. So an expression is at most
//! [`MAX_EXPRESSION_LEN`] bytes and [`RECURSION_LIMIT`] levels deep, and is parsed, evaluated and
//! dropped on a stack of [`STACK`] bytes of its own (`stacker`), whatever thread runs it.

use std::collections::BTreeSet;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, LazyLock};

use serde_json::Value as Json;

use crate::holds::ExternalCheck;

/// At most this many checks per cluster: each is a read of the workload cluster at every look while a
/// node would start.
pub const MAX_CHECKS: usize = 16;

/// The longest CEL expression accepted, in bytes. Health conditions are one line; the bound is what
/// keeps the parser's and evaluator's recursion within [`STACK`].
pub const MAX_EXPRESSION_LEN: usize = 1024;

/// The parser's nesting limit (parentheses, calls, lists, macros).
pub const RECURSION_LIMIT: u16 = 32;

/// The stack an expression is parsed, evaluated and dropped on, a new one each time (whatever is left
/// of the caller's is not known to be enough): 64 MiB of address space, touched only as deep as the
/// expression goes (a 1 KiB chain of `+` takes about 20 MiB in a debug build).
const STACK: usize = 64 << 20;

/// How long a quoted condition message from an object may be in a hold message.
const QUOTED: usize = 160;

/// What the annotation accepts, in every error about it.
pub const FORMS: &str = "use a YAML or JSON list of checks, each with apiVersion, kind, namespace (for a \
     namespaced kind), name or selector (a label selector such as app=ceph), condition (Ready, Available, \
     or cel: <expression over object that is true when healthy>) and optionally check (its name), e.g. \
     [{check: ceph, apiVersion: ceph.rook.io/v1, kind: CephCluster, namespace: rook-ceph, name: \
     rook-ceph, condition: \"cel: object.status.ceph.health == 'HEALTH_OK'\"}]";

/// The keys a check may have.
const KEYS: [&str; 7] = [
    "check",
    "apiVersion",
    "kind",
    "namespace",
    "name",
    "selector",
    "condition",
];

/// A cluster's health checks, from `upgrade.vitistack.io/health-checks`: at least one, names unique.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthChecks {
    pub checks: Vec<HealthCheck>,
}

/// One check: the objects it reads and what they must satisfy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    /// `check`, or else made from the kind and the name or selector (`CephCluster/rook-ceph`).
    pub name: String,
    /// `apiVersion` as written: `v1`, `apps/v1`, `ceph.rook.io/v1`.
    pub api_version: String,
    /// The group (empty for the core group) and version of `api_version`.
    pub group: String,
    pub version: String,
    pub kind: String,
    /// `None`: a cluster-scoped kind, or (with a selector) every namespace.
    pub namespace: Option<String>,
    pub objects: Objects,
    pub condition: Condition,
}

/// Which objects a check reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Objects {
    /// `name`: one object, which must exist.
    Named(String),
    /// `selector`: every object its label selector matches, at least one.
    Selected(String),
}

/// What a check's objects must satisfy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    /// A status condition of this type with status "True" (`Ready`, `Available`).
    Status(ConditionType),
    /// A CEL expression over `object`, true when healthy.
    Cel(Expression),
}

/// The status condition types a check may name without CEL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConditionType {
    Ready,
    Available,
}

impl ConditionType {
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionType::Ready => "Ready",
            ConditionType::Available => "Available",
        }
    }
}

/// A compiled CEL expression. Equal when written the same; `Debug` shows the source (the syntax tree
/// is deep, and its `Debug` recursive).
#[derive(Clone)]
pub struct Expression {
    compiled: Arc<Compiled>,
}

struct Compiled {
    source: String,
    /// Always `Some` until dropped (taken out to be dropped on a stack of its own).
    tree: Option<cel::parser::Expression>,
}

impl Drop for Compiled {
    fn drop(&mut self) {
        let tree = self.tree.take();
        stacker::grow(STACK, move || drop(tree));
    }
}

impl PartialEq for Expression {
    fn eq(&self, other: &Self) -> bool {
        self.source() == other.source()
    }
}

impl Eq for Expression {}

impl std::fmt::Debug for Expression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Expression").field(&self.source()).finish()
    }
}

/// The CEL environment: the standard library and the strings extension (`lowerAscii`, `split`, ...).
static ENV: LazyLock<Arc<cel::Env>> = LazyLock::new(|| {
    let mut env = cel::Env::stdlib();
    env.add_extension(cel::extensions::strings)
        .expect("the strings extension adds to the standard library");
    Arc::new(env)
});

impl Expression {
    /// Compiles `source` (trimmed). `Err` says what is wrong, in one line.
    pub fn compile(source: &str) -> Result<Expression, String> {
        let source = source.trim();
        if source.is_empty() {
            return Err("cel: has no expression".to_string());
        }
        if source.len() > MAX_EXPRESSION_LEN {
            return Err(format!(
                "the CEL expression is {} bytes long, more than {MAX_EXPRESSION_LEN}",
                source.len()
            ));
        }
        let parsed = on_own_stack(|| {
            ENV.parser()
                .max_recursion_depth(RECURSION_LIMIT)
                .parse(source)
                .map(|tree| {
                    let reads_object = tree.references().has_variable("object");
                    (tree, reads_object)
                })
        })
        .map_err(|_| "the CEL parser failed on it".to_string())?;
        let (tree, reads_object) = parsed.map_err(|errors| {
            // The first line of the first error: `ERROR: <input>:1:4: Syntax error: ...`; the
            // lines after it draw the source with a caret.
            let text = errors.to_string();
            let first = text.lines().next().unwrap_or_default();
            let first = first.strip_prefix("ERROR: <input>:").unwrap_or(first);
            format!(
                "the CEL expression does not compile: {}",
                shorten(first, 200)
            )
        })?;
        let expression = Expression {
            compiled: Arc::new(Compiled {
                source: source.to_string(),
                tree: Some(tree),
            }),
        };
        if !reads_object {
            // `obj.status...` or `self.status...` would fail on every object: say so now.
            return Err(
                "the CEL expression never reads object (the checked object is the variable object)"
                    .to_string(),
            );
        }
        Ok(expression)
    }

    pub fn source(&self) -> &str {
        &self.compiled.source
    }

    /// Evaluates the expression over `object`: `Ok(true)` healthy, `Ok(false)` not; `Err` says why it
    /// could not be told (never quoting the object's values: a check may read anything the workload
    /// credentials can).
    pub fn evaluate(&self, object: &Json) -> Result<bool, String> {
        let Some(tree) = &self.compiled.tree else {
            return Err("the expression was dropped".to_string());
        };
        let result = on_own_stack(|| {
            let mut context = cel::Context::with_env(ENV.clone());
            context.add_variable_from_value("object", to_cel(object));
            cel::Value::resolve(tree, &context).map_err(|e| describe(&e))
        })
        .map_err(|_| "the CEL evaluator failed on this object".to_string())??;
        match result {
            cel::Value::Bool(healthy) => Ok(healthy),
            other => Err(format!(
                "the expression returned a {}, not a bool",
                other.type_of()
            )),
        }
    }
}

/// A JSON value as CEL sees it in Kubernetes: a whole number is an `int` (a `uint` only beyond
/// `int`'s range), so that `object.status.readyReplicas - 1` works as it does in a
/// ValidatingAdmissionPolicy.
fn to_cel(json: &Json) -> cel::Value {
    match json {
        Json::Null => cel::Value::Null,
        Json::Bool(b) => cel::Value::Bool(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => cel::Value::Int(i),
            (None, Some(u)) => cel::Value::UInt(u),
            (None, None) => cel::Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(text) => cel::Value::String(Arc::new(text.clone())),
        Json::Array(items) => cel::Value::List(Arc::new(items.iter().map(to_cel).collect())),
        Json::Object(fields) => cel::Value::Map(cel::objects::Map {
            map: Arc::new(
                fields
                    .iter()
                    .map(|(key, value)| (cel::objects::Key::from(key.as_str()), to_cel(value)))
                    .collect(),
            ),
        }),
    }
}

/// Runs `f` on a new stack of [`STACK`] bytes; a panic in the parser or evaluator is an `Err`, not the
/// end of the reconcile.
fn on_own_stack<T>(f: impl FnOnce() -> T) -> Result<T, ()> {
    stacker::grow(STACK, || {
        std::panic::catch_unwind(AssertUnwindSafe(f)).map_err(|_| ())
    })
}

/// An evaluation error in words, with the types of the values involved, never the values.
fn describe(error: &cel::ExecutionError) -> String {
    use cel::ExecutionError as E;
    match error {
        E::NoSuchKey(key) => {
            format!("no such key: {key} (has() tells whether a field is there)")
        }
        E::UndeclaredReference(name) => format!("{name} is not defined (the object is object)"),
        E::NoSuchOverload(overload) => overload.to_string(),
        E::UnexpectedType { got, want } => format!("got a {got} where a {want} was expected"),
        E::InvalidArgumentCount { expected, actual } => {
            format!("a function takes {expected} arguments, not {actual}")
        }
        E::FunctionError { function, .. } => format!("{function}() failed on its argument"),
        E::ValuesNotComparable(a, b) => {
            format!("a {} cannot be compared to a {}", a.type_of(), b.type_of())
        }
        E::UnsupportedBinaryOperator(op, a, b) => {
            format!(
                "{op} does not apply to a {} and a {}",
                a.type_of(),
                b.type_of()
            )
        }
        E::UnsupportedIndex(index, target) => {
            format!(
                "a {} cannot be indexed by a {}",
                target.type_of(),
                index.type_of()
            )
        }
        E::IndexOutOfBounds(_) => "an index is out of bounds".to_string(),
        E::DivisionByZero(_) | E::RemainderByZero(_) => "division by zero".to_string(),
        E::Overflow(op, _, _) => format!("{op} overflows"),
        E::NotSupportedAsMethod { method, target } => {
            format!("{method}() is not a method of a {}", target.type_of())
        }
        // The rest quote no values worth keeping out; their own words are short.
        other => shorten(&other.to_string(), 200),
    }
}

impl HealthChecks {
    /// The annotation's value (not blank). `Ok(None)`: an empty list, no checks. `Err` is the problem,
    /// naming the check, for an [`crate::intent::InvalidOption`].
    pub fn parse(text: &str) -> Result<Option<HealthChecks>, String> {
        let value: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| {
            format!(
                "it is not YAML or JSON ({}); {FORMS}",
                shorten(&e.to_string(), 200)
            )
        })?;
        let serde_yaml::Value::Sequence(items) = value else {
            return Err(format!("it is not a list; {FORMS}"));
        };
        if items.is_empty() {
            return Ok(None);
        }
        if items.len() > MAX_CHECKS {
            return Err(format!(
                "{} checks, at most {MAX_CHECKS} are allowed",
                items.len()
            ));
        }
        let mut checks = Vec::with_capacity(items.len());
        let mut names = BTreeSet::new();
        for (index, item) in items.iter().enumerate() {
            let check = parse_check(index, item)?;
            if !names.insert(check.name.clone()) {
                return Err(format!(
                    "two health checks are named {:?}; give each its own check: name",
                    check.name
                ));
            }
            checks.push(check);
        }
        Ok(Some(HealthChecks { checks }))
    }
}

/// One list item. Errors name the check: by its `check` if it has one, else by its position.
fn parse_check(index: usize, item: &serde_yaml::Value) -> Result<HealthCheck, String> {
    let serde_yaml::Value::Mapping(map) = item else {
        return Err(format!(
            "health check #{} is not a mapping of keys to values; {FORMS}",
            index + 1
        ));
    };
    let text = |key: &str| -> Result<Option<String>, String> {
        match map.get(key) {
            None | Some(serde_yaml::Value::Null) => Ok(None),
            Some(serde_yaml::Value::String(text)) => {
                Ok(Some(text.trim().to_string()).filter(|t| !t.is_empty()))
            }
            Some(_) => Err(format!("{key} is not a string")),
        }
    };
    let label = match text("check") {
        Ok(Some(name)) => format!("health check {name:?}"),
        _ => format!("health check #{}", index + 1),
    };
    let fail = |problem: String| format!("{label}: {problem}");
    for key in map.keys() {
        match key.as_str() {
            Some(key) if KEYS.contains(&key) => {}
            _ => {
                let key = serde_yaml::to_string(key).unwrap_or_default();
                return Err(fail(format!(
                    "unknown key {:?}; the keys are {}",
                    key.trim(),
                    KEYS.join(", ")
                )));
            }
        }
    }
    let check_name = text("check").map_err(&fail)?;
    let api_version = text("apiVersion")
        .map_err(&fail)?
        .ok_or_else(|| fail("apiVersion is missing (v1, apps/v1, ceph.rook.io/v1)".into()))?;
    let (group, version) = parse_api_version(&api_version).map_err(&fail)?;
    let kind = text("kind")
        .map_err(&fail)?
        .ok_or_else(|| fail("kind is missing".into()))?;
    if !is_kind(&kind) {
        return Err(fail(format!(
            "kind {kind:?} is not a kind (letters and digits, starting with a letter)"
        )));
    }
    if group.is_empty() && kind == "Secret" {
        // A condition over a Secret would tell its values, bit by bit, to whoever may annotate the
        // cluster.
        return Err(fail("health checks do not read Secrets".into()));
    }
    let namespace = text("namespace").map_err(&fail)?;
    if let Some(namespace) = &namespace
        && !is_dns_label(namespace)
    {
        return Err(fail(format!(
            "namespace {namespace:?} is not a namespace name"
        )));
    }
    let objects = match (
        text("name").map_err(&fail)?,
        text("selector").map_err(&fail)?,
    ) {
        (Some(_), Some(_)) => {
            return Err(fail(
                "both name and selector are given; use name for one object or selector for \
                 every object it matches"
                    .into(),
            ));
        }
        (None, None) => {
            return Err(fail(
                "neither name nor selector is given; use name for one object or selector for \
                 every object it matches"
                    .into(),
            ));
        }
        (Some(name), None) => {
            if name.len() > 253 || name.contains('/') {
                return Err(fail(format!("name {name:?} is not an object name")));
            }
            Objects::Named(name)
        }
        (None, Some(selector)) => {
            check_selector(&selector)
                .map_err(|problem| fail(format!("selector {selector:?}: {problem}")))?;
            Objects::Selected(selector)
        }
    };
    let condition = match map.get("condition") {
        None | Some(serde_yaml::Value::Null) => None,
        Some(serde_yaml::Value::String(text)) => Some(parse_condition(text).map_err(&fail)?),
        Some(serde_yaml::Value::Mapping(inner)) => match (inner.len(), inner.get("cel")) {
            (1, Some(serde_yaml::Value::String(expression))) => Some(Condition::Cel(
                Expression::compile(expression).map_err(&fail)?,
            )),
            _ => {
                return Err(fail(
                    "condition is a mapping other than {cel: <expression>}".into(),
                ));
            }
        },
        Some(_) => return Err(fail("condition is not a string".into())),
    }
    .ok_or_else(|| {
        fail("condition is missing (Ready, Available, or cel: <expression over object>)".into())
    })?;
    let name = check_name.unwrap_or_else(|| match &objects {
        Objects::Named(name) => format!("{kind}/{name}"),
        Objects::Selected(selector) => format!("{kind} {selector}"),
    });
    Ok(HealthCheck {
        name,
        api_version,
        group,
        version,
        kind,
        namespace,
        objects,
        condition,
    })
}

fn parse_condition(text: &str) -> Result<Condition, String> {
    let text = text.trim();
    for kind in [ConditionType::Ready, ConditionType::Available] {
        if text.eq_ignore_ascii_case(kind.as_str()) {
            return Ok(Condition::Status(kind));
        }
    }
    if let Some(head) = text.get(..4)
        && head.eq_ignore_ascii_case("cel:")
    {
        return Expression::compile(&text[4..]).map(Condition::Cel);
    }
    Err(format!(
        "condition {text:?} is not Ready, Available or cel: <expression>; another condition type \
         is cel: object.status.conditions.exists(c, c.type == '<Type>' && c.status == 'True')"
    ))
}

/// `v1` (the core group) or `<group>/<version>`.
fn parse_api_version(text: &str) -> Result<(String, String), String> {
    let (group, version) = match text.split_once('/') {
        Some((group, version)) => (group, version),
        None => ("", text),
    };
    let version_ok = version.starts_with('v')
        && version
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let group_ok = group.is_empty() || (group.len() <= 253 && group.split('.').all(is_dns_label));
    if !version_ok || !group_ok {
        return Err(format!(
            "apiVersion {text:?} is not <group>/<version> or v1 (the core group)"
        ));
    }
    Ok((group.to_string(), version.to_string()))
}

fn is_kind(text: &str) -> bool {
    text.starts_with(|c: char| c.is_ascii_alphabetic())
        && text.chars().all(|c| c.is_ascii_alphanumeric())
        && text.len() <= 63
}

/// RFC 1123 label: lowercase letters, digits and '-', at most 63, starting and ending alphanumeric.
fn is_dns_label(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 63
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !text.starts_with('-')
        && !text.ends_with('-')
}

/// A label selector as `kubectl -l` takes it: requirements separated by commas, each `key`, `!key`,
/// `key=value`, `key==value`, `key!=value`, `key in (a,b)` or `key notin (a,b)`. The API server is
/// the final judge; this catches the mistakes that would otherwise show up only at the first look.
fn check_selector(selector: &str) -> Result<(), String> {
    let mut requirements = Vec::new();
    let mut depth = 0u32;
    let mut start = 0;
    for (at, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => return Err("a ')' closes nothing".into()),
            ')' => depth -= 1,
            ',' if depth == 0 => {
                requirements.push(&selector[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '(' is not closed".into());
    }
    requirements.push(&selector[start..]);
    for requirement in requirements {
        check_requirement(requirement.trim())?;
    }
    Ok(())
}

fn check_requirement(requirement: &str) -> Result<(), String> {
    if requirement.is_empty() {
        return Err("an empty requirement (two commas, or one at an end)".into());
    }
    if let Some(key) = requirement.strip_prefix('!') {
        return check_label_key(key.trim());
    }
    for op in ["==", "!=", "="] {
        if let Some((key, value)) = requirement.split_once(op) {
            check_label_key(key.trim())?;
            return check_label_value(value.trim());
        }
    }
    let mut words = requirement.splitn(2, char::is_whitespace);
    let key = words.next().unwrap_or_default();
    check_label_key(key)?;
    let Some(rest) = words.next().map(str::trim) else {
        return Ok(());
    };
    let values = rest
        .strip_prefix("notin")
        .or_else(|| rest.strip_prefix("in"))
        .map(str::trim)
        .and_then(|values| values.strip_prefix('('))
        .and_then(|values| values.strip_suffix(')'))
        .ok_or_else(|| format!("{requirement:?} is not key, !key, key=value, key!=value, key in (values) or key notin (values)"))?;
    values
        .split(',')
        .try_for_each(|value| check_label_value(value.trim()))
}

fn check_label_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let prefix_ok = prefix.is_none_or(|p| p.len() <= 253 && p.split('.').all(is_dns_label));
    if !prefix_ok || !is_label_value(name) || name.is_empty() {
        return Err(format!("{key:?} is not a label key"));
    }
    Ok(())
}

fn check_label_value(value: &str) -> Result<(), String> {
    if is_label_value(value) {
        Ok(())
    } else {
        Err(format!("{value:?} is not a label value"))
    }
}

/// Empty, or at most 63 letters, digits, '-', '_' and '.', starting and ending alphanumeric.
fn is_label_value(value: &str) -> bool {
    value.is_empty()
        || (value.len() <= 63
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && value.starts_with(|c: char| c.is_ascii_alphanumeric())
            && value.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

// ----- evaluation -----

/// What the shell read for one check.
#[derive(Debug, Clone, PartialEq)]
pub enum Read {
    /// The named object, or every object the selector matched (maybe none), as JSON.
    Objects(Vec<Json>),
    /// The named object does not exist.
    NotFound,
    /// The objects could not be read: why, in words naming what was asked (the kind not served, a
    /// forbidden read, a timeout), never a credential.
    Failed(String),
}

/// One check's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Healthy,
    /// Read, and an object fails the condition: which, and why.
    Failing(String),
    /// Could not be told: why.
    Unknown(String),
}

/// Whether `check` passes on what was `read`: every object must satisfy the condition, and a
/// selector must match at least one.
pub fn evaluate(check: &HealthCheck, read: &Read) -> Outcome {
    let objects = match read {
        Read::Failed(reason) => return Outcome::Unknown(reason.clone()),
        Read::NotFound => {
            return Outcome::Unknown(format!("{} not found", described_target(check)));
        }
        Read::Objects(objects) => objects,
    };
    if objects.is_empty() {
        return Outcome::Unknown(match &check.objects {
            Objects::Named(_) => format!("{} not found", described_target(check)),
            Objects::Selected(selector) => match &check.namespace {
                Some(namespace) => format!(
                    "no {} in namespace {namespace} matches the selector {selector}",
                    check.kind
                ),
                None => format!("no {} matches the selector {selector}", check.kind),
            },
        });
    }
    // Objects in name order, so that the one named is the same at every look.
    let mut objects: Vec<&Json> = objects.iter().collect();
    objects.sort_by_key(|object| object_name(&check.kind, object));
    let mut failing = Vec::new();
    let mut unknown = Vec::new();
    for object in &objects {
        let name = object_name(&check.kind, object);
        match satisfies(&check.condition, object) {
            Ok(true) => {}
            Ok(false) => failing.push(format!("{name}: {}", why_failing(&check.condition, object))),
            Err(reason) => unknown.push(format!("{name}: {reason}")),
        }
    }
    // What cannot be told is said first: it is what the user has to fix in the check.
    let total = objects.len();
    let with_more = |mut list: Vec<String>, words: &str| {
        let first = list.remove(0);
        match list.len() {
            0 => first,
            more => format!(
                "{first}; and {more} more of the {total} {}s {words}",
                check.kind
            ),
        }
    };
    if !unknown.is_empty() {
        return Outcome::Unknown(with_more(unknown, "cannot be evaluated"));
    }
    if !failing.is_empty() {
        return Outcome::Failing(with_more(failing, "fail"));
    }
    Outcome::Healthy
}

/// The gate's answer from each check's, in the annotation's order: the first check that holds is
/// named (and how many others hold); [`ExternalCheck::Unknown`] when that one cannot be evaluated.
pub fn verdict(outcomes: &[(&HealthCheck, Outcome)]) -> ExternalCheck {
    let holding: Vec<(&HealthCheck, &Outcome)> = outcomes
        .iter()
        .filter(|(_, outcome)| *outcome != Outcome::Healthy)
        .map(|(check, outcome)| (*check, outcome))
        .collect();
    let Some((first, outcome)) = holding.first() else {
        return ExternalCheck::Clear;
    };
    let others: Vec<String> = holding[1..]
        .iter()
        .map(|(check, _)| format!("{:?}", check.name))
        .collect();
    let also = match others.len() {
        0 => String::new(),
        _ => format!(" (also holding: {})", others.join(", ")),
    };
    match outcome {
        Outcome::Healthy => ExternalCheck::Clear,
        Outcome::Failing(why) => ExternalCheck::Holding {
            message: format!("health check {:?} failing: {why}{also}", first.name),
        },
        Outcome::Unknown(why) => ExternalCheck::Unknown {
            reason: format!(
                "health check {:?} cannot be evaluated: {why}{also}",
                first.name
            ),
        },
    }
}

fn satisfies(condition: &Condition, object: &Json) -> Result<bool, String> {
    match condition {
        Condition::Status(kind) => Ok(status_condition(object, kind.as_str())
            .is_some_and(|c| c.get("status").and_then(Json::as_str) == Some("True"))),
        Condition::Cel(expression) => expression
            .evaluate(object)
            .map_err(|why| format!("{}: {why}", expression.source())),
    }
}

fn why_failing(condition: &Condition, object: &Json) -> String {
    match condition {
        Condition::Cel(expression) => format!("{} is false", expression.source()),
        Condition::Status(kind) => {
            let kind = kind.as_str();
            let Some(found) = status_condition(object, kind) else {
                return format!("has no {kind} condition");
            };
            let field = |key: &str| found.get(key).and_then(Json::as_str).unwrap_or_default();
            let mut text = format!(
                "condition {kind} is {}",
                Some(field("status"))
                    .filter(|s| !s.is_empty())
                    .unwrap_or("unset")
            );
            let detail: Vec<&str> = [field("reason"), field("message")]
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect();
            if !detail.is_empty() {
                text.push_str(&format!(" ({})", shorten(&detail.join(": "), QUOTED)));
            }
            text
        }
    }
}

/// The object's `status.conditions` entry of type `kind`.
fn status_condition<'a>(object: &'a Json, kind: &str) -> Option<&'a Json> {
    object
        .pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c.get("type").and_then(Json::as_str) == Some(kind))
}

/// `CephCluster rook-ceph/rook-ceph`, or `Node worker-1` when cluster-scoped.
fn object_name(kind: &str, object: &Json) -> String {
    let field = |key: &str| {
        object
            .pointer(&format!("/metadata/{key}"))
            .and_then(Json::as_str)
    };
    match (field("namespace"), field("name")) {
        (Some(namespace), Some(name)) => format!("{kind} {namespace}/{name}"),
        (None, Some(name)) => format!("{kind} {name}"),
        (_, None) => format!("{kind} (unnamed)"),
    }
}

/// The check's named object: `CephCluster rook-ceph/rook-ceph`.
fn described_target(check: &HealthCheck) -> String {
    let name = match &check.objects {
        Objects::Named(name) => name.as_str(),
        Objects::Selected(selector) => selector.as_str(),
    };
    match &check.namespace {
        Some(namespace) => format!("{} {namespace}/{name}", check.kind),
        None => format!("{} {name}", check.kind),
    }
}

/// At most `limit` characters, with `…` when cut.
fn shorten(text: &str, limit: usize) -> String {
    match text.char_indices().nth(limit) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests;
