//! The console's settings file: `$XDG_CONFIG_HOME/toolgate/console.json`
//! (else `~/.config/toolgate/` on Unix, `~/Library/Application Support/toolgate/`
//! on macOS, `%APPDATA%\toolgate\` on Windows). Small JSON, written whole
//! (a temporary file renamed over it). A damaged file is reported and ignored,
//! never fatal, and never overwritten: the console then keeps its settings in
//! memory only, so nothing the user wrote is lost.

use std::path::{Path, PathBuf};

use super::app::Prefs;

/// The file's name in the config directory.
pub const FILE: &str = "console.json";

/// Where the settings live, when a config directory can be found.
pub fn path() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let dir = if let Some(x) = env("XDG_CONFIG_HOME") {
        x
    } else if cfg!(windows) {
        env("APPDATA")?
    } else if cfg!(target_os = "macos") {
        env("HOME")?.join("Library").join("Application Support")
    } else {
        env("HOME")?.join(".config")
    };
    Some(dir.join("toolgate").join(FILE))
}

/// Reads the settings: `Ok(None)` when there is no file yet; `Err` says what
/// is wrong with a damaged one (never its contents).
pub fn load(path: &Path) -> Result<Option<Prefs>, String> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read it ({})", e.kind())),
    };
    serde_json::from_slice::<Prefs>(&text)
        .map(Some)
        .map_err(|e| format!("it is not valid settings (line {}, column {}: {:?})", e.line(), e.column(), e.classify()))
}

/// Writes the settings (creating the directory).
pub fn save(path: &Path, prefs: &Prefs) -> Result<(), String> {
    let dir = path.parent().ok_or("no directory")?;
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create its directory ({})", e.kind()))?;
    let text = serde_json::to_vec_pretty(prefs).map_err(|e| e.to_string())?;
    let tmp = path.with_extension(format!("json.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| format!("cannot write it ({})", e.kind()))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot replace it ({})", e.kind())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_round_trip_and_a_damaged_file_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("toolgate").join(FILE);
        assert_eq!(load(&p), Ok(None));
        let mut prefs = Prefs::default();
        prefs.filters.insert("stuck".into(), "state:unknown age:>5m".into());
        save(&p, &prefs).unwrap();
        assert_eq!(load(&p), Ok(Some(prefs)));
        std::fs::write(&p, b"{\"filters\": [1, 2").unwrap();
        let e = load(&p).unwrap_err();
        assert!(e.contains("not valid settings"), "{e}");
        std::fs::write(&p, b"{\"filters\": {\"a\": 3}}").unwrap();
        assert!(load(&p).is_err());
    }
}
