//! `api.token_file`: the bearer token for POST /v1/reclaim. Checked with the rest of the
//! configuration, so `check-config` refuses what `run` would refuse.
use std::os::unix::fs::PermissionsExt as _;

use super::ApiConfig;

/// The shortest token accepted.
pub const MIN_TOKEN_LEN: usize = 16;

/// The token from `api.token_file` (trimmed), None when no file is configured. Refused: a
/// file that cannot be read, a token shorter than [`MIN_TOKEN_LEN`] characters, and a file
/// that group or others can access (anyone on the host could kill connections with it).
pub fn read_token(api: &ApiConfig) -> Result<Option<String>, String> {
    let path = &api.token_file;
    if path.is_empty() {
        return Ok(None);
    }
    let meta =
        std::fs::metadata(path).map_err(|e| format!("cannot read the token file {path}: {e}"))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "the token file {path} is accessible by group or others (mode {mode:03o}): \
             `chmod 600 {path}`"
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the token file {path}: {e}"))?;
    let token = text.trim();
    let chars = token.chars().count();
    if chars < MIN_TOKEN_LEN {
        return Err(format!(
            "the token in {path} has {chars} characters; at least {MIN_TOKEN_LEN} are needed"
        ));
    }
    Ok(Some(token.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str, mode: u32) -> String {
        let dir = std::env::temp_dir().join(format!("connreap-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p.display().to_string()
    }

    fn read(path: &str) -> Result<Option<String>, String> {
        read_token(&ApiConfig {
            token_file: path.into(),
        })
    }

    #[test]
    fn token_files_must_exist_be_long_and_private() {
        assert_eq!(read(""), Ok(None));
        let good = file("good", "0123456789abcdef\n", 0o600);
        assert_eq!(read(&good), Ok(Some("0123456789abcdef".into())));
        let e = read("/nonexistent/token").unwrap_err();
        assert!(
            e.contains("/nonexistent/token") && e.contains("No such file"),
            "{e}"
        );
        let short = file("short", "0123456789\n", 0o600);
        let e = read(&short).unwrap_err();
        assert!(e.contains("10 characters") && e.contains("16"), "{e}");
        let open = file("open", "0123456789abcdef\n", 0o644);
        let e = read(&open).unwrap_err();
        assert!(
            e.contains("mode 644") && e.contains("group or others"),
            "{e}"
        );
        let group = file("group", "0123456789abcdef\n", 0o640);
        assert!(read(&group).unwrap_err().contains("mode 640"));
    }
}
