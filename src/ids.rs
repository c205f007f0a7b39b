//! Identifier checks. Every ID that becomes part of a path (volume,
//! allocation, alias, plugin, node) passes here first, so no ID can reach
//! outside its directory.

use std::fmt;

/// Longest accepted ID, in bytes.
pub const MAX_ID_LEN: usize = 128;

/// Allocation IDs starting with this belong to the container engines'
/// mounts (the Docker volume plugin protocol, `docker`): only that front
/// end makes them, and its engine-death rule releases them.
pub const ENGINE_ALLOC_PREFIX: &str = "docker-";

/// An allocation ID that an operator or orchestrator may mount through the
/// local API: a valid ID outside the engines' prefix.
pub fn check_api_alloc_id(id: &str) -> Result<(), InvalidId> {
    check_id("allocation", id)?;
    if id.starts_with(ENGINE_ALLOC_PREFIX) {
        return Err(InvalidId {
            kind: "allocation",
            id: id.to_string(),
            problem: "starts with docker-, which is reserved for the mounts of Docker and Podman containers (the Docker volume plugin protocol); choose another ID",
        });
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidId {
    pub kind: &'static str,
    pub id: String,
    pub problem: &'static str,
}

impl fmt::Display for InvalidId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Debug-format the ID so control characters and NUL show escaped.
        write!(
            f,
            "invalid {} ID {:?}: {}",
            self.kind, self.id, self.problem
        )
    }
}

impl std::error::Error for InvalidId {}

/// Letters, digits, `.`, `_`, `-`; 1 to MAX_ID_LEN bytes; never `.` or `..`.
pub fn check_id(kind: &'static str, id: &str) -> Result<(), InvalidId> {
    let bad = |problem| {
        Err(InvalidId {
            kind,
            id: id.chars().take(MAX_ID_LEN + 8).collect(),
            problem,
        })
    };
    if id.is_empty() {
        return bad("must not be empty");
    }
    if id.len() > MAX_ID_LEN {
        return bad("is longer than 128 bytes");
    }
    if id == "." || id == ".." {
        return bad("must not be . or ..");
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
    {
        return bad("may only contain letters, digits, '.', '_' and '-'");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_ids() {
        for id in ["db", "vol-1", "a.b_c", "7f3c9e2a-0c1d", "X"] {
            assert!(check_id("volume", id).is_ok(), "{id}");
        }
        assert!(check_id("volume", &"a".repeat(MAX_ID_LEN)).is_ok());
    }

    #[test]
    fn refuses_escapes_and_junk() {
        for id in [
            "", ".", "..", "../etc", "a/b", "/abs", "a\0b", "a b", "ä", "a\nb",
        ] {
            let e = check_id("volume", id).expect_err(id);
            assert!(e.to_string().starts_with("invalid volume ID"), "{e}");
        }
        assert!(check_id("volume", &"a".repeat(MAX_ID_LEN + 1)).is_err());
    }

    #[test]
    fn the_engines_prefix_is_theirs() {
        assert!(check_api_alloc_id("web-1").is_ok());
        assert!(check_api_alloc_id("my-docker-x").is_ok());
        let e = check_api_alloc_id("docker-x").expect_err("reserved");
        assert_eq!(
            e.to_string(),
            "invalid allocation ID \"docker-x\": starts with docker-, which is reserved for the mounts of Docker and Podman containers (the Docker volume plugin protocol); choose another ID"
        );
        assert!(check_api_alloc_id("../x").is_err());
    }
}
