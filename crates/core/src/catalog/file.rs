//! The operator's catalog file: extra (or replacement) releases, for air-gapped sites that mirror
//! newer releases than the controller knows, for tests and for the demo.
//!
//! ```yaml
//! # Merge with the built-in lists (the default), or replace each list given here.
//! replace: false
//! talos: ["1.11.6", "v1.12.0"]
//! kubernetes: ["1.34.1", "1.35.0"]
//! ```
//!
//! Every entry must be a release `MAJOR.MINOR.PATCH` (a leading `v` is fine). A pre-release is an
//! error rather than silently dropped: the catalog only advertises releases, and an operator who
//! listed `1.13.0-beta.1` should learn that it will never show up. Quoting versions is optional: an
//! unquoted `1.11.6` is text to YAML, and an unquoted `1.10` (a YAML number) is read as written and
//! refused as a release line, never taken as 1.1 or guessed into 1.10.0.

use serde::Deserialize;

use crate::versions::{KubernetesVersion, TalosVersion, VersionParseError};

/// A parsed catalog file. `talos` / `kubernetes` are `None` when the file leaves the list out, which
/// keeps the built-in list even with `replace: true`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CatalogOverride {
    pub replace: bool,
    pub talos: Option<Vec<TalosVersion>>,
    pub kubernetes: Option<Vec<KubernetesVersion>>,
}

/// Why a catalog file cannot be used. Each message names the file and, for a bad entry, the list
/// and the entry.
#[derive(Debug, thiserror::Error)]
pub enum CatalogFileError {
    #[error("cannot read the release catalog file {origin}: {source}")]
    Read {
        origin: String,
        source: std::io::Error,
    },

    #[error(
        "the release catalog file {origin} is not of the form `replace: true|false`, `talos: [\"1.12.0\", ...]`, `kubernetes: [\"1.35.0\", ...]`: {source}"
    )]
    Syntax {
        origin: String,
        source: serde_yaml::Error,
    },

    #[error("the release catalog file {origin} lists a bad {list} version: {source}")]
    Version {
        origin: String,
        list: &'static str,
        source: VersionParseError,
    },

    #[error(
        "the release catalog file {origin} lists {list} {version}, a pre-release: the catalog lists releases only, so it would never be advertised"
    )]
    PreRelease {
        origin: String,
        list: &'static str,
        version: String,
    },
}

/// The file as written; versions stay strings until validated so errors can name the entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCatalogFile {
    #[serde(default)]
    replace: bool,
    talos: Option<Vec<String>>,
    kubernetes: Option<Vec<String>>,
}

impl CatalogOverride {
    /// Validate catalog YAML; `origin` names it in errors (a path, or e.g. `<inline>`).
    pub fn parse(text: &str, origin: &str) -> Result<CatalogOverride, CatalogFileError> {
        // An empty file is a valid "no changes" file; serde_yaml would call it an error.
        if text.trim().is_empty() {
            return Ok(CatalogOverride::default());
        }
        let raw: RawCatalogFile =
            serde_yaml::from_str(text).map_err(|source| CatalogFileError::Syntax {
                origin: origin.to_string(),
                source,
            })?;
        Ok(CatalogOverride {
            replace: raw.replace,
            talos: raw
                .talos
                .map(|list| parse_list(&list, origin, "Talos", TalosVersion::parse))
                .transpose()?,
            kubernetes: raw
                .kubernetes
                .map(|list| parse_list(&list, origin, "Kubernetes", KubernetesVersion::parse))
                .transpose()?,
        })
    }
}

fn parse_list<V: std::fmt::Display + HasPre>(
    list: &[String],
    origin: &str,
    kind: &'static str,
    parse: impl Fn(&str) -> Result<V, VersionParseError>,
) -> Result<Vec<V>, CatalogFileError> {
    list.iter()
        .map(|entry| {
            let version = parse(entry).map_err(|source| CatalogFileError::Version {
                origin: origin.to_string(),
                list: kind,
                source,
            })?;
            if version.is_pre_release() {
                return Err(CatalogFileError::PreRelease {
                    origin: origin.to_string(),
                    list: kind,
                    version: version.to_string(),
                });
            }
            Ok(version)
        })
        .collect()
}

/// Talos and Kubernetes versions are distinct types; this lets one list parser serve both.
trait HasPre {
    fn is_pre_release(&self) -> bool;
}

impl HasPre for TalosVersion {
    fn is_pre_release(&self) -> bool {
        !self.semver().pre.is_empty()
    }
}

impl HasPre for KubernetesVersion {
    fn is_pre_release(&self) -> bool {
        !self.semver().pre.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(major: u64, minor: u64, patch: u64) -> TalosVersion {
        TalosVersion::new(major, minor, patch)
    }

    fn k(major: u64, minor: u64, patch: u64) -> KubernetesVersion {
        KubernetesVersion::new(major, minor, patch)
    }

    #[test]
    fn parses_lists_with_and_without_v() {
        let file = CatalogOverride::parse(
            "replace: true\ntalos: [1.11.6, \"v1.12.0\"]\nkubernetes:\n  - 1.34.1\n  - v1.35.0\n",
            "test.yaml",
        )
        .expect("valid file");
        assert_eq!(
            file,
            CatalogOverride {
                replace: true,
                talos: Some(vec![t(1, 11, 6), t(1, 12, 0)]),
                kubernetes: Some(vec![k(1, 34, 1), k(1, 35, 0)]),
            }
        );
    }

    #[test]
    fn missing_fields_and_empty_file_change_nothing() {
        assert_eq!(
            CatalogOverride::parse("", "empty.yaml").expect("empty is fine"),
            CatalogOverride::default()
        );
        let only_talos = CatalogOverride::parse("talos: [\"1.12.0\"]", "x").expect("valid");
        assert!(!only_talos.replace);
        assert_eq!(only_talos.kubernetes, None);
    }

    #[test]
    fn bad_files_get_errors_that_name_the_file_and_the_entry() {
        let cases: [(&str, &[&str]); 6] = [
            ("talos: [\"1.12\"]", &["cat.yaml", "Talos", "1.12.0"]),
            (
                "kubernetes: [latest]",
                &["cat.yaml", "Kubernetes", "latest"],
            ),
            (
                "talos: [\"v1.13.0-alpha.1\"]",
                &["cat.yaml", "Talos", "1.13.0-alpha.1", "pre-release"],
            ),
            // Unquoted 1.10 is a YAML number; it is read as written and refused as a release line.
            (
                "talos: [1.10]",
                &["cat.yaml", "Talos", "\"1.10\"", "1.10.0"],
            ),
            ("talso: [\"1.12.0\"]", &["cat.yaml", "talso"]),
            ("replace: maybe", &["cat.yaml", "replace"]),
        ];
        for (text, needles) in cases {
            let error = CatalogOverride::parse(text, "cat.yaml")
                .expect_err(text)
                .to_string();
            for needle in needles {
                assert!(error.contains(needle), "{text}: {error:?} lacks {needle:?}");
            }
        }
    }
}
